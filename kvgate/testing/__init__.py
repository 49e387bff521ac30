"""What kvgate's tests (tests/, e2e/) and benches share, importable from anywhere once kvgate is
installed: no `sys.path` manipulation.

- `polling`: `eventually()` / `eventually_async()`, the one way to wait for a condition.
- `processes`: simulated engines, the EPP and Envoy as processes, built on `kvgate.local`.
- `engine_server`: `kvgate engine serve --port 0` as a process, its address read from its log.
- `local_up`: `kvgate up` run as a user runs it.
- `pods`: a pod the operator writes, run as processes the way the kubelet would.
- `kube_api`: a Kubernetes API server on loopback as a pod sees it (kmock behind TLS).
- `fake_hub`: a Hugging Face Hub on loopback for the real `huggingface_hub` client.
- `foreign_schemas`: KEDA's and Gateway API's schemas for validating what the operator writes.
- `runner_driver`: a minimal scheduler stand-in that drives a ModelRunner directly.

Test-only dependencies (kmock, prometheus-client, ...) are imported by the module that needs
them, so importing `kvgate.testing` itself costs nothing.
"""

from kvgate.testing.polling import NotReached, eventually, eventually_async

__all__ = ["NotReached", "eventually", "eventually_async"]
