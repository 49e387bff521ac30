"""Per-request state the scheduler, KV cache manager and engine share."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvgate.engine.outputs import FinishReason, PositionLogprobs, PromptTokenLogprobs
from kvgate.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from kvgate.engine.spec_decode.adaptive import AcceptanceEstimate
    from kvgate.engine.structured.grammar import GrammarMatcher


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3  # eos, a stop token id, a stop string or a completed grammar
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS: dict[RequestStatus, FinishReason] = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """One sequence in the engine (n > 1 fans out into several requests above the engine).

    `all_token_ids` is prompt + output; `num_computed_tokens` of them have KV in the cache.
    After a preemption the whole of `all_token_ids` is recomputed as if it were the prompt.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = field(default_factory=time.time)
    lora_id: int | None = None
    eos_token_ids: frozenset[int] = frozenset()
    # Admission order among requests with equal arrival times (keeps ordering total).
    seq_no: int = 0
    # The waiting order (waiting_queue.py): lower first (vLLM's convention), then requests the
    # EPP did not mark as over their tenant's share; "" is traffic nobody tagged.
    priority: int = 0
    tenant: str = ""
    over_share: bool = False

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prompt tokens served from the prefix cache at first schedule
    num_recomputed_tokens: int = 0  # cached prompt tokens the first schedule computed again
    num_host_cached_tokens: int = 0  # of num_cached_tokens, those loaded from the host KV tier
    expected_cached_tokens: int = 0  # the cache hit its admission found (before scheduling)
    block_hashes: list[int] = field(default_factory=list)  # of each full block of all_token_ids
    block_ids: list[int] = field(default_factory=list)  # physical blocks, in position order
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    # Prompt logprobs gathered so far, for prompt tokens 1.. (the position before predicts each);
    # kept across preemption so recomputed chunks never produce them twice.
    prompt_logprobs: list[PromptTokenLogprobs] | None = None
    prompt_logprobs_sent: bool = False
    grammar: GrammarMatcher | None = None  # structured outputs: where the output is in its grammar
    num_new_tokens: int = 0  # output tokens the last step appended (several when speculating)
    spec_acceptance: AcceptanceEstimate | None = None  # adaptive speculation: its draft acceptance
    spec_num_drafts: int = 0  # its verification steps with drafts
    spec_num_draft_tokens: int = 0  # speculative draft tokens verified for it, in all
    spec_num_accepted_tokens: int = 0  # of those, accepted (before a stop truncated a step)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.logprobs is not None and self.logprobs is None:
            self.logprobs = []
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def next_prompt_logprob_pos(self) -> int | None:
        """The first position whose prompt logprob is still owed (position p predicts prompt
        token p + 1), or None when none is (not asked, or all gathered)."""
        if self.prompt_logprobs is None:
            return None
        done = len(self.prompt_logprobs)
        return done if done < len(self.prompt_token_ids) - 1 else None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def sort_key(self) -> tuple[float, int]:
        return (self.arrival_time, self.seq_no)
