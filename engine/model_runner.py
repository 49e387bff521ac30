"""The real model runner: loads the model, owns the paged KV cache, runs a step, samples.

CPU: fp32, torch attention backend (batched decode gather, per-chunk SDPA for prefills).
GPU: bf16, Triton kernels, and CUDA graphs for all-decode steps (unless enforce_eager).
"""

from __future__ import annotations

import logging
import math
import time
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kvgate.api.tokenizer import resolve_model
from kvgate.engine.config import EngineConfig
from kvgate.engine.core.runner_api import (
    ModelRunner,
    PromptLogprobsChunk,
    SampledToken,
    ScheduledBatch,
    ScheduledSeq,
    SupportsKVOffload,
    SupportsKVTransfer,
    SupportsLoRA,
)
from kvgate.engine.layers.attention import (
    AttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
    build_attention_metadata,
)
from kvgate.engine.layers.sampler import Sampler, SampleRequest
from kvgate.engine.loader import Checkpoint, load_model, open_checkpoint
from kvgate.engine.models.llama import KVCache, LlamaForCausalLM

if TYPE_CHECKING:
    from kvgate.api.tokenizer import Tokenizer
    from kvgate.engine.cuda_graphs import DecodeGraphs
    from kvgate.engine.loader.peft import LoRAAdapter
    from kvgate.engine.lora_manager import LoRAManager

log = logging.getLogger(__name__)

_DEFAULT_CPU_KV_BYTES = 1 << 30
# Prompt-logprob rows per log-softmax: bounds the fp32 scratch to rows x vocab (256 x 49k = 50 MB).
_PROMPT_LOGPROB_ROWS = 256
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class RunnerConfigError(ValueError):
    """A runner setting cannot be honoured (bad dtype, device, or a KV pool too small to run)."""


def pick_device(requested: str) -> torch.device:
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda") and not torch.cuda.is_available():
        raise RunnerConfigError("device 'cuda' was requested but no CUDA GPU is available")
    if requested not in ("cpu",) and not requested.startswith("cuda"):
        raise RunnerConfigError(f"device {requested!r} is not supported (auto, cpu, cuda)")
    device = torch.device(requested)
    if device.type == "cuda" and device.index is None:
        # Plain "cuda" is the current GPU, named by index: torch.cuda.set_device rejects a
        # device without one, and cuda != cuda:0 when devices are compared.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def pick_dtype(requested: str, device: torch.device) -> torch.dtype:
    if requested == "auto":
        if device.type == "cpu":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    aliases = {
        "fp32": "float32",
        "float": "float32",
        "fp16": "float16",
        "half": "float16",
        "bf16": "bfloat16",
    }
    name = aliases.get(requested, requested)
    if name not in _DTYPES:
        raise RunnerConfigError(f"dtype {requested!r} is not supported (auto, float32, float16, bfloat16)")
    return _DTYPES[name]


