"""The contract between the scheduler (what to compute) and a model runner (how).

The scheduler hands a `ScheduledBatch` to `ModelRunner.execute`; the runner computes the new
tokens' KV into the listed blocks, runs the model, and samples one token for each sequence
that reached its sampling point (several with speculative decoding: a seq with
`draft_token_ids` gets the drafts it accepted plus one token of its own). The real runner (torch/Triton) and the simulated runner
(`--simulate`) both implement it, so everything above it is shared.

Ordering contract: within each layer, a runner stores the KV of every token in the batch
before any sequence's attention reads the cache. The prefix cache relies on it: a sequence
admitted with a prefix hit may read blocks that another sequence of the same batch is
computing in this very step (as in vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from kvgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class ScheduledSeq:
    request_id: str
    token_ids: list[int]  # tokens to compute this step: a prompt chunk, or the last sampled token
    start_pos: int  # tokens already in the KV cache (position of token_ids[0])
    block_table: list[int]  # physical blocks covering positions [0, start_pos + len(token_ids))
    sample: bool  # True when this step completes the prompt or decodes: sample one token
    sampling_params: SamplingParams
    num_generated: int = 0  # tokens generated before this step (seeds stay reproducible)
    # Prompt logprobs: rows [prompt_logprob_row, prompt_logprob_row + len(targets)) of this
    # chunk predict `prompt_logprob_targets` (the next prompt tokens). None: not asked for.
    prompt_logprob_row: int = 0
    prompt_logprob_targets: list[int] | None = None
    lora_id: int | None = None  # the request's LoRA adapter (None: the base model)
    # Speculative decoding: token_ids is [last sampled token, *draft_token_ids]; the runner
    # computes all of them (KV included) and verifies the drafts against the model's
    # distributions at those len(draft_token_ids) + 1 positions (spec_decode/verify.py); a
    # constrained seq's bitmask rows are then [row, row + len(draft_token_ids)], one per position.
    # Only decoding seqs with sample=True get drafts. Empty: a plain step.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class PromptLogprobsChunk:
    """What a runner computed for one chunk's prompt positions (one entry per target token)."""

    token_logprobs: list[float]  # of each target (the actual next prompt token)
    token_ranks: list[int]  # 1 = the most likely token
    top_ids: list[list[int]]  # top-K token ids per position, best first
    top_logprobs: list[list[float]]


@dataclass
class ScheduledBatch:
    seqs: list[ScheduledSeq]
    finished_request_ids: list[str] = field(default_factory=list)  # drop per-request runner state
    # Filled by the runner during `execute`, for each seq with prompt_logprob_targets: computed
    # from the same forward pass as the prefill, so it travels beside the sampled tokens.
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)
    # Structured outputs: the tokens each constrained seq may sample this step, as an int32
    # [rows, ceil(vocab / 32)] bitmask on the CPU (bit t % 32 of word t // 32: token t is
    # allowed), and each constrained seq's row. Unconstrained seqs have no row.
    token_bitmask: torch.Tensor | None = None
    bitmask_rows: dict[str, int] = field(default_factory=dict)
    # The adapters of every running request (scheduled this step or not): a runner keeps
    # them in their slots rather than evict one a request still needs.
    running_lora_ids: frozenset[int] = frozenset()
    # Copies between the device KV pool and the host tier, as (device block, host slot) pairs
    # (see kv_cache_manager.Transfers). Before the step computes anything: `kv_saves`, then
    # `kv_loads` (host slot -> device block); after it: `kv_saves_after`. Only a runner that
    # reports host blocks (`SupportsKVOffload`) ever gets any.
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, int]] = field(default_factory=list)
    kv_saves_after: list[tuple[int, int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SampledToken:
    request_id: str
    token_id: int  # the (first) token this step made for the seq
    logprob: float | None = None  # of the sampled token, when logprobs were requested
    top_logprobs: list[tuple[int, float]] | None = None  # top-N (token_id, logprob), best first
    # Speculative decoding: the tokens after `token_id`, in order (the rest of the accepted
    # drafts, then the model's own token); empty for a plain step. When logprobs were
    # requested, `more_logprobs` holds (logprob, top-N) for each of them, in order.
    more_token_ids: list[int] = field(default_factory=list)
    more_logprobs: list[tuple[float, list[tuple[int, float]]]] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """Every token this step made for the seq, in order."""
        return [self.token_id, *self.more_token_ids]

    @classmethod
    def of(cls, request_id: str, token_ids: list[int]) -> SampledToken:
        return cls(request_id, token_ids[0], more_token_ids=token_ids[1:])


class ModelRunner(Protocol):
    block_size: int
    num_kv_blocks: int  # blocks the KV pool holds (from the memory budget)
    vocab_size: int
    max_model_len: int

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        """Run one step. Returns one SampledToken per seq with `sample=True`, in batch order
        (one or more tokens each: see `ScheduledSeq.draft_token_ids`)."""
        ...


# Capabilities beyond `execute`: the engine resolves each once (isinstance) when it is built, and
# mypy checks both runners (TorchModelRunner, SimulatedRunner) against them.


@runtime_checkable
class SupportsLoRA(Protocol):
    """Serves LoRA adapters (--enable-lora): `load_lora` reads one in any thread, `add_lora` and
    `remove_lora` (between steps) register and drop it under an id."""

    @property
    def lora_loads_total(self) -> int:
        """Adapter loads into a slot so far (a metric)."""
        ...

    def load_lora(self, name: str, path: str) -> object: ...

    def add_lora(self, lora_id: int, adapter: object) -> None: ...

    def remove_lora(self, lora_id: int) -> None: ...


@runtime_checkable
class SupportsKVTransfer(Protocol):
    """Copies KV blocks out and in (prefill/decode disaggregation), in any thread."""

    def kv_layout(self) -> dict[str, Any]:
        """What one block's KV is: a consumer takes blocks only from a producer laid out alike."""
        ...

    def read_kv_blocks(self, block_ids: list[int]) -> Sequence[bytes | memoryview]: ...

    def write_kv_blocks(self, block_ids: list[int], blobs: list[bytes]) -> None: ...


@runtime_checkable
class SupportsKVOffload(Protocol):
    """Keeps a host KV pool of `num_host_kv_blocks` blocks (`--kv-offloading-size`; 0: none) and
    makes a batch's `kv_saves` / `kv_loads` / `kv_saves_after` copies around its step."""

    num_host_kv_blocks: int
    kv_copy_seconds_total: float  # time its steps spent on those copies (a metric)


@runtime_checkable
class SimulatesTransfer(Protocol):
    """Moves no bytes (a simulated runner) but says how long moving them would take."""

    def transfer_seconds(self, num_blocks: int) -> float: ...
