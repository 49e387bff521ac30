"""argparse value types and flags every kvgate command shares, so a flag reads the same everywhere."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


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


def non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def non_negative_float(text: str) -> float:
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


def add_log_level(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, default_format: str = "text"
) -> None:
    """`--log-level`, `--log-format` and `--quiet` as every server spells them (kvgate.api.logs)."""
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log verbosity"
    )
    add_log_format(parser, default_format)


def otlp_url(text: str) -> str:
    """An OpenTelemetry collector URL: http(s)://host[:port][/path]."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(text)
        parts.port  # noqa: B018 (raises on a port that is not a number or out of range)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected http(s)://host[:port], got {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"expected http(s)://host[:port], got {text!r}")
    return text


def add_otlp_endpoint(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--otlp-endpoint",
        type=otlp_url,
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/HTTP to this collector (e.g. http://127.0.0.1:4318); "
        "default: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT / OTEL_EXPORTER_OTLP_ENDPOINT, else tracing is off",
    )


def add_log_format(parser: argparse.ArgumentParser | argparse._ArgumentGroup, default: str = "text") -> None:
    parser.add_argument(
        "--log-format",
        default=default,
        choices=["text", "json"],
        help="one line per record: 'text' (time level logger: message) or 'json' (one object per line)",
    )
    parser.add_argument("--quiet", action="store_true", help="log only warnings and errors")


# What `--trust-request-chat-template` allows, the same on the engine and the EPP; the limits are
# kvgate.api.chat_template.UntrustedTemplateLimits' defaults (a test checks they agree).
REQUEST_TEMPLATE_FLAG = "--trust-request-chat-template"
REQUEST_TEMPLATE_LIMITS_HELP = "a child process limited to 2 s and 256 MiB"


def add_request_template_flag(group: argparse._ArgumentGroup, what: str) -> None:
    """`--trust-request-chat-template`; `what` says what the server does with such a template."""
    group.add_argument(
        REQUEST_TEMPLATE_FLAG,
        action="store_true",
        help=f"{what}; off: such requests get a 400. Even when on, each renders in "
        f"{REQUEST_TEMPLATE_LIMITS_HELP}",
    )


@dataclass(frozen=True)
class SimTiming:
    """The simulated engine's timing as the --sim-* flags give it; None: unset (the engine's own
    default, engine/config.py's SimulationConfig)."""

    prefill_time_per_token: float | None = None
    itl: float | None = None
    itl_per_seq: float | None = None
    kv_blocks: int | None = None
    time_scale: float | None = None
    lora_load_time: float | None = None
    kv_transfer_bandwidth: float | None = None
    cpu_kv_blocks: int | None = None
    kv_offload_bandwidth: float | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> SimTiming:
        """The values of the flags `add_simulation_group` declared."""
        return cls(**{f.field: getattr(args, f.dest) for f in SIM_FLAGS})

    def argv(self) -> list[str]:
        """These values as --sim-* flags (the unset ones left out), for an engine command line."""
        out: list[str] = []
        for f in SIM_FLAGS:
            value = getattr(self, f.field)
            if value is not None:
                out += [f.flag, str(value)]
        return out


@dataclass(frozen=True)
class SimFlag:
    field: str  # SimTiming's
    flag: str
    type: Callable[[str], Any]
    help: str

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")


SIM_FLAGS = (
    SimFlag("prefill_time_per_token", "--sim-prefill-time-per-token", non_negative_float,
            "seconds per computed prompt token"),
    SimFlag("itl", "--sim-itl", non_negative_float, "seconds per decode step at batch 1"),
    SimFlag("itl_per_seq", "--sim-itl-per-seq", non_negative_float,
            "extra seconds per step for each sequence decoding in it"),
    SimFlag("kv_blocks", "--sim-kv-blocks", positive_int, "KV blocks per simulated engine"),
    SimFlag("time_scale", "--sim-time-scale", non_negative_float,
            "multiply every simulated duration (0.1: ten times faster)"),
    SimFlag("lora_load_time", "--sim-lora-load-time", non_negative_float,
            "extra seconds a step takes per LoRA adapter it puts into a slot"),
    SimFlag("kv_transfer_bandwidth", "--sim-kv-transfer-bandwidth", positive_float,
            "bytes per second a prefill/decode KV pull moves (131,072 KV bytes per token)"),
    SimFlag("cpu_kv_blocks", "--sim-cpu-kv-blocks", positive_int,
            "blocks in each simulated engine's host KV tier (turns the tier on)"),
    SimFlag("kv_offload_bandwidth", "--sim-kv-offload-bandwidth", positive_float,
            "bytes per second between the host KV tier and the device (default 50e9, PCIe 5.0 x16)"),
)  # fmt: skip


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
    defaults: SimTiming | None = None,
) -> argparse._ArgumentGroup:
    """The simulated engine's timing flags (--sim-*), declared once for `kvgate engine serve`,
    `kvgate up` and `kvgate bench`. The engine passes its defaults (engine/config.py's
    SimulationConfig); a default left None means "unset: the engine's own". With `simulate_help`
    the group starts with --simulate itself. `defaults` gives them all at once."""
    if defaults is None:
        defaults = SimTiming(prefill_time_per_token, itl, itl_per_seq, kv_blocks, time_scale)
    g = parser.add_argument_group(title)
    if simulate_help is not None:
        g.add_argument("--simulate", action="store_true", help=simulate_help)
    for f in SIM_FLAGS:
        g.add_argument(f.flag, type=f.type, default=getattr(defaults, f.field), help=f.help)
    return g
