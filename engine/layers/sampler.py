"""Turn one step's logits into tokens: greedy, temperature, min-p, top-k, top-p, seeds, logprobs.

Batched: every row of the step goes through the same tensor ops; only seeded rows draw their
noise one by one (each from its own generator, so a seeded request samples the same tokens no
matter what else is in the batch).

Sampling uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks index i with
probability p_i, so no cumulative sums or multinomial calls are needed.

A seeded request's noise for its k-th generated token comes from a generator seeded with
(seed, k). That makes sampling a pure function of (seed, position): reproducible across runs,
batch mixes and preemption-by-recompute, with no per-request state to leak.

Logprobs follow vLLM: log-softmax of the raw model logits (before temperature or any masking).

Speculative decoding: `verify` takes the k + 1 rows of each seq with drafts and returns the
tokens it accepts (spec_decode/verify.py), position i drawing as the (num_generated + i)-th
token would (min_tokens, the seeded generator, the grammar's mask after the drafts before it),
with logprobs for each token returned when asked.

Structured outputs arrive as a token bitmask per constrained row; it is applied before any
sampling transform, so temperature, top-k/p and min-p act on the allowed tokens only.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch

from kvgate.engine.core.runner_api import SampledToken
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.spec_decode.verify import accept_greedy, rejection_sample
from kvgate.engine.structured.bitmask import unpack_bitmask

_GREEDY_EPS = 1e-5  # temperatures below this are treated as greedy (as vLLM does)
_MASK64 = (1 << 64) - 1


@dataclass
class SampleRequest:
    """One row of the logits: which request, its parameters, and how many tokens it has made."""

    request_id: str
    params: SamplingParams
    num_generated: int = 0
    bitmask_row: int | None = None  # row of the step's token bitmask (structured outputs)


def _mix_seed(seed: int, step: int) -> int:
    """A well-spread 63-bit generator seed from (request seed, token index): splitmix64."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def _is_greedy(p: SamplingParams) -> bool:
    return p.temperature < _GREEDY_EPS or p.top_k == 1


