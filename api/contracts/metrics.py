"""Metric names and thresholds shared across components: the engine exports vLLM's gauges and
the EPP scrapes them; the EPP exports GIE's pool gauges and the operator's autoscalers read them.

They are vLLM's and GIE's names: GIE/llm-d pickers and Grafana dashboards read exactly these.
Nothing here imports anything, so every component (and its image) can use it.
"""

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
CPU_CACHE_USAGE_PERC = "vllm:cpu_cache_usage_perc"  # vLLM V0's name: the host KV tier's use
GPU_CACHE_USAGE_PERC = "vllm:gpu_cache_usage_perc"  # deprecated alias, still read by older pickers
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
KVGATE_DRAINING = "kvgate:draining"  # kvgate's own gauge; not a vLLM name
# kvgate's own counters: KV blocks copied to / loaded back from the host tier
KVGATE_KV_OFFLOAD_STORES_TOTAL = "kvgate:kv_offload_stores_total"
KVGATE_KV_OFFLOAD_LOADS_TOTAL = "kvgate:kv_offload_loads_total"
KVGATE_KV_OFFLOAD_SECONDS_TOTAL = "kvgate:kv_offload_seconds_total"  # time steps spent copying
# kvgate's own gauge: prompt tokens still to prefill (queued and running), cache hits excluded
KVGATE_PREFILL_TOKENS_PENDING = "kvgate:prefill_tokens_pending"
# kvgate's own gauge: the engine's batch slots (--max-num-seqs), so a router knows how many of
# its picks the engine runs at once instead of queueing
KVGATE_MAX_NUM_SEQS = "kvgate:max_num_seqs"
# kvgate's own gauges: the part of the running, waiting and prefill counts that is sheddable
# work (GIE priority < 0, e.g. batch lines). The engine preempts it for a waiting request of a
# higher priority, so a router places online requests as if it were not there.
KVGATE_NUM_REQUESTS_RUNNING_SHEDDABLE = "kvgate:num_requests_running_sheddable"
KVGATE_NUM_REQUESTS_WAITING_SHEDDABLE = "kvgate:num_requests_waiting_sheddable"
KVGATE_PREFILL_TOKENS_PENDING_SHEDDABLE = "kvgate:prefill_tokens_pending_sheddable"
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"
# vLLM's per-request phase histograms (arrival -> first scheduled -> first token -> last token)
REQUEST_QUEUE_TIME_SECONDS = "vllm:request_queue_time_seconds"
REQUEST_PREFILL_TIME_SECONDS = "vllm:request_prefill_time_seconds"
REQUEST_DECODE_TIME_SECONDS = "vllm:request_decode_time_seconds"
REQUEST_INFERENCE_TIME_SECONDS = "vllm:request_inference_time_seconds"
REQUEST_TIME_PER_OUTPUT_TOKEN_SECONDS = "vllm:request_time_per_output_token_seconds"
# vLLM's per-request size histograms
REQUEST_PROMPT_TOKENS = "vllm:request_prompt_tokens"
REQUEST_GENERATION_TOKENS = "vllm:request_generation_tokens"
REQUEST_PREFILL_KV_COMPUTED_TOKENS = "vllm:request_prefill_kv_computed_tokens"
REQUEST_MAX_NUM_GENERATION_TOKENS = "vllm:request_max_num_generation_tokens"
REQUEST_PARAMS_N = "vllm:request_params_n"
REQUEST_PARAMS_MAX_TOKENS = "vllm:request_params_max_tokens"
ITERATION_TOKENS_TOTAL = "vllm:iteration_tokens_total"  # a histogram despite the suffix (vLLM's name)
# vLLM's prompt-token accounting counters
PROMPT_TOKENS_BY_SOURCE_TOTAL = "vllm:prompt_tokens_by_source_total"  # label `source`
PROMPT_TOKENS_CACHED_TOTAL = "vllm:prompt_tokens_cached_total"
PROMPT_TOKENS_RECOMPUTED_TOTAL = "vllm:prompt_tokens_recomputed_total"
EXTERNAL_PREFIX_CACHE_QUERIES_TOTAL = "vllm:external_prefix_cache_queries_total"
EXTERNAL_PREFIX_CACHE_HITS_TOTAL = "vllm:external_prefix_cache_hits_total"
MM_CACHE_QUERIES_TOTAL = "vllm:mm_cache_queries_total"
MM_CACHE_HITS_TOTAL = "vllm:mm_cache_hits_total"
ENGINE_SLEEP_STATE = "vllm:engine_sleep_state"  # label `sleep_state`

# vLLM's speculative decoding counters, exported only with --speculative-config
SPEC_DECODE_NUM_DRAFTS_TOTAL = "vllm:spec_decode_num_drafts_total"
SPEC_DECODE_NUM_DRAFT_TOKENS_TOTAL = "vllm:spec_decode_num_draft_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_TOTAL = "vllm:spec_decode_num_accepted_tokens_total"
SPEC_DECODE_NUM_ACCEPTED_TOKENS_PER_POS_TOTAL = (
    "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # `position`
)

LABEL_MODEL_NAME = "model_name"
LABEL_ENGINE = "engine"

# ---------------------------------------------------------------------------------------------
# The endpoint picker's pool gauges (GIE's `inference_pool_*` names, label `name` = the pool).
# The EPP exports them; the operator's autoscalers and status read them from Prometheus.
# ---------------------------------------------------------------------------------------------

LABEL_POOL_NAME = "name"
POOL_READY_PODS = "inference_pool_ready_pods"
POOL_AVERAGE_QUEUE_SIZE = "inference_pool_average_queue_size"
POOL_AVERAGE_KV_CACHE_UTILIZATION = "inference_pool_average_kv_cache_utilization"
POOL_PER_POD_QUEUE_SIZE = "inference_pool_per_pod_queue_size"
LABEL_MODEL_SERVER_POD = "model_server_pod"
# Not exported by anyone: the External metric an HPA on `saturation` asks a metrics adapter for
# (a prometheus-adapter rule computing `saturation()` below from the two averages).
POOL_SATURATION = "kvgate_inference_pool_saturation"

# ---------------------------------------------------------------------------------------------
# Saturation (docs/architecture.md, "Saturation"; GIE's saturation-detector defaults): an
# endpoint is saturated at this many waiting requests or this KV-cache use. The EPP sheds
# sheddable work past them (its config can move them); the operator's `saturation` autoscaling
# metric is the same formula.
# ---------------------------------------------------------------------------------------------

SATURATION_QUEUE_DEPTH = 5.0
SATURATION_KV_CACHE_UTILIZATION = 0.8


def saturation(
    queue: float,
    kv_cache_utilization: float,
    queue_threshold: float = SATURATION_QUEUE_DEPTH,
    kv_threshold: float = SATURATION_KV_CACHE_UTILIZATION,
) -> float:
    """max(queue / queue threshold, KV use / KV threshold): 1.0 or more is saturated."""
    return max(queue / queue_threshold, kv_cache_utilization / kv_threshold)