class TorchModelRunner:
    """Implements `ModelRunner` for the Llama family on CPU or one GPU."""

    def __init__(self, config: EngineConfig, progress: bool = True, checkpoint: Checkpoint | None = None):
        """Load config.model, or build the model from `checkpoint` (e.g. random weights for a benchmark)."""
        self.config = config
        if config.cpu_threads is not None:
            if config.cpu_threads < 1:
                raise RunnerConfigError("cpu_threads must be at least 1")
            torch.set_num_threads(config.cpu_threads)
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device)
        self.block_size = config.block_size
        if self.block_size < 1:
            raise RunnerConfigError("block_size must be positive")
        if checkpoint is None:
            self.model_path = resolve_model(config.model, download="model")
            checkpoint = open_checkpoint(self.model_path)
        else:
            self.model_path = Path(config.model)
        self.model_config = checkpoint.config
        model_len = checkpoint.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > model_len:
            log.warning(
                "max_model_len %d exceeds the model's context %d; using %d",
                config.max_model_len,
                model_len,
                model_len,
            )
        self.max_model_len = min(config.max_model_len or model_len, model_len)
        self.vocab_size = checkpoint.config.vocab_size
        backend: AttentionBackend = (
            TritonAttentionBackend() if self.device.type == "cuda" else TorchAttentionBackend()
        )
        self._torch_backend = isinstance(backend, TorchAttentionBackend)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.model: LlamaForCausalLM = load_model(
            checkpoint, backend, self.max_model_len, self.dtype, self.device, progress=progress
        )
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            from kvgate.engine.lora_manager import LoRAManager

            self.lora = LoRAManager(
                self.model,
                config.max_loras,
                config.max_lora_rank,
                config.max_cpu_loras,
                self.device,
                self.dtype,
            )
        self.num_kv_blocks = self._size_kv_pool()
        cfg = self.model_config
        self.kv_cache = torch.zeros(
            (cfg.num_layers, 2, self.num_kv_blocks, self.block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self.kv_caches: list[KVCache] = [
            (self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)
        ]
        self.num_host_kv_blocks = 0
        self.kv_copy_seconds_total = 0.0
        self.host_kv: torch.Tensor | None = None
        self._copy_stream: torch.cuda.Stream | None = None
        if config.kv_offloading_size:
            self._allocate_host_kv(config.kv_offloading_size)
        self.sampler = Sampler(self.device, seed=config.seed)
        self._eos_loaded = False
        self.graphs: DecodeGraphs | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self._capture_graphs()
        log.info(
            "model runner ready: %s on %s (%s), %d KV blocks of %d tokens, max_model_len %d",
            self.model_path.name,
            self.device,
            str(self.dtype).removeprefix("torch."),
            self.num_kv_blocks,
            self.block_size,
            self.max_model_len,
        )

    # -- set-up ---------------------------------------------------------------------------------

    @cached_property
    def tokenizer(self) -> Tokenizer:
        from kvgate.api.tokenizer import load_tokenizer

        return load_tokenizer(self.config.tokenizer or self.config.model)

    @property
    def kv_bytes_per_block(self) -> int:
        cfg = self.model_config
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * element

    def _size_kv_pool(self) -> int:
        per_block = self.kv_bytes_per_block
        min_blocks = math.ceil(self.max_model_len / self.block_size)
        if self.config.num_kv_blocks is not None:
            blocks = self.config.num_kv_blocks
        elif self.device.type == "cpu":
            if self.config.kv_cache_memory is not None:
                budget = self.config.kv_cache_memory
            else:
                # 1 GiB, but no more than four full-length sequences need, nor less than one.
                budget = min(_DEFAULT_CPU_KV_BYTES, 4 * min_blocks * per_block)
                budget = max(budget, min_blocks * per_block)
            blocks = budget // per_block
        else:
            blocks = self._gpu_kv_budget() // per_block
        if blocks < 1:
            raise RunnerConfigError(
                f"the KV cache budget holds no block ({per_block} bytes each); raise --kv-cache-memory "
                "or --gpu-memory-utilization"
            )
        if blocks < min_blocks:
            log.warning(
                "KV pool of %d blocks cannot hold one %d-token sequence; long requests will be preempted",
                blocks,
                self.max_model_len,
            )
        return int(blocks)

    def _gpu_kv_budget(self) -> int:
        """gpu_memory_utilization x total, minus what the weights and a peak-size step use."""
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        self._profile_step()
        torch.cuda.synchronize(self.device)
        activation_peak = torch.cuda.max_memory_allocated(self.device) - before
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        used_elsewhere = total - free  # weights, CUDA context, other processes
        budget = int(total * self.config.gpu_memory_utilization) - used_elsewhere - activation_peak
        log.info(
            "GPU memory: total %.1f GiB, in use %.1f GiB, step peak %.2f GiB -> KV budget %.1f GiB",
            total / 2**30,
            used_elsewhere / 2**30,
            activation_peak / 2**30,
            budget / 2**30,
        )
        return max(0, budget)

    def _profile_step(self) -> None:
        """Run the largest step the scheduler may send, into a scratch one-block cache."""
        cfg = self.model_config
        tokens = min(self.config.max_num_batched_tokens, self.max_model_len)
        scratch = torch.zeros(
            (cfg.num_layers, 2, 1, self.block_size, cfg.num_kv_heads, cfg.head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        caches = [(scratch[i, 0], scratch[i, 1]) for i in range(cfg.num_layers)]
        blocks = math.ceil(tokens / self.block_size)
        meta, positions = build_attention_metadata(
            [tokens], [0], [[0] * blocks], self.block_size, self.device, torch_plan=False
        )
        meta.slot_mapping.fill_(-1)  # write nothing: the scratch cache has one block
        with torch.inference_mode():
            ids = torch.zeros(tokens, dtype=torch.long, device=self.device)
            hidden = self.model(ids, positions, caches, meta)
            rows = min(self.config.max_num_seqs, tokens)
            self.model.compute_logits(hidden[:rows]).softmax(-1)
        del scratch, caches

    def _capture_graphs(self) -> None:
        from kvgate.engine.cuda_graphs import DecodeGraphs

        try:
            self.graphs = DecodeGraphs.capture(self)
        except Exception:  # a capture failure must not take the engine down: run eager
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            self.graphs = None

    def _ensure_eos(self) -> None:
        if self._eos_loaded:
            return
        self._eos_loaded = True
        try:
            self.sampler.eos_token_ids = set(self.tokenizer.eos_token_ids)
        except Exception:  # no tokenizer (e.g. a bare test checkpoint): only per-request stop ids
            log.warning(
                "no tokenizer for %s; min_tokens masks only the request's stop_token_ids", self.model_path
            )

    # -- LoRA adapters --------------------------------------------------------------------------

    def _lora_manager(self) -> LoRAManager:
        if self.lora is None:
            raise ValueError("LoRA adapters are not enabled (start the engine with --enable-lora)")
        return self.lora

    def load_lora(self, name: str, path: str) -> LoRAAdapter:
        """Read and check an adapter folder; any thread (the step goes on meanwhile)."""
        return self._lora_manager().load(name, path)

    def add_lora(self, lora_id: int, adapter: object) -> None:
        from kvgate.engine.loader.peft import LoRAAdapter

        assert isinstance(adapter, LoRAAdapter)
        self._lora_manager().add(lora_id, adapter)

    def remove_lora(self, lora_id: int) -> None:
        self._lora_manager().remove(lora_id)

    @property
    def lora_loads_total(self) -> int:
        return self.lora.slot_loads_total if self.lora is not None else 0

    # -- KV transfer (prefill/decode disaggregation) ----------------------------------------------

    def kv_layout(self) -> dict[str, Any]:
        """What one block's KV is: a consumer takes blocks only from a producer laid out alike."""
        cfg = self.model_config
        return {
            "dtype": str(self.dtype).removeprefix("torch."),
            "block_size": self.block_size,
            "num_layers": cfg.num_layers,
            "num_kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "bytes_per_block": self.kv_bytes_per_block,
        }

    def read_kv_blocks(self, block_ids: list[int]) -> list[memoryview]:
        """These blocks' KV, one buffer per block ([layer, k|v, slot, head, dim], contiguous);
        any thread (pinned blocks do not change)."""
        if not block_ids:
            return []
        with torch.inference_mode():
            index = torch.tensor(block_ids, device=self.device)
            data = self.kv_cache.index_select(2, index).permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
            raw = data.reshape(len(block_ids), -1).view(torch.uint8).numpy()
        return [memoryview(row) for row in raw]

    def write_kv_blocks(self, block_ids: list[int], blobs: list[bytes]) -> None:
        """Fill these blocks (held by an import, not yet findable) with pulled KV."""
        if not block_ids:
            return
        cfg = self.model_config
        shape = (len(block_ids), cfg.num_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim)
        with torch.inference_mode():
            buf = torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8).view(self.dtype).view(shape)
            index = torch.tensor(block_ids, device=self.device)
            self.kv_cache.index_copy_(2, index, buf.permute(1, 2, 0, 3, 4, 5).to(self.device))

    # -- the host KV tier (--kv-offloading-size) ------------------------------------------------

    def _allocate_host_kv(self, size_gib: float) -> None:
        """A second pool laid out like the device one ([layer, k|v, block, ...]), in host memory
        (pinned on CUDA, so copies run asynchronously on their own stream)."""
        blocks = int(size_gib * 2**30) // self.kv_bytes_per_block
        if blocks < 1:
            raise RunnerConfigError(
                f"--kv-offloading-size {size_gib} GiB holds no KV block ({self.kv_bytes_per_block} bytes each)"
            )
        shape = list(self.kv_cache.shape)
        shape[2] = blocks
        cuda = self.device.type == "cuda"
        self.host_kv = torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=cuda)
        self.num_host_kv_blocks = blocks
        if cuda:
            self._copy_stream = torch.cuda.Stream(self.device)
        log.info("host KV tier: %d blocks (%.2f GiB)", blocks, blocks * self.kv_bytes_per_block / 2**30)

    def _save_to_host(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks into host slots: (device block, host slot) pairs."""
        if not pairs or self.host_kv is None:
            return
        src = torch.tensor([b for b, _ in pairs], device=self.device)
        dst = torch.tensor([h for _, h in pairs])
        # D2H must be complete before a later step overwrites the device block: a plain copy
        # (synchronous on CUDA with pageable staging; a memcpy on CPU).
        self.host_kv.index_copy_(2, dst, self.kv_cache.index_select(2, src).to("cpu"))

    def _load_from_host(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host slots into device blocks: (device block, host slot) pairs."""
        if not pairs or self.host_kv is None:
            return
        src = torch.tensor([h for _, h in pairs])
        dst = torch.tensor([b for b, _ in pairs], device=self.device)
        staged = self.host_kv.index_select(2, src)
        if self._copy_stream is None:
            self.kv_cache.index_copy_(2, dst, staged)
            return
        # H2D on the copy stream (from pinned memory, so it does not block the host); the step's
        # kernels wait for it on the compute stream, so nothing reads a block before it lands.
        staged = staged.pin_memory()
        with torch.cuda.stream(self._copy_stream):
            on_device = staged.to(self.device, non_blocking=True)
            self.kv_cache.index_copy_(2, dst, on_device)
        torch.cuda.current_stream(self.device).wait_stream(self._copy_stream)

        # -- a step ---------------------------------------------------------------------------------

    def execute(self, batch: ScheduledBatch) -> list[SampledToken]:
        if not batch.seqs:
            return []

        # Decodes (one new token) first, shortest context first: the attention backends batch
        # them together, and the torch backend groups similar lengths to limit padding.
        def key(i: int) -> tuple[bool, int]:
            s = batch.seqs[i]
            return len(s.token_ids) != 1, s.start_pos if len(s.token_ids) == 1 else 0

        order = sorted(range(len(batch.seqs)), key=key)
        seqs = [batch.seqs[i] for i in order]
        self._validate(seqs)
        if batch.kv_saves or batch.kv_loads:
            started = time.perf_counter()
            with torch.inference_mode():
                self._save_to_host(batch.kv_saves)
                self._load_from_host(batch.kv_loads)
            # on CUDA the loads are only queued here: their time shows in the step's
            self.kv_copy_seconds_total += time.perf_counter() - started
        if self.lora is not None:
            self.lora.prepare(seqs, batch.running_lora_ids)
        with torch.inference_mode():
            hidden, last_token_rows = self._forward(seqs)
            if batch.kv_saves_after:
                started = time.perf_counter()
                self._save_to_host(batch.kv_saves_after)
                self.kv_copy_seconds_total += time.perf_counter() - started
            if any(s.prompt_logprob_targets for s in seqs):
                self._prompt_logprobs(batch, seqs, hidden, last_token_rows)
            sampled_seqs = [
                (s, row)
                for s, row in zip(seqs, last_token_rows, strict=True)
                if s.sample and not s.draft_token_ids
            ]
            spec_seqs = [(s, row) for s, row in zip(seqs, last_token_rows, strict=True) if s.draft_token_ids]
            if not sampled_seqs and not spec_seqs:
                return []
            if any(s.sampling_params.min_tokens > s.num_generated for s, _ in sampled_seqs + spec_seqs):
                self._ensure_eos()
            tokens: list[SampledToken] = []
            if sampled_seqs:
                rows = torch.tensor([row for _, row in sampled_seqs], device=self.device)
                logits = self.model.compute_logits(hidden.index_select(0, rows))
                requests = [
                    SampleRequest(
                        s.request_id, s.sampling_params, s.num_generated, batch.bitmask_rows.get(s.request_id)
                    )
                    for s, _ in sampled_seqs
                ]
                tokens += self.sampler(logits, requests, batch.token_bitmask)
            if spec_seqs:
                tokens += self._verify(hidden, spec_seqs, batch)
        by_id = {t.request_id: t for t in tokens}
        return [by_id[s.request_id] for s in batch.seqs if s.sample]

    def _verify(
        self, hidden: torch.Tensor, spec_seqs: list[tuple[ScheduledSeq, int]], batch: ScheduledBatch
    ) -> list[SampledToken]:
        """Speculative decoding: the logits at each seq's last len(drafts) + 1 rows (its last
        token and its drafts), verified by the sampler (a constrained seq under one grammar
        mask per position)."""
        index = [
            row - len(s.draft_token_ids) + i
            for s, row in spec_seqs
            for i in range(len(s.draft_token_ids) + 1)
        ]
        logits = self.model.compute_logits(hidden.index_select(0, torch.tensor(index, device=self.device)))
        return self.sampler.verify(
            logits.float(),
            [
                (
                    SampleRequest(
                        s.request_id, s.sampling_params, s.num_generated, batch.bitmask_rows.get(s.request_id)
                    ),
                    s.draft_token_ids,
                )
                for s, _ in spec_seqs
            ],
            batch.token_bitmask,
        )

    def _prompt_logprobs(
        self, batch: ScheduledBatch, seqs: list[ScheduledSeq], hidden: torch.Tensor, last_rows: list[int]
    ) -> None:
        """Prompt logprobs from this step's hidden states, for the seqs that asked: fp32
        log-softmax over `_PROMPT_LOGPROB_ROWS` rows at a time, keeping only the top-K and the
        actual next token per row, so a long prompt never holds a [tokens, vocab] tensor."""
        for s, last in zip(seqs, last_rows, strict=True):
            targets = s.prompt_logprob_targets
            if not targets:
                continue
            first_row = last - len(s.token_ids) + 1 + s.prompt_logprob_row
            k = s.sampling_params.prompt_logprobs or 0
            out = PromptLogprobsChunk([], [], [], [])
            for lo in range(0, len(targets), _PROMPT_LOGPROB_ROWS):
                part = targets[lo : lo + _PROMPT_LOGPROB_ROWS]
                rows = hidden[first_row + lo : first_row + lo + len(part)]
                logprobs = self.model.compute_logits(rows).float().log_softmax(dim=-1)
                ids = torch.tensor(part, device=logprobs.device)
                chosen = logprobs.gather(1, ids[:, None])  # [rows, 1]
                # vLLM's rank: 1 + how many tokens are strictly more likely.
                ranks = (logprobs > chosen).sum(dim=-1) + 1
                out.token_logprobs.extend(chosen[:, 0].tolist())
                out.token_ranks.extend(ranks.tolist())
                if k:
                    top = logprobs.topk(k, dim=-1)
                    out.top_ids.extend(top.indices.tolist())
                    out.top_logprobs.extend(top.values.tolist())
                else:
                    out.top_ids.extend([] for _ in part)
                    out.top_logprobs.extend([] for _ in part)
                del logprobs
            batch.prompt_logprobs[s.request_id] = out

    def _validate(self, seqs: list[ScheduledSeq]) -> None:
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            if not s.token_ids:
                raise ValueError(f"request {s.request_id}: no tokens to compute")
            if end > self.max_model_len:
                raise ValueError(
                    f"request {s.request_id}: position {end} exceeds max_model_len {self.max_model_len}"
                )
            if len(s.block_table) * self.block_size < end:
                raise ValueError(f"request {s.request_id}: block table covers fewer than {end} tokens")

    def _forward(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, list[int]]:
        query_lens = [len(s.token_ids) for s in seqs]
        ctx_lens = [s.start_pos for s in seqs]
        last_rows = _cumsum_minus1(query_lens)
        flat = [t for s in seqs for t in s.token_ids]
        base_only = self.lora is None or self.lora.batch.slots is None
        if (
            self.graphs is not None
            and base_only
            and all(q == 1 for q in query_lens)
            and self.graphs.fits(len(seqs))
        ):
            hidden = self.graphs.run(flat, ctx_lens, [s.block_table for s in seqs])
            return hidden, last_rows
        meta, positions = build_attention_metadata(
            query_lens,
            ctx_lens,
            [s.block_table for s in seqs],
            self.block_size,
            self.device,
            torch_plan=self._torch_backend,
            decode_num_splits=self._decode_splits(
                len(seqs), max(c + q for c, q in zip(ctx_lens, query_lens, strict=True))
            ),
        )
        input_ids = torch.tensor(flat, dtype=torch.long).to(self.device)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        return hidden, last_rows

    def _decode_splits(self, num_seqs: int, max_seq_len: int) -> int:
        if self._torch_backend:
            return 1
        from kvgate.engine.kernels.paged_attention import decode_num_splits

        return decode_num_splits(max_seq_len, num_seqs, self.model_config.num_kv_heads)


def _cumsum_minus1(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        total += n
        out.append(total - 1)
    return out


if TYPE_CHECKING:  # mypy holds this runner to every contract the engine resolves on it
    _contracts: tuple[
        type[ModelRunner], type[SupportsLoRA], type[SupportsKVTransfer], type[SupportsKVOffload]
    ] = (TorchModelRunner, TorchModelRunner, TorchModelRunner, TorchModelRunner)
