"""A model runner with no model, for `--simulate`: real scheduling, KV blocks and events, fake math.

Each step sleeps as long as the timing model says (prefill cost per computed token, plus a
decode cost that grows with the batch) and returns tokens that are a pure function of
(request seed or id, output position), so a request yields the same text whether its prefix
was cached, whether it was preempted and recomputed, and on every engine replica. Tokens are
drawn from ordinary word pieces of the vocabulary so the text reads like (nonsense) words.

Structured outputs are honoured: a constrained request only gets tokens its grammar allows
(the natural word when allowed, and once its natural length is reached the tokens that close
the output: EOS, then a quote, brace or bracket), so simulated JSON is valid JSON.

Speculative decoding: a seq with drafts is verified by the greedy rule against this fake model
(accept drafts while each equals its token at that position, under the grammar's mask for that
position when constrained, then one of its own; logprobs per token as plain decoding gives
them), and costs a decode step plus its drafts at the prefill cost per token.
Never imports torch (a step's token bitmask is read through `tolist()`).
"""

from __future__ import annotations

import hashlib
import math
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvgate.engine.config import EngineConfig
from kvgate.engine.core.runner_api import (
    ModelRunner,
    PromptLogprobsChunk,
    SampledToken,
    ScheduledBatch,
    ScheduledSeq,
    SimulatesTransfer,
    SupportsKVOffload,
    SupportsKVTransfer,
    SupportsLoRA,
)
from kvgate.engine.sampling_params import SamplingParams

_MASK = 0xFFFFFFFFFFFFFFFF
_WORD = re.compile(r"^[Ġ▁ ][a-z]{2,9}$")
_DEFAULT_MAX_MODEL_LEN = 8192
# With no max_tokens and no ignore_eos, a simulated answer ends with EOS after this many tokens
# at most (a real model stops on its own; an endless simulated one would only hit the context).
_MAX_NATURAL_LEN = 256


