"""argparse value types every kvgate command shares, so a bad flag reads the same everywhere."""

from __future__ import annotations

import argparse


def boolean(text: str) -> bool:
    """`--flag=true|false` (GIE's style, e.g. `--secure-serving=false`)."""
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def port(text: str) -> int:
    """A TCP port; 0 lets the OS pick a free one."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {value}")
    return value


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def add_simulation_group(
    parser: argparse.ArgumentParser,
    title: str,
    *,
    simulate_help: str | None = None,
    prefill_time_per_token: float | None = None,
    itl: float | None = None,
    itl_per_seq: float | None = None,
    kv_blocks: int | None = None,
    time_scale: float | None = None,
) -> argparse._ArgumentGroup:
    """The simulated engine's timing flags (--sim-*), declared once for `kvgate engine serve`,
    `kvgate up` and `kvgate bench`. The engine passes its defaults (engine/config.py's
    SimulationConfig); a default left None means "unset: the engine's own". With `simulate_help`
    the group starts with --simulate itself."""
    g = parser.add_argument_group(title)
    if simulate_help is not None:
        g.add_argument("--simulate", action="store_true", help=simulate_help)
    g.add_argument(
        "--sim-prefill-time-per-token",
        type=non_negative_float,
        default=prefill_time_per_token,
        help="seconds per computed prompt token",
    )
    g.add_argument(
        "--sim-itl", type=non_negative_float, default=itl, help="seconds per decode step at batch 1"
    )
    g.add_argument(
        "--sim-itl-per-seq",
        type=non_negative_float,
        default=itl_per_seq,
        help="extra seconds per step for each sequence decoding in it",
    )
    g.add_argument(
        "--sim-kv-blocks", type=positive_int, default=kv_blocks, help="KV blocks per simulated engine"
    )
    g.add_argument(
        "--sim-time-scale",
        type=non_negative_float,
        default=time_scale,
        help="multiply every simulated duration (0.1: ten times faster)",
    )
    return g
