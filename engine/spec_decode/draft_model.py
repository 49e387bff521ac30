"""The draft-model proposer (vLLM's `draft_model` method): a smaller model of the same vocabulary,
in the same process as the target, proposes each request's next k tokens greedily.

The draft keeps a paged KV cache of its own (its own pool, block size and a block table per
request) in step with the accepted tokens: it records, per request, how many of the sequence's
tokens (prompt + accepted output) it holds KV for. A proposal first feeds it the tokens it has
not seen (the whole prompt the first time; after a verification step the tokens that step
accepted), all requests in one batch, then k - 1 one-token steps of its own drafts. Only the
sequence's own tokens count as held: the KV written for drafts sits past that length and is
overwritten by the next catch-up, so rejected drafts never need undoing. A request's blocks go
back to the pool when it ends (`release`); a request the pool cannot hold gets no drafts.

Drafts are the draft's argmax at each position: a deterministic function of the sequence, so
the verifier's point-mass rejection sampling stays exact for sampled requests too (vLLM samples
drafts from the draft's distribution and keeps it for the acceptance test; that accepts more
of a sampled request's drafts, and is not done here). The draft ignores LoRA adapters and
grammars: it only proposes, and verification decides.

`draft_num_layers` (kvgate's key): load only the first N decoder layers of the draft, then its
final norm and lm head; with no `model`, of the target model itself (a truncated self-draft,
useful to test; a real pairing is a small model trained on the same tokenizer).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from kvgate.engine.layers.attention import (
    TorchAttentionBackend,
    TritonAttentionBackend,
    build_attention_metadata,
)
from kvgate.engine.loader import Checkpoint, load_model, open_checkpoint
from kvgate.engine.spec_decode.config import SpeculativeConfig

if TYPE_CHECKING:
    from kvgate.engine.model_runner import TorchModelRunner
    from kvgate.engine.models.llama import KVCache, LlamaForCausalLM

log = logging.getLogger(__name__)

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DraftModelError(ValueError):
    """The draft cannot serve this target (another vocabulary, a bad path, too many layers)."""


def truncated(checkpoint: Checkpoint, num_layers: int) -> Checkpoint:
    """The checkpoint's first `num_layers` decoder layers (then its final norm and lm head)."""
    total = checkpoint.config.num_layers
    if not 1 <= num_layers <= total:
        raise DraftModelError(f"draft_num_layers {num_layers} is not in [1, {total}] for this draft model")
    if num_layers == total:
        return checkpoint
    source = checkpoint.tensors

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in source():
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < num_layers:
                yield name, tensor

    return dataclasses.replace(
        checkpoint,
        config=dataclasses.replace(checkpoint.config, num_layers=num_layers),
        tensors=tensors,
    )


