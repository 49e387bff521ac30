"""The engine's core: what to compute each step and where its KV lives.

vLLM V1's split between a scheduler and a KV cache manager, independent of how a model runner
computes a step:

- `scheduler`: one token budget per step, running requests first, chunked prefill, preemption
  by recompute; it hands the step to a runner as a `runner_api.ScheduledBatch`.
- `kv_cache_manager` over `block_pool`: paged KV blocks, the prefix cache (blocks named by their
  hash chain) and its eviction order; `host_kv_tier`: the host-memory second tier under it.
- `request`: the per-request state the scheduler, the KV cache manager and the engine share.
- `runner_api`: the contract between the core and a runner. Both runners implement it, the
  model runner (`kvgate.engine.model_runner`) and the simulated one (`kvgate.engine.sim_runner`).
"""