def _mix(x: int) -> int:
    """splitmix64 finaliser: a cheap, well-spread, stable 64-bit hash step."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return x ^ (x >> 31)


def _stable_str_hash(s: str) -> int:
    return int.from_bytes(hashlib.blake2b(s.encode(), digest_size=8).digest(), "little")


def word_token_ids(tokenizer: Any) -> list[int]:
    """Ids of vocabulary entries that are a space-prefixed lowercase word ("Ġhouse", "▁house")."""
    backend = getattr(tokenizer, "backend", tokenizer)  # kvgate's Tokenizer wraps a `tokenizers` one
    vocab: dict[str, int] = backend.get_vocab()
    return sorted(i for tok, i in vocab.items() if _WORD.match(tok))


def _vocab_size(tokenizer: Any) -> int | None:
    if isinstance(getattr(tokenizer, "vocab_size", None), int):
        return int(tokenizer.vocab_size)
    for attr in ("get_vocab_size", "__len__"):
        fn = getattr(tokenizer, attr, None)
        if callable(fn):
            try:
                return int(fn())
            except TypeError:
                continue
    return None


class SimulatedRunner:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Any | None = None,
        eos_token_id: int | None = None,
        sleep: Any = time.sleep,
    ) -> None:
        sim = config.simulation
        self.sim = sim
        self.block_size = config.block_size
        self.num_kv_blocks = config.num_kv_blocks or sim.num_kv_blocks
        self.max_model_len = config.max_model_len or _DEFAULT_MAX_MODEL_LEN
        self.vocab_size = (_vocab_size(tokenizer) if tokenizer is not None else None) or sim.vocab_size
        self.eos_token_id = eos_token_id
        words = word_token_ids(tokenizer) if tokenizer is not None else []
        if not words:  # no tokenizer: any id clear of the low special range
            words = list(range(min(256, self.vocab_size // 2), self.vocab_size))
        if eos_token_id is not None:
            words = [w for w in words if w != eos_token_id]
        self._words = words
        # Tokens that end what a grammar has open, in the order a closing walk prefers them.
        self._closers: list[int] = [] if eos_token_id is None else [eos_token_id]
        if tokenizer is not None:
            backend = getattr(tokenizer, "backend", tokenizer)
            for text in ('"', "}", "]", ","):
                tid = backend.token_to_id(text) if hasattr(backend, "token_to_id") else None
                if tid is not None:
                    self._closers.append(int(tid))
        self._sleep = sleep
        self._keys: dict[str, int] = {}  # request id -> token-stream key, until it finishes
        self.steps = 0
        self.simulated_seconds = 0.0
        # LoRA: no weights, only the slots (LRU) and what putting an adapter in one costs.
        self.max_loras = config.max_loras
        self.lora_slots: OrderedDict[int, None] = OrderedDict()
        self.lora_loads_total = 0
        # Host KV tier: only its size and what a copy to or from it costs.
        self.num_host_kv_blocks = sim.cpu_kv_blocks or 0
        if not self.num_host_kv_blocks and config.kv_offloading_size:
            block_bytes = sim.kv_bytes_per_token * self.block_size
            self.num_host_kv_blocks = int(config.kv_offloading_size * 2**30) // block_bytes
        self.kv_blocks_copied = 0
        self.kv_copy_seconds_total = 0.0

    def load_lora(self, name: str, path: str) -> str:
        """A simulated engine reads no adapter weights: any path is accepted."""
        return path

    def add_lora(self, lora_id: int, loaded: object) -> None:
        self.lora_slots.pop(lora_id, None)  # new weights: the slot's copy is stale

    def remove_lora(self, lora_id: int) -> None:
        self.lora_slots.pop(lora_id, None)

    # -- KV transfer: no bytes, only what moving them would cost ------------------------------
    def kv_layout(self) -> dict[str, Any]:
        return {
            "simulated": True,
            "block_size": self.block_size,
            "bytes_per_block": self.sim.kv_bytes_per_token * self.block_size,
        }

    def read_kv_blocks(self, block_ids: list[int]) -> list[bytes]:
        return [b""] * len(block_ids)

    def write_kv_blocks(self, block_ids: list[int], blobs: list[bytes]) -> None:
        return None

    def transfer_seconds(self, num_blocks: int) -> float:
        """How long pulling these blocks takes: a latency plus bytes over the link's bandwidth."""
        sim = self.sim
        size = num_blocks * self.block_size * sim.kv_bytes_per_token
        return (sim.kv_transfer_latency + size / sim.kv_transfer_bandwidth) * sim.time_scale

    def offload_seconds(self, num_blocks: int) -> float:
        """How long copying these blocks between the host tier and the device takes."""
        if not num_blocks:
            return 0.0
        sim = self.sim
        size = num_blocks * self.block_size * sim.kv_bytes_per_token
        return (sim.kv_offload_latency + size / sim.kv_offload_bandwidth) * sim.time_scale

    def _slot_loras(self, batch: ScheduledBatch) -> int:
        """Put the step's adapters into slots, LRU; returns how many had to be loaded."""
        wanted = {s.lora_id for s in batch.seqs if s.lora_id is not None}
        loads = 0
        for lora_id in sorted(wanted):
            if lora_id in self.lora_slots:
                self.lora_slots.move_to_end(lora_id)
                continue
            if len(self.lora_slots) >= max(self.max_loras, 1):
                idle = [i for i in self.lora_slots if i not in wanted and i not in batch.running_lora_ids]
                victim = idle[0] if idle else next(i for i in self.lora_slots if i not in wanted)
                del self.lora_slots[victim]
            self.lora_slots[lora_id] = None
            loads += 1
        self.lora_loads_total += loads
        return loads

    def _request_key(self, request_id: str, seed: int | None) -> int:
        if seed is not None:
            return _mix(seed & _MASK)
        key = self._keys.get(request_id)
        if key is None:
            key = self._keys[request_id] = _stable_str_hash(request_id)
        return key

    def step_duration(self, batch: ScheduledBatch) -> float:
        prefill_tokens = 0
        decode_seqs = 0
        for seq in batch.seqs:
            drafts = len(seq.draft_token_ids)
            if seq.num_generated > 0 and len(seq.token_ids) == 1 + drafts:
                decode_seqs += 1
                prefill_tokens += drafts  # verifying drafts: a small prefill chunk after the token
            else:
                prefill_tokens += len(seq.token_ids)
        if not batch.seqs:
            return 0.0
        sim = self.sim
        return (
            sim.prefill_time_per_token * prefill_tokens + sim.itl_base + sim.itl_per_seq * decode_seqs
        ) * sim.time_scale

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        self.steps += 1
        for rid in batch.finished_request_ids:
            self._keys.pop(rid, None)
        delay = self.step_duration(batch)
        # The copies wait for nothing and nothing overlaps them: loads and saves before the
        # step on the same link, the saves after it before the next step may reuse a block.
        copied = len(batch.kv_saves) + len(batch.kv_loads) + len(batch.kv_saves_after)
        if copied:
            self.kv_blocks_copied += copied
            copy_seconds = self.offload_seconds(copied)
            self.kv_copy_seconds_total += copy_seconds
            delay += copy_seconds
        loads = self._slot_loras(batch)
        if loads:
            delay += loads * self.sim.lora_load_time * self.sim.time_scale
        if delay > 0:
            self._sleep(delay)
            self.simulated_seconds += delay
        out: list[SampledToken] = []
        for seq in batch.seqs:
            if seq.prompt_logprob_targets:
                batch.prompt_logprobs[seq.request_id] = self._fake_prompt_logprobs(seq)
            if not seq.sample:
                continue
            params = seq.sampling_params
            key = self._request_key(seq.request_id, params.seed)
            if seq.draft_token_ids:
                out.append(self._verify(seq, key, batch))
                continue
            token, r = self._position(seq, key, batch, 0)
            sampled = SampledToken(request_id=seq.request_id, token_id=token)
            if params.logprobs is not None:
                self._fake_logprobs(sampled, r, params.logprobs)
            out.append(sampled)
        return out

    def _position(self, seq: ScheduledSeq, key: int, batch: ScheduledBatch, i: int) -> tuple[int, int]:
        """The token at the seq's i-th sampled position this step (i > 0: after its drafts
        0..i-1), under its grammar's mask for that position when it is constrained."""
        pos = seq.num_generated + i
        token, r = self._token(seq.sampling_params, key, pos)
        row = batch.bitmask_rows.get(seq.request_id)
        if row is not None and batch.token_bitmask is not None:
            token = self._constrained(batch.token_bitmask[row + i].tolist(), token, r, pos >= 4 + key % 12)
        return token, r

    def _token(self, params: SamplingParams, key: int, pos: int) -> tuple[int, int]:
        """The fake model's token at output position `pos`, and the hash it came from."""
        words = self._words
        r = _mix(key ^ _mix(pos))
        token = words[r % len(words)]
        if (
            self.eos_token_id is not None
            and params.max_tokens is None
            and not params.ignore_eos
            and pos + 1 >= 8 + key % _MAX_NATURAL_LEN
        ):
            token = self.eos_token_id
        return token, r

    def _verify(self, seq: ScheduledSeq, key: int, batch: ScheduledBatch) -> SampledToken:
        """The greedy rule against the fake model: accept drafts while each is the token plain
        decoding makes at that position (under the grammar's mask there), then one of its own;
        each with the logprobs plain decoding would report."""
        tokens: list[int] = []
        hashes: list[int] = []
        for i in range(len(seq.draft_token_ids) + 1):
            token, r = self._position(seq, key, batch, i)
            tokens.append(token)
            hashes.append(r)
            if i == len(seq.draft_token_ids) or seq.draft_token_ids[i] != token:
                break
        sampled = SampledToken.of(seq.request_id, tokens)
        n = seq.sampling_params.logprobs
        if n is not None:
            for i, (token, r) in enumerate(zip(tokens, hashes, strict=True)):
                one = SampledToken(seq.request_id, token)
                self._fake_logprobs(one, r, n)
                if i == 0:
                    sampled.logprob, sampled.top_logprobs = one.logprob, one.top_logprobs
                else:
                    sampled.more_logprobs.append((one.logprob or 0.0, one.top_logprobs or []))
        return sampled

    def _constrained(self, mask: list[int], natural: int | None, r: int, closing: bool) -> int:
        """An allowed token: a closer once the answer has run its natural length, else the
        natural word when allowed, else one of the allowed tokens picked by `r`."""

        def allowed(t: int) -> bool:
            return 0 <= t < len(mask) * 32 and (mask[t >> 5] >> (t & 31)) & 1 == 1

        if closing:
            for t in self._closers:
                if allowed(t):
                    return t
        if natural is not None and natural != self.eos_token_id and allowed(natural):
            return natural
        ids = [w * 32 + b for w, bits in enumerate(mask) if bits for b in range(32) if (bits >> b) & 1]
        ids = [t for t in ids if t < self.vocab_size] or [t for t in self._closers if allowed(t)]
        if not ids:
            raise RuntimeError("the grammar allows no token of this vocabulary")
        return ids[r % len(ids)]

    def _fake_logprobs(self, sampled: SampledToken, r: int, n: int) -> None:
        """Well-formed logprobs: the sampled token is the most likely, the rest trail off."""
        best = -((r >> 8) % 1000 + 1) / 2000.0  # in [-0.5, -0.0005]
        sampled.logprob = best
        top = [(sampled.token_id, best)]
        words = self._words
        x = r
        seen = {sampled.token_id}
        k = 1
        while len(top) < n and len(seen) < len(words):
            x = _mix(x)
            alt = words[x % len(words)]
            if alt in seen:
                continue
            seen.add(alt)
            top.append((alt, best - 1.0 - k * 0.75 - math.log1p(k)))
            k += 1
        sampled.top_logprobs = top[:n] if n > 0 else []

    def _fake_prompt_logprobs(self, seq: ScheduledSeq) -> PromptLogprobsChunk:
        """Well-formed synthetic prompt logprobs (there is no model): each prompt token is the
        most likely at its position (rank 1) with a logprob fixed by (token, position), and the
        top-K trail off below it, so repeated requests see the same values."""
        targets = seq.prompt_logprob_targets or []
        k = seq.sampling_params.prompt_logprobs or 0
        first = seq.start_pos + seq.prompt_logprob_row
        out = PromptLogprobsChunk([], [], [], [])
        words = self._words
        for i, token in enumerate(targets):
            r = _mix(token ^ _mix(first + i))
            best = -((r >> 8) % 1000 + 1) / 2000.0
            ids, values = [token], [best]
            x = r
            while len(ids) < k and len(ids) < len(words):
                x = _mix(x)
                alt = words[x % len(words)]
                if alt not in ids:
                    values.append(best - 1.0 - len(ids) * 0.75)
                    ids.append(alt)
            out.token_logprobs.append(best)
            out.token_ranks.append(1)
            out.top_ids.append(ids[:k])
            out.top_logprobs.append(values[:k])
        return out


if TYPE_CHECKING:  # mypy holds this runner to every contract the engine resolves on it
    _contracts: tuple[
        type[ModelRunner],
        type[SupportsLoRA],
        type[SupportsKVTransfer],
        type[SimulatesTransfer],
        type[SupportsKVOffload],
    ] = (SimulatedRunner, SimulatedRunner, SimulatedRunner, SimulatedRunner, SimulatedRunner)
