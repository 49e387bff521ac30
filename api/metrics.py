"""Old home of the metric-name contract, now `kvgate.api.contracts.metrics`.

Kept only while kvgate/bench/engine_metrics.py still imports `kvgate.api.metrics`; delete this
file once it imports `kvgate.api.contracts.metrics` (tests/test_foundation.py lists it as the one
allowed alias).
"""

from kvgate.api.contracts.metrics import *  # noqa: F403
