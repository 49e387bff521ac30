"""Verify draft tokens against the target model's distributions at the k + 1 positions.

Greedy requests: accept drafts while each equals the target's argmax; then the target's own
token (at the first mismatch, or the bonus token after all k). The output is token for token
what one-at-a-time greedy decoding makes.

Sampled requests: rejection sampling for a deterministic proposer (the draft distribution is a
point mass on d_i): accept d_i with probability p(d_i); on rejection, draw from p with d_i
removed and renormalised, and stop; after k acceptances draw a bonus token from the last row.
Each output token is then distributed exactly as p, the target's (tempered, top-k/p, min-p)
distribution. Position i draws from generator `generators[i]`: seeded requests pass one seeded
by (seed, position), so their runs reproduce (they differ from a run without speculation,
which draws differently, but follow the same distribution).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(target: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """target: the argmax at each of the len(drafts) + 1 positions."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        if d != target[i]:
            break
        out.append(d)
    out.append(int(target[len(out)]))
    return out


def _draw(p: torch.Tensor, generator: torch.Generator) -> int:
    """One token from probabilities p (the exponential race: argmax p / E, E ~ Exp(1))."""
    noise = torch.empty_like(p).exponential_(generator=generator)
    return int((p / noise).argmax())


def rejection_sample(
    probs: torch.Tensor, drafts: Sequence[int], generators: Sequence[torch.Generator]
) -> list[int]:
    """probs: [len(drafts) + 1, vocab], the target's distribution at each position (row i
    predicts the token after draft i - 1). Returns the accepted drafts and one token more."""
    out: list[int] = []
    for i, d in enumerate(drafts):
        p = probs[i]
        g = generators[i]
        u = torch.rand((), device=p.device, generator=g)
        if bool(u < p[d]):
            out.append(int(d))
            continue
        residual = p.clone()
        residual[d] = 0.0
        mass = residual.sum()
        # p(d) < 1 here (u < 1 always accepts a sure draft), so the residual has mass, but
        # rounding may leave none: then d is the only token the target allows.
        out.append(_draw(residual / mass, g) if bool(mass > 0) else int(d))
        return out
    out.append(_draw(probs[len(drafts)], generators[len(drafts)]))
    return out