class DraftModelProposer:
    """Proposes greedy drafts from a draft model; the scheduler's `propose` and `release`."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
    ) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        self.max_model_len = max_model_len
        self._torch_backend = device.type != "cuda"
        self.kv_cache = torch.zeros(
            (cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=dtype,
            device=device,
        )
        self.kv_caches: list[KVCache] = [
            (self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)
        ]
        self.num_blocks = num_blocks
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self.block_tables: dict[str, list[int]] = {}
        self.num_computed: dict[str, int] = {}  # tokens of the sequence whose KV the draft holds
        self.num_forward_steps = 0

    @classmethod
    def build(cls, runner: TorchModelRunner, spec: SpeculativeConfig) -> DraftModelProposer:
        """Load the draft for `runner`'s target: `spec.model` (None: the target's own
        checkpoint), truncated to `spec.draft_num_layers`, on the target's device and dtype, with
        a KV pool of as many tokens as the target's."""
        from kvgate.api.tokenizer import resolve_model

        path = runner.model_path if spec.model is None else resolve_model(spec.model, download="model")
        checkpoint = open_checkpoint(path)
        if spec.draft_num_layers is not None:
            checkpoint = truncated(checkpoint, spec.draft_num_layers)
        if checkpoint.config.vocab_size != runner.vocab_size:
            raise DraftModelError(
                f"the draft model's vocabulary ({checkpoint.config.vocab_size} tokens) is not the "
                f"target's ({runner.vocab_size}): a draft must share the target's tokenizer"
            )
        backend = TritonAttentionBackend() if runner.device.type == "cuda" else TorchAttentionBackend()
        max_len = min(runner.max_model_len, checkpoint.config.max_position_embeddings)
        model = load_model(checkpoint, backend, max_len, runner.dtype, runner.device, progress=False)
        # as many tokens as the target's pool, plus one block per k drafts a request may write
        num_blocks = runner.num_kv_blocks + math.ceil(spec.num_speculative_tokens / runner.block_size) + 1
        cfg = checkpoint.config
        log.info(
            "draft model: %s, %d layers, %d KV blocks of %d tokens",
            path.name,
            cfg.num_layers,
            num_blocks,
            runner.block_size,
        )
        return cls(model, num_blocks, runner.block_size, runner.device, runner.dtype, max_len)

    # -- the proposer contract ---------------------------------------------------------------

    def release(self, request_id: str) -> None:
        """The request ended: its blocks go back to the draft's pool."""
        self._free.extend(reversed(self.block_tables.pop(request_id, [])))
        self.num_computed.pop(request_id, None)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def propose(self, seqs: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """Up to k greedy drafts for each (request id, its tokens so far, k), in one batch per
        draft position. A request the draft's pool or context cannot hold gets none."""
        live: list[tuple[str, list[int], int]] = []
        for rid, tokens, k in seqs:
            k = min(k, self.max_model_len - len(tokens))  # the k-th draft's position is never fed
            if k < 1 or not self._reserve(rid, len(tokens) + k - 1):
                continue
            done = min(self.num_computed.get(rid, 0), len(tokens) - 1)  # feed at least one token
            live.append((rid, list(tokens[done:]), k))
            self.num_computed[rid] = done
        if not live:
            return {}
        with torch.inference_mode():
            return self._run(live)

    # -- internals -------------------------------------------------------------------------------

    def _reserve(self, rid: str, num_positions: int) -> bool:
        table = self.block_tables.setdefault(rid, [])
        need = math.ceil(num_positions / self.block_size) - len(table)
        if need > len(self._free):
            return False
        for _ in range(max(0, need)):
            table.append(self._free.pop())
        return True

    def _run(self, live: list[tuple[str, list[int], int]]) -> dict[str, list[int]]:
        drafts: dict[str, list[int]] = {rid: [] for rid, _, _ in live}
        # step 0: each request's unseen tokens (catch-up), decodes first as the backends want
        feed = [(rid, new, self.num_computed[rid]) for rid, new, _ in live]
        for rid, new, _ in live:
            self.num_computed[rid] += len(new)  # the sequence's own tokens: held from now on
        want = {rid: k for rid, _, k in live}
        step = 0
        while feed:
            feed.sort(key=lambda f: len(f[1]) != 1)
            tokens = self._forward(feed)
            step += 1
            nxt = []
            for (rid, new, start), token in zip(feed, tokens, strict=True):
                drafts[rid].append(token)
                if len(drafts[rid]) < want[rid]:
                    nxt.append((rid, [token], start + len(new)))
            feed = nxt
        return drafts

    def _forward(self, feed: list[tuple[str, list[int], int]]) -> list[int]:
        """One draft forward over each (request, new tokens, tokens cached before them); the
        argmax after each request's last new token."""
        query_lens = [len(new) for _, new, _ in feed]
        ctx_lens = [start for _, _, start in feed]
        decode_splits = 1
        if not self._torch_backend:
            from kvgate.engine.kernels.paged_attention import decode_num_splits

            decode_splits = decode_num_splits(
                max(c + q for c, q in zip(ctx_lens, query_lens, strict=True)),
                len(feed),
                self.model.config.num_kv_heads,
            )
        meta, positions = build_attention_metadata(
            query_lens,
            ctx_lens,
            [self.block_tables[rid] for rid, _, _ in feed],
            self.block_size,
            self.device,
            torch_plan=self._torch_backend,
            decode_num_splits=decode_splits,
        )
        flat = [t for _, new, _ in feed for t in new]
        input_ids = torch.tensor(flat, dtype=torch.long).to(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        last = torch.tensor(list(_cumsum_minus1(query_lens)), device=self.device)
        self.num_forward_steps += 1
        return self.model.compute_logits(hidden.index_select(0, last)).argmax(dim=-1).tolist()


def _cumsum_minus1(lengths: list[int]) -> Iterator[int]:
    total = 0
    for n in lengths:
        total += n
        yield total - 1
