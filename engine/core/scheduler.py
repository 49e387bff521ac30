"""Continuous batching: which tokens of which requests to compute in the next step.

One token budget per step, filled in three passes:

1. running requests: decode tokens and prompts with little left to compute;
2. waiting requests in the policy's order (waiting_queue.py: by default priority, then the
   requests within their tenant's share, then arrival);
3. the next pieces of long prompts being prefilled.

While short prompts keep arriving (no more than `long_prefill_token_threshold` tokens to
compute, within `short_prompt_window_s`), the long ones share `long_prefill_step_tokens`
prompt tokens a step, less what the step's short prompts take, and at most
`max_long_partial_prefills` of a tenant's are in prefill at once: a short request then waits
for a short step, not for a 2,048-token chunk of someone's long prompt. Without short arrivals
long prompts take the whole budget.

Speculative decoding (`SpeculativeConfig`, off by default): a decoding request with n-gram
drafts (for structured outputs, those its grammar allows) computes [last token, drafts] in one step, when its budget and blocks allow (else fewer
or no drafts, never a preemption for them), and `update` appends what the runner accepted. Its
computed length only moves over accepted tokens at `update`, so the prefix cache and KV events
only ever see full blocks of accepted tokens; blocks held for rejected drafts are given back.
Adaptive (the default) cuts each request's drafts to those its acceptance and the measured step
cost say pay, 0 to k (spec_decode/adaptive.py; the engine reports step times to `observe_step`).

When the pool runs dry the policy's last running request (lowest priority, over its tenant's
share, newest) is preempted: its blocks are freed and it goes back to the queue, to be recomputed
(prefix hits make that cheap when its blocks have not been evicted meanwhile).

Under the priority and fair policies a waiting request also preempts running ones of a strictly
lower priority when it finds no batch slot or too few free blocks (pass 0): sheddable work
(a batch job) may then fill every slot without an online arrival waiting behind it for a
generation to end. vLLM waits for a slot instead; its priority policy only chooses whom to
preempt when blocks run out. Same-priority requests never preempt each other.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvgate.engine.core.kv_cache_manager import CacheHit, KVCacheManager
from kvgate.engine.core.request import Request, RequestStatus
from kvgate.engine.core.runner_api import SampledToken, ScheduledBatch, ScheduledSeq
from kvgate.engine.core.waiting_queue import WaitingQueue
from kvgate.engine.spec_decode.adaptive import AdaptiveSpeculator
from kvgate.engine.spec_decode.config import SpeculativeConfig
from kvgate.engine.spec_decode.ngram import propose_ngram_match

log = logging.getLogger(__name__)


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    max_loras: int = 0  # distinct LoRA adapters among running requests; 0: no limit
    scheduling_policy: str = "fair"  # fcfs | priority | fair (waiting_queue.py)
    # A prompt with more uncached tokens than this is long (vLLM's
    # --long-prefill-token-threshold); 0: none is, and nothing below applies.
    long_prefill_token_threshold: int = 0
    # ... and long prompts share this many prompt tokens a step while short ones arrive
    long_prefill_step_tokens: int = 256
    # Long prompts of one tenant (of all, except under the fair policy) in prefill at once
    # (vLLM's --max-long-partial-prefills): the rest wait their turn, short prompts go past.
    max_long_partial_prefills: int = 1
    # The cap holds only while short prompts (no more than the threshold to compute) keep
    # arriving: within this many seconds of the newest arrival. Long prompts alone are
    # computed as fast as the budget allows, since no one waits for their steps.
    short_prompt_window_s: float = 10.0
    speculative: SpeculativeConfig | None = None  # n-gram speculative decoding; None: off


class DraftProposer(Protocol):
    """A proposer that runs a model (spec_decode/draft_model.py): asked once per step for every
    decoding request that may speculate, in one batch, and told when a request ends."""

    def propose(self, seqs: Sequence[tuple[str, Sequence[int], int]]) -> dict[str, list[int]]:
        """Up to k drafts for each (request id, its tokens so far, k); none for some."""
        ...

    def release(self, request_id: str) -> None: ...


@dataclass
class SpecDecodeStats:
    """vLLM's spec_decode counters: verification steps with drafts, draft tokens, accepted
    drafts (before any stop truncates them), and accepted drafts by position (0 = first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class _Step:
    """The batch being built."""

    budget: int  # tokens still allowed (max_num_batched_tokens less those scheduled)
    prefill: int = 0  # prompt tokens scheduled (a decode's single token is not)
    drafts: int = 0  # speculative draft tokens scheduled
    long_pieces: int = 0  # pieces of long prompts scheduled
    preempted: bool = False
    seqs: list[ScheduledSeq] = field(default_factory=list)
    scheduled: set[str] = field(default_factory=set)  # request ids in seqs


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, proposer: DraftProposer | None = None
    ) -> None:
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if (
            config.long_prefill_token_threshold < 0
            or config.long_prefill_step_tokens < 0
            or config.max_long_partial_prefills < 1
        ):
            raise ValueError(
                "long_prefill_token_threshold and long_prefill_step_tokens must be >= 0, "
                "max_long_partial_prefills >= 1"
            )
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []  # sorted by (arrival_time, seq_no)
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []  # since the last batch, for the runner to forget
        self.num_preemptions_total = 0
        self._next_seq_no = 0
        # Prompt tokens of the batch last scheduled, until its step's results come back: those
        # are computed already in our accounting (num_computed_tokens moves at scheduling), but
        # a request arriving now still waits for that step.
        self._in_flight_prefill_tokens = 0
        # When the newest request arrived, and the newest short one of each priority
        # (short_prompt_window_s).
        self._latest_arrival = -math.inf
        self._short_by_priority: dict[int, float] = {}
        self._capping = False  # this step: long prompts get long_prefill_step_tokens, not the budget
        # Unfinished requests that were short at arrival, by priority (and each one's): while a
        # more urgent one is here, a long prompt's pieces are one block (_long_piece).
        self._live_short: Counter[int] = Counter()
        self._short_ids: dict[str, int] = {}
        self._urgent = math.inf  # this step: the most urgent priority among them
        spec = config.speculative
        self.spec_stats = SpecDecodeStats(accepted_per_pos=[0] * (spec.num_speculative_tokens if spec else 0))
        # Adaptive speculation: this engine's (one device's) step-cost model and the k rule
        self.adaptive = AdaptiveSpeculator() if spec is not None and spec.adaptive else None
        # draft_model: the proposer (None: n-gram proposals, made inline), and this step's drafts
        if spec is not None and spec.method != "ngram" and proposer is None:
            raise ValueError(f"speculative method {spec.method!r} needs a proposer")
        self.proposer = proposer if spec is not None else None
        self._proposals: dict[str, list[int]] = {}

    # -- admission and removal -----------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.seq_no = self._next_seq_no
        self._next_seq_no += 1
        request.status = RequestStatus.WAITING
        # What its prefill will cost as things stand now (a router reads the sum, see
        # pending_prefill_tokens); the lookup hashes the prompt once, which scheduling reuses.
        request.expected_cached_tokens = self.kv.get_computed_blocks(request).num_tokens
        self._latest_arrival = max(self._latest_arrival, request.arrival_time)
        if request.num_tokens - request.expected_cached_tokens <= self.config.long_prefill_token_threshold:
            seen = self._short_by_priority
            seen[request.priority] = max(seen.get(request.priority, -math.inf), request.arrival_time)
            self._short_ids[request.request_id] = request.priority
            self._live_short[request.priority] += 1
            if len(seen) > 64:  # priorities a client may name are many: keep the recent ones
                horizon = self._latest_arrival - self.config.short_prompt_window_s
                for old in [p for p, t in seen.items() if t < horizon]:
                    del seen[old]
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish_request(request, RequestStatus.FINISHED_ABORTED)
        return request

    def finish_request(
        self, request: Request, status: RequestStatus, stop_reason: int | str | None = None
    ) -> None:
        """End a request wherever it is (waiting, running, mid-prefill) and free its blocks."""
        if request.is_finished:
            return
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        request.status = status
        request.stop_reason = stop_reason
        request.finished_time = time.time()
        self.kv.free(request)
        if self.proposer is not None:
            self.proposer.release(request.request_id)
        del self.requests[request.request_id]
        priority = self._short_ids.pop(request.request_id, None)
        if priority is not None:
            self._live_short[priority] -= 1
            if not self._live_short[priority]:
                del self._live_short[priority]
        self._finished_ids.append(request.request_id)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def in_flight_prefill_tokens(self) -> int:
        """Prompt tokens in the step now running (between schedule and update)."""
        return self._in_flight_prefill_tokens

    def pending_prefill_tokens(self) -> int:
        """Prompt tokens still to compute, queued and running, and those of the step in flight:
        the prefill work ahead of a new request, in the engine's own accounting (cache hits
        known at admission excluded). Without the step in flight, an engine computing the last
        chunk of a long prompt would look idle for that whole step."""
        return (
            self._in_flight_prefill_tokens
            + sum(map(_prefill_left, self.running))
            + sum(map(_prefill_left, self.waiting))
        )

    def sheddable_load(self) -> tuple[int, int, int]:
        """(running, waiting, prefill tokens pending) of the requests of a priority below the
        default (engine priority > 0: the EPP's sheddable work). Under the priority and fair
        policies pass 0 preempts them for any default-priority arrival, so a router places such
        an arrival as if they were not there. Zeros under fcfs, which preempts nothing."""
        if self.waiting.policy == "fcfs":
            return (0, 0, 0)
        running = [r for r in self.running if r.priority > 0]
        waiting = [r for r in self.waiting if r.priority > 0]
        return (
            len(running),
            len(waiting),
            sum(map(_prefill_left, running)) + sum(map(_prefill_left, waiting)),
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- scheduling ----------------------------------------------------------------------
    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.add_front(victim)

    def _victim(self, scheduled: set[str]) -> Request:
        """Who gives its blocks back when the pool runs dry, among the running requests not in
        this step's batch yet: the newest arrival; under a priority order the newest of the
        lowest priority; under the fair one, of those, one over its tenant's share."""
        candidates = [r for r in self.running if r.request_id not in scheduled]
        return max(candidates, key=self.waiting.order_key)

    def _make_room(self, budget: int) -> None:
        """Preempt, lowest-ranked first, the running requests of a lower priority than the
        waiting ones this step could admit but finds no slot or blocks for: waiting requests in
        the policy's order while the step's token budget lasts (they are admitted in pass 2).
        Not under fcfs, where priority means nothing; never for an equal priority, so over-share
        order and arrival never evict running work."""
        head = self.waiting.peek()
        if self.waiting.policy == "fcfs" or head is None or not self.running:
            return
        # The queue is in priority order: when its head outranks nothing running (the common
        # case, one priority), nothing behind it does, and the step pays for no more than this.
        if head.priority >= max(r.priority for r in self.running):
            return
        cfg = self.config
        slots = cfg.max_num_seqs - len(self.running)
        reserved = 0  # free blocks the requests accounted for here will take
        adapters = self.running_lora_ids()
        # long prompts in prefill, per tenant: one more of a tenant at its limit waits in pass 2
        longs = Counter(
            self.waiting.tenant_of(r)
            for r in self.running
            if self._is_long(r, r.num_tokens - r.num_computed_tokens)
        )
        for request in list(self.waiting):
            if budget <= 0:
                return
            lora = request.lora_id
            if cfg.max_loras and lora is not None and lora not in adapters and len(adapters) >= cfg.max_loras:
                continue  # passed over in pass 2 anyway
            tenant = self.waiting.tenant_of(request)
            if longs[tenant] >= cfg.max_long_partial_prefills and self._is_long(request, request.num_tokens):
                continue  # likewise: a preemption for it would only be refilled by the victim
            while True:
                hit = self.kv.get_computed_blocks(request)
                num_new = min(request.num_tokens - hit.num_tokens, budget)
                revived = sum(1 for b in hit.blocks if b.ref_cnt == 0)  # free now, taken by the hit
                need = self.kv.blocks_needed(hit.num_tokens + num_new) - len(hit.blocks)
                if slots > 0 and need <= self.kv.num_free_blocks - revived - reserved:
                    break
                victim = max(self.running, key=self.waiting.order_key, default=None)
                if victim is None or victim.priority <= request.priority:
                    return  # nothing it outranks; neither does anything behind it
                self._preempt(victim)
                slots += 1
            slots -= 1
            reserved += need
            budget -= num_new
            if lora is not None:
                adapters.add(lora)

    def _is_long(self, request: Request, num_new: int) -> bool:
        """While the cap holds: a prompt whose uncached part is longer than
        long_prefill_token_threshold, with more than a step's allowance still to compute (the
        whole of it: its last tokens are as long a step as its first). A short prompt computed
        again after a preemption (prompt and output) is not long."""
        cfg = self.config
        cached = max(request.num_cached_tokens, request.expected_cached_tokens, 0)
        return (
            self._capping
            and num_new > cfg.long_prefill_step_tokens
            and request.num_prompt_tokens - cached > cfg.long_prefill_token_threshold
        )

    def _long_piece(self, step: _Step, request: Request) -> int:
        """How much of a long prompt fits this step: what the step's prompt tokens leave of
        long_prefill_step_tokens; for a prompt of lower priority than a short request still
        in this engine (waiting or running), one block, as the step's only long piece (so a
        step in flight holds the next urgent arrival up for little more than a decode step)."""
        piece = self.config.long_prefill_step_tokens - step.prefill
        if request.priority > self._urgent:
            return min(piece, self.kv.block_size) if step.long_pieces == 0 else 0
        return piece

    def _continue(self, request: Request, num_new: int, step: _Step) -> None:
        """Schedule up to ``num_new`` more tokens of a running request, preempting (the policy's
        victim, maybe this very request) until its blocks fit."""
        cfg = self.config
        num_new = min(num_new, step.budget, cfg.max_model_len - request.num_computed_tokens)
        if num_new <= 0:
            return
        covered = len(request.block_ids) * self.kv.block_size
        if num_new == 1 and self._speculate(request, step, covered):
            return
        # Most decode steps stay inside the last block: no allocation to do.
        while request.num_computed_tokens + num_new > covered and self.kv.allocate(request, num_new) is None:
            victim = self._victim(step.scheduled)
            self._preempt(victim)
            step.preempted = True
            if victim is request:
                return
        self._add(request, num_new, step)

    def _speculate(self, request: Request, step: _Step, covered: int) -> bool:
        """Schedule a decoding request's last token with drafts after it (n-gram, or this step's
        from the draft model), if it may
        speculate and some drafts fit the step's budget, its limits and the free blocks."""
        spec = self.config.speculative
        if spec is None or not _may_speculate(request):
            return False
        k = min(self._max_drafts(request), step.budget - 1)
        if k < 1:
            return False
        if self.proposer is not None:
            drafts, match_len = self._proposals.get(request.request_id, [])[:k], 0
        else:
            drafts, match_len = propose_ngram_match(
                request.all_token_ids, k, spec.prompt_lookup_min, spec.prompt_lookup_max
            )
        if drafts and request.grammar is not None:
            # Structured outputs: only the drafts the grammar allows in turn (the first one it
            # forbids, and all after, could never be accepted)
            del drafts[request.grammar.valid_drafts(drafts) :]
        if not drafts:
            return False
        adaptive = self.adaptive
        if adaptive is not None:
            if request.spec_acceptance is None:
                request.spec_acceptance = adaptive.new_estimate()
            # the step as it will be: every running request's token, what is scheduled so far
            num_seqs = len(self.running)
            keep = adaptive.num_drafts(
                request.spec_acceptance,
                len(drafts),
                match_len,
                num_seqs,
                num_seqs + step.prefill + step.drafts,
            )
            del drafts[keep:]
            if not drafts:
                return False
        num_new = 1 + len(drafts)
        if request.num_computed_tokens + num_new > covered:
            while drafts and self.kv.allocate(request, 1 + len(drafts)) is None:
                drafts.pop()  # fewer drafts, never a preemption for them
            if not drafts:
                return False
        self._add(request, 1, step)
        seq = step.seqs[-1]
        seq.token_ids.extend(drafts)
        seq.draft_token_ids = drafts
        step.budget -= len(drafts)
        step.drafts += len(drafts)
        return True

    def _max_drafts(self, request: Request) -> int:
        """The most drafts a decoding request may take, by its limits (not the step's budget)."""
        spec = self.config.speculative
        assert spec is not None
        # drafts sit at positions num_tokens .. num_tokens + k - 1, inside the context
        k = min(spec.num_speculative_tokens, self.config.max_model_len - request.num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:  # the step makes up to k + 1 tokens
            k = min(k, max_tokens - request.num_output_tokens - 1)
        return k

    def _propose_all(self) -> None:
        """draft_model: this step's drafts for every running request that may speculate, in one
        batch (the proposer's forward passes), before any is scheduled."""
        self._proposals = {}
        if self.proposer is None:
            return
        seqs = [
            (r.request_id, r.all_token_ids, k)
            for r in self.running
            if r.status == RequestStatus.RUNNING and _may_speculate(r) and (k := self._max_drafts(r)) > 0
        ]
        if seqs:
            self._proposals = self.proposer.propose(seqs)

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """Adaptive speculation: what a step took. Decode-only steps feed the step-cost fit
        (tokens computed, drafts included, against seconds); steps with prompt tokens are
        another regime and are left out."""
        if self.adaptive is None or not batch.seqs:
            return
        tokens = 0
        for seq in batch.seqs:
            if seq.num_generated == 0 or len(seq.token_ids) != 1 + len(seq.draft_token_ids):
                return
            tokens += len(seq.token_ids)
        self.adaptive.observe_step(tokens, seconds)

    def _add(self, request: Request, num_new: int, step: _Step) -> None:
        """Put ``num_new`` tokens of a request (its blocks allocated) into the step."""
        step.seqs.append(self._seq(request, num_new))
        step.scheduled.add(request.request_id)
        if request.num_computed_tokens < request.num_prompt_tokens or num_new > 1:
            step.prefill += num_new
        request.num_computed_tokens += num_new
        # Findable at once: a request admitted next in this very step may reuse them.
        self.kv.cache_full_blocks(request, request.num_computed_tokens)
        step.budget -= num_new

    def _seq(self, request: Request, num_new: int) -> ScheduledSeq:
        start = request.num_computed_tokens
        end = start + num_new
        self._in_flight_prefill_tokens += max(0, min(end, len(request.prompt_token_ids)) - start)
        seq = ScheduledSeq(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_pos=start,
            block_table=request.block_ids,
            sample=end == request.num_tokens,
            sampling_params=request.sampling_params,
            num_generated=request.num_output_tokens,
            lora_id=request.lora_id,
        )
        _ask_prompt_logprobs(seq, request)
        return seq

    def schedule(self) -> ScheduledBatch:
        cfg = self.config
        block_size = self.kv.block_size
        step = _Step(budget=cfg.max_num_batched_tokens)
        self._in_flight_prefill_tokens = 0  # counted as each seq is built (_seq)
        self.kv.begin_step()
        if self.adaptive is not None:
            self.adaptive.begin_step()
        self._propose_all()
        horizon = self._latest_arrival - cfg.short_prompt_window_s
        self._capping = (
            cfg.enable_chunked_prefill
            and cfg.long_prefill_token_threshold > 0
            and cfg.long_prefill_step_tokens > 0
            # some short prompt arrived within the window
            and any(t >= horizon for t in self._short_by_priority.values())
        )
        # Only while the more urgent short work is still here: an arrival window would keep
        # every lower-priority long prompt at a block a step for seconds after the last urgent
        # request, and for ever under sparse urgent traffic (one every few seconds).
        self._urgent = min(self._live_short, default=math.inf)

        # 0. Slots and blocks for waiting requests that outrank running ones.
        self._make_room(cfg.max_num_batched_tokens - len(self.running))

        # 1. Running requests, oldest first: decodes and prompts with little left to compute.
        #    A long prompt being prefilled in pieces waits for step 3, so that what is admitted
        #    in step 2 goes before its next piece.
        long_partials: list[Request] = []
        for request in list(self.running):
            if step.budget <= 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted for an earlier one's room
            num_new = request.num_tokens - request.num_computed_tokens
            if not cfg.enable_chunked_prefill and num_new > step.budget:
                continue
            if self._is_long(request, num_new):
                long_partials.append(request)
                continue
            self._continue(request, num_new, step)
        longs = Counter(self.waiting.tenant_of(r) for r in long_partials)

        # 2. Waiting requests, in the policy's order, while there is room. Not after a
        #    preemption: the pool is short and admitting more would only thrash.
        #    A request whose adapter would be one more than max_loras waits (in place) while
        #    the ones behind it, base-model requests included, go ahead; so does a long prompt
        #    while max_long_partial_prefills are being computed.
        now = time.time()
        adapters = self.running_lora_ids()
        passed_over: list[Request] = []
        while (
            self.waiting and step.budget > 0 and not step.preempted and len(self.running) < cfg.max_num_seqs
        ):
            head = self.waiting.peek()
            assert head is not None  # the loop runs while some request waits
            request = head
            lora = request.lora_id
            if cfg.max_loras and lora is not None and lora not in adapters and len(adapters) >= cfg.max_loras:
                self.waiting.remove(request)
                passed_over.append(request)
                continue
            hit = self.kv.get_computed_blocks(request)
            if request.prompt_logprobs is not None:
                hit = _limit_cache_hit(request, hit, block_size)
            num_hit = hit.num_tokens
            num_new = request.num_tokens - num_hit
            if not cfg.enable_chunked_prefill and num_new > step.budget:
                break
            long = self._is_long(request, num_new)
            if long:
                piece = self._long_piece(step, request)
                tenant = self.waiting.tenant_of(request)
                if longs[tenant] >= cfg.max_long_partial_prefills or piece < block_size:
                    self.waiting.remove(request)  # its turn comes; shorter ones go past it
                    passed_over.append(request)
                    continue
                num_new = piece
            num_new = min(num_new, step.budget)
            if self.kv.allocate(request, num_new, *hit) is None:
                break
            if long:
                longs[tenant] += 1
                step.long_pieces += 1
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.num_recomputed_tokens = self.kv.recomputed_tokens(request, num_hit)
            if request.first_scheduled_time is None:
                request.first_scheduled_time = now
            bisect.insort(self.running, request, key=lambda r: r.sort_key)
            self._add(request, num_new, step)
            if lora is not None:
                adapters.add(lora)
        for request in reversed(passed_over):
            self.waiting.add_front(request)

        # 3. The long prompts' next pieces, in the policy's order, in what is left of the
        #    step's prefill allowance (long_prefill_step_tokens less the prompt tokens
        #    already in it); the first always gets a block, so long prompts never stall.
        for request in sorted(long_partials, key=self.waiting.order_key):
            if step.budget <= 0:
                break
            piece = self._long_piece(step, request)
            if step.long_pieces == 0:
                piece = max(piece, block_size)
            if piece < block_size:
                continue  # (a lower priority's; a more urgent one may still fit)
            if request.status == RequestStatus.RUNNING:
                self._continue(request, piece, step)
                step.long_pieces += 1

        # An empty batch never reaches the runner, so finished ids wait for the next real one.
        finished: list[str] = []
        if step.seqs:
            finished, self._finished_ids = self._finished_ids, []
        transfers = self.kv.end_step()  # empty unless a seq was scheduled
        return ScheduledBatch(
            seqs=step.seqs,
            finished_request_ids=finished,
            running_lora_ids=frozenset(adapters),
            kv_saves=transfers.saves,
            kv_loads=transfers.loads,
            kv_saves_after=transfers.saves_after,
        )

    def running_lora_ids(self) -> set[int]:
        return {r.lora_id for r in self.running if r.lora_id is not None}

    def waiting_lora_ids(self) -> set[int]:
        return {r.lora_id for r in self.waiting if r.lora_id is not None}

    # -- after the step ------------------------------------------------------------------
    def update(self, batch: ScheduledBatch, sampled: list[SampledToken]) -> list[Request]:
        """Record the step's results: append sampled tokens, stop finished requests.

        Returns the requests that received a token this step (finished ones included; check
        `is_finished`). Stop strings are the engine's job (they need text).
        """
        self._in_flight_prefill_tokens = 0
        by_id = {s.request_id: s for s in sampled}
        touched: list[Request] = []
        now = time.time()
        for seq in batch.seqs:
            request = self.requests.get(seq.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            if not seq.sample:
                continue
            token = by_id.get(seq.request_id)
            if token is None:
                raise RuntimeError(f"runner returned no token for {seq.request_id}")
            tokens = token.token_ids
            if len(tokens) > len(seq.draft_token_ids) + 1:
                raise RuntimeError(f"runner returned {len(tokens)} tokens for {seq.request_id}")
            if seq.draft_token_ids:
                self._count_accepted(len(seq.draft_token_ids), len(tokens) - 1)
                request.spec_num_drafts += 1
                request.spec_num_draft_tokens += len(seq.draft_token_ids)
                request.spec_num_accepted_tokens += len(tokens) - 1
                if self.adaptive is not None and request.spec_acceptance is not None:
                    self.adaptive.observe_acceptance(
                        request.spec_acceptance, len(seq.draft_token_ids), len(tokens) - 1
                    )
            touched.append(request)
            request.num_new_tokens = 0
            for token_id in tokens:
                # One at a time, as plain decoding would: the first stop or limit ends it.
                if not self._append(request, token_id, now):
                    break
            if seq.draft_token_ids and not request.is_finished:
                # The accepted drafts' KV is computed; the last token's is not (as after any
                # sampling step). The blocks held for rejected drafts go back.
                request.num_computed_tokens += len(tokens) - 1
                self.kv.trim(request, request.num_tokens)
        return touched

    def _count_accepted(self, num_drafts: int, num_accepted: int) -> None:
        stats = self.spec_stats
        stats.num_drafts += 1
        stats.num_draft_tokens += num_drafts
        stats.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            stats.accepted_per_pos[pos] += 1

    def _append(self, request: Request, token_id: int, now: float) -> bool:
        """Append one sampled token and stop the request if it ends there. False: stopped."""
        request.append_output_token(token_id)
        request.num_new_tokens += 1
        if request.first_token_time is None:
            request.first_token_time = now
        if request.grammar is not None and not request.grammar.accept(token_id):
            # The sampler draws allowed tokens only, so this is a bug somewhere: end the
            # request rather than stream output that breaks its constraint.
            log.error(
                "request %s sampled token %d, which its grammar does not allow (%s); stopping it",
                request.request_id,
                token_id,
                request.grammar.error,
            )
            request.grammar = None
            self.finish_request(request, RequestStatus.FINISHED_STOPPED, None)
            return False
        status, reason = self._check_stop(request, token_id)
        if status is not None:
            self.finish_request(request, status, reason)
            return False
        return True

    def _check_stop(self, request: Request, token_id: int) -> tuple[RequestStatus | None, int | None]:
        params = request.sampling_params
        n_out = request.num_output_tokens
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED, token_id
        if request.grammar is not None and request.grammar.finished:
            return RequestStatus.FINISHED_STOPPED, None  # complete: nothing but EOS may follow
        if params.max_tokens is not None and n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH, None
        if request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH, None
        return None, None


def _prefill_left(request: Request) -> int:
    """Prompt tokens (and, after a preemption, output) still to compute before it decodes."""
    if request.status == RequestStatus.RUNNING:
        return max(0, len(request.prompt_token_ids) - request.num_computed_tokens)
    return max(0, request.num_tokens - max(request.expected_cached_tokens, request.num_computed_tokens))


def _may_speculate(request: Request) -> bool:
    """Whether a request may take drafts: one decoding (its prompt computed, a token sampled).
    Structured outputs speculate with drafts cut at the first token their grammar forbids and
    each position verified under its own mask; logprobs are reported per verified position;
    prompt logprobs are all gathered before decoding starts. n > 1 fans out above the engine
    into requests of their own; the sampler applies no penalties from history. min_tokens and
    seeds are honoured per position by the verifier."""
    return request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1


def _limit_cache_hit(request: Request, hit: CacheHit, block_size: int) -> CacheHit:
    """A request still owed prompt logprobs takes no cache hit past the first position it needs:
    those positions must go through the model. Requests that do not ask keep full cache use."""
    need = request.next_prompt_logprob_pos
    if need is None or hit.num_tokens <= need:
        return hit
    return hit.first_blocks(need // block_size, block_size)


def _ask_prompt_logprobs(seq: ScheduledSeq, request: Request) -> None:
    """Point the runner at the rows of this chunk whose prompt logprobs are still owed: position
    p predicts prompt token p + 1, for p from the first one owed (positions a preemption makes
    the model compute again are skipped) up to the second-to-last prompt token."""
    first = request.next_prompt_logprob_pos
    if first is None:
        return
    start = seq.start_pos
    end = start + len(seq.token_ids)
    lo, hi = max(start, first), min(end, request.num_prompt_tokens - 1)
    if lo >= hi:
        return
    seq.prompt_logprob_row = lo - start
    seq.prompt_logprob_targets = request.prompt_token_ids[lo + 1 : hi + 1]
