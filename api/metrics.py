"""Metric names shared by the engine (which exports them) and the EPP (which scrapes them).

They are vLLM's names: GIE/llm-d pickers and Grafana dashboards read exactly these.
"""

NUM_REQUESTS_RUNNING = "vllm:num_requests_running"
NUM_REQUESTS_WAITING = "vllm:num_requests_waiting"
KV_CACHE_USAGE_PERC = "vllm:kv_cache_usage_perc"
GPU_CACHE_USAGE_PERC = "vllm:gpu_cache_usage_perc"  # deprecated alias, still read by older pickers
CACHE_CONFIG_INFO = "vllm:cache_config_info"
LORA_REQUESTS_INFO = "vllm:lora_requests_info"
PROMPT_TOKENS_TOTAL = "vllm:prompt_tokens_total"
GENERATION_TOKENS_TOTAL = "vllm:generation_tokens_total"
PREFIX_CACHE_QUERIES_TOTAL = "vllm:prefix_cache_queries_total"
PREFIX_CACHE_HITS_TOTAL = "vllm:prefix_cache_hits_total"
NUM_PREEMPTIONS_TOTAL = "vllm:num_preemptions_total"
KVGATE_DRAINING = "kvgate:draining"  # kvgate's own gauge; not a vLLM name
REQUEST_SUCCESS_TOTAL = "vllm:request_success_total"
TIME_TO_FIRST_TOKEN_SECONDS = "vllm:time_to_first_token_seconds"
INTER_TOKEN_LATENCY_SECONDS = "vllm:inter_token_latency_seconds"
E2E_REQUEST_LATENCY_SECONDS = "vllm:e2e_request_latency_seconds"

LABEL_MODEL_NAME = "model_name"
LABEL_ENGINE = "engine"
