"""Wire contracts: what one component sends and another reads, byte for byte or name for name.

- `kv_events`: the KV-cache events engines publish over ZMQ and the EPP decodes (vLLM's layout).
- `metrics`: the Prometheus names engines export and the EPP scrapes, and the pool gauges the
  EPP exports and the operator's autoscalers read (vLLM's and GIE's names).

These modules import nothing from kvgate, so any component (and its image) can use them;
tests/test_foundation.py keeps it so.
"""
