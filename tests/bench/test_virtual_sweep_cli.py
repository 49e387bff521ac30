"""bench/virtual_sweep.py refuses what the virtual pool cannot run with a usage error, not a
stack trace."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "virtual_sweep.py"


def test_a_preset_that_needs_a_prefill_decode_split_is_a_usage_error() -> None:
    # the virtual pool has no P/D split: pd-long-prompt once ended in a TypeError traceback
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--preset", "pd-long-prompt"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "invalid choice: 'pd-long-prompt'" in done.stderr
    assert "Traceback" not in done.stderr
