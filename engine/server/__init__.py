"""The engine's HTTP face: OpenAI-compatible API, vLLM metrics, KV-event publisher, lifecycle."""