class Sampler:
    def __init__(
        self, device: torch.device, seed: int = 0, stop_token_ids_for_min_tokens: Collection[int] = ()
    ):
        self.device = device
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)
        # Masked while a request is below min_tokens (the model's EOS ids; per-request stop ids are added).
        self.eos_token_ids = set(stop_token_ids_for_min_tokens)

    def __call__(
        self,
        logits: torch.Tensor,
        rows: Sequence[SampleRequest],
        token_bitmask: torch.Tensor | None = None,
    ) -> list[SampledToken]:
        """logits: [len(rows), vocab] fp32; token_bitmask: int32 [k, ceil(vocab/32)], indexed
        by each row's `bitmask_row`. Returns one SampledToken per row, in order."""
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} requests")
        if not rows:
            return []
        raw = logits
        logits = self._mask_min_tokens(logits, rows)
        if token_bitmask is not None:
            logits = self._mask_grammar(raw, logits, rows, token_bitmask)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(rows) if not _is_greedy(r.params)]
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            sampled = self._sample(logits.index_select(0, index), [rows[i] for i in random_rows])
            tokens = tokens.index_copy(0, index, sampled)
        return self._package(raw, tokens, rows)

    def _mask_min_tokens(self, logits: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
        masked: torch.Tensor | None = None
        for i, r in enumerate(rows):
            if r.num_generated >= r.params.min_tokens:
                continue
            stop_ids = [
                t for t in {*self.eos_token_ids, *r.params.stop_token_ids} if 0 <= t < logits.shape[1]
            ]
            if not stop_ids:
                continue
            if masked is None:
                masked = logits.clone()
            masked[i, stop_ids] = float("-inf")
        return logits if masked is None else masked

    @staticmethod
    def _mask_grammar(
        raw: torch.Tensor, logits: torch.Tensor, rows: Sequence[SampleRequest], token_bitmask: torch.Tensor
    ) -> torch.Tensor:
        """Disallowed tokens to -inf on the constrained rows only. Where min_tokens masked the
        only tokens the grammar allows (its end), the grammar wins: it cannot be extended."""
        constrained = [(i, r.bitmask_row) for i, r in enumerate(rows) if r.bitmask_row is not None]
        if not constrained:
            return logits
        index = torch.tensor([i for i, _ in constrained], device=logits.device)
        masks = token_bitmask.index_select(0, torch.tensor([b for _, b in constrained]))
        allowed = unpack_bitmask(masks.to(logits.device), logits.shape[1])
        sub = logits.index_select(0, index).masked_fill(~allowed, float("-inf"))
        dead = torch.isneginf(sub).all(dim=-1)
        if bool(dead.any()):
            grammar_only = raw.index_select(0, index).masked_fill(~allowed, float("-inf"))
            sub = torch.where(dead[:, None], grammar_only, sub)
        return logits.index_copy(0, index, sub)

    def verify(
        self,
        logits: torch.Tensor,
        seqs: Sequence[tuple[SampleRequest, list[int]]],
        token_bitmask: torch.Tensor | None = None,
    ) -> list[SampledToken]:
        """logits: len(drafts) + 1 consecutive rows per (seq, drafts), in order: row i predicts
        the token after draft i - 1. Returns each seq's accepted drafts plus one token.

        Row i of a seq is treated as plain decoding treats its (num_generated + i)-th token:
        min_tokens, the seeded generator, and for a constrained seq (`bitmask_row` set) the
        grammar mask at bitmask row `bitmask_row + i` (the state after drafts 0..i-1). Seqs
        that ask for logprobs get them for every token returned, from the raw logits."""
        rows = [
            SampleRequest(
                r.request_id,
                r.params,
                r.num_generated + i,
                None if r.bitmask_row is None else r.bitmask_row + i,
            )
            for r, drafts in seqs
            for i in range(len(drafts) + 1)
        ]
        if logits.shape[0] != len(rows):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(rows)} verified positions")
        raw = logits
        logits = self._mask_min_tokens(logits, rows)
        if token_bitmask is not None:
            logits = self._mask_grammar(raw, logits, rows, token_bitmask)
        target = logits.argmax(dim=-1).tolist()
        out: list[SampledToken] = []
        first = 0
        for r, drafts in seqs:
            n = len(drafts) + 1
            if _is_greedy(r.params):
                tokens = accept_greedy(target[first : first + n], drafts)
            else:
                probs = self._probs(logits[first : first + n], rows[first : first + n])
                tokens = rejection_sample(
                    probs, drafts, [self._generator_for(q) for q in rows[first : first + n]]
                )
            sampled = SampledToken.of(r.request_id, tokens)
            if r.params.logprobs is not None:
                # row i gave token i: its logprobs as plain decoding reports them
                chosen = torch.tensor(tokens, device=raw.device)
                per_token = self._package(
                    raw[first : first + len(tokens)], chosen, rows[first : first + len(tokens)]
                )
                sampled.logprob = per_token[0].logprob
                sampled.top_logprobs = per_token[0].top_logprobs
                sampled.more_logprobs = [(t.logprob or 0.0, t.top_logprobs or []) for t in per_token[1:]]
            out.append(sampled)
            first += n
        return out

    def _generator_for(self, row: SampleRequest) -> torch.Generator:
        if row.params.seed is None:
            return self._generator
        g = torch.Generator(device=self.device)
        g.manual_seed(_mix_seed(row.params.seed, row.num_generated))
        return g

    def _probs(self, logits: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
        """The distribution each row samples from: temperature, min-p, top-k, top-p."""
        device = logits.device
        vocab = logits.shape[1]
        temperature = torch.tensor([r.params.temperature for r in rows], device=device, dtype=torch.float32)
        logits = logits / temperature[:, None]

        min_p = [r.params.min_p for r in rows]
        if any(p > 0 for p in min_p):
            probs = logits.softmax(dim=-1)
            threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device)[:, None]
            logits = logits.masked_fill(probs < threshold, float("-inf"))

        top_k = [r.params.top_k if 0 < r.params.top_k < vocab else vocab for r in rows]
        top_p = [r.params.top_p for r in rows]
        use_top_p = any(p < 1.0 for p in top_p)
        if use_top_p:
            logits = self._top_k_top_p(logits, top_k, top_p)
        elif any(k < vocab for k in top_k):
            logits = self._top_k(logits, top_k)
        return logits.softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, rows: Sequence[SampleRequest]) -> torch.Tensor:
        device = logits.device
        vocab = logits.shape[1]
        probs = self._probs(logits, rows)
        noise = torch.empty_like(probs)
        seeded = [i for i, r in enumerate(rows) if r.params.seed is not None]
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if len(unseeded) == len(rows):
            noise.exponential_(generator=self._generator)
        else:
            if unseeded:
                idx = torch.tensor(unseeded, device=device)
                draw = torch.empty((len(unseeded), vocab), device=device).exponential_(
                    generator=self._generator
                )
                noise.index_copy_(0, idx, draw)
            for i in seeded:
                r = rows[i]
                assert r.params.seed is not None
                g = torch.Generator(device=device)
                g.manual_seed(_mix_seed(r.params.seed, r.num_generated))
                noise[i].exponential_(generator=g)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
        k = torch.tensor(top_k, device=logits.device)
        kth = logits.topk(int(k.max()), dim=-1).values  # [R, k_max], descending
        threshold = kth.gather(1, (k - 1)[:, None])
        return logits.masked_fill(logits < threshold, float("-inf"))

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(logits.shape[1], device=logits.device)[None, :]
        k = torch.tensor(top_k, device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        # Keep the smallest prefix whose mass reaches p (always the top token); p = 1 keeps all.
        p = torch.tensor([q if q < 1.0 else float("inf") for q in top_p], device=logits.device)[:, None]
        sorted_logits = sorted_logits.masked_fill((before >= p) & (ranks > 0), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)

    @staticmethod
    def _package(
        raw: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SampleRequest]
    ) -> list[SampledToken]:
        want = [r.params.logprobs for r in rows]
        token_list = tokens.tolist()
        if all(n is None for n in want):
            return [SampledToken(r.request_id, t) for r, t in zip(rows, token_list, strict=True)]
        wanted_rows = [i for i, n in enumerate(want) if n is not None]
        index = torch.tensor(wanted_rows, device=raw.device)
        logprobs = raw.index_select(0, index).log_softmax(dim=-1)
        chosen = logprobs.gather(1, tokens.index_select(0, index)[:, None])[:, 0].tolist()
        top_n = max(n or 0 for n in want)
        top_values: list[list[float]] = []
        top_ids: list[list[int]] = []
        if top_n:
            top = logprobs.topk(top_n, dim=-1)
            top_values, top_ids = top.values.tolist(), top.indices.tolist()
        out = [SampledToken(r.request_id, t) for r, t in zip(rows, token_list, strict=True)]
        for j, i in enumerate(wanted_rows):
            n = want[i] or 0
            out[i].logprob = chosen[j]
            out[i].top_logprobs = list(zip(top_ids[j][:n], top_values[j][:n], strict=True)) if n else []
        return out
