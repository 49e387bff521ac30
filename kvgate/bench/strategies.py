"""The routing strategies `kvgate bench --compare` runs, by name → the EPP built-in profile behind each.

Kept import-free so `kvgate --help` stays instant.
"""

STRATEGIES: dict[str, str] = {
    "round-robin": "round-robin",  # what a plain Kubernetes Service gives
    "random": "random",
    "gie-default": "default",  # GIE's default: queue 2, kv-cache 2, approximate prefix 3
    "precise-prefix": "precise-prefix",  # kvgate: lowest predicted TTFT from the exact prefix held
    "precise-prefix-weights": "precise-prefix-weights",  # kvgate's earlier fixed weights
    "llm-d-tiered": "llm-d-tiered",  # llm-d's tiered prefix cache: GPU and CPU prefix scorers
}
