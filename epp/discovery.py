"""Where the endpoints are: a static list locally, the InferencePool's Ready pods in Kubernetes."""

from __future__ import annotations

from kvgate.api.contracts.disaggregation import ROLE_BOTH, ROLES
from kvgate.epp.datastore import Endpoint


class EndpointListError(ValueError):
    """A malformed --endpoints / --kv-events-endpoints value."""


def _split(text: str | None) -> list[str]:
    return [p.strip() for p in (text or "").split(",") if p.strip()]


def check_address(address: str, flag: str = "--endpoints") -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise EndpointListError(f"{flag}: {address!r} is not ip:port")
    return address


def split_role(entry: str) -> tuple[str, str]:
    """``ip:port@role`` → (ip:port, role); no suffix: both (serves prefill and decode)."""
    address, sep, role = entry.partition("@")
    if not sep:
        return entry, ROLE_BOTH
    if role not in ROLES:
        raise EndpointListError(
            f"--endpoints: {entry!r} has role {role!r}; the role suffix is one of {', '.join('@' + r for r in ROLES)}"
        )
    return address, role


def static_endpoints(
    endpoints: str, kv_events: str | None = None, kv_replay: str | None = None
) -> list[Endpoint]:
    """``--endpoints a:1,b:2@prefill`` (an optional role suffix each) with optional ZMQ addresses
    in the same order (or one per list)."""
    entries = [split_role(e) for e in _split(endpoints)]
    addresses = [check_address(a) for a, _ in entries]
    if len(set(addresses)) != len(addresses):
        raise EndpointListError("--endpoints lists the same address twice")
    events = _split(kv_events)
    replays = _split(kv_replay)
    for flag, values in (("--kv-events-endpoints", events), ("--kv-replay-endpoints", replays)):
        if values and len(values) != len(addresses):
            raise EndpointListError(
                f"{flag} has {len(values)} entries but --endpoints has {len(addresses)}; give one per endpoint"
            )
        for v in values:
            if not v.startswith(("tcp://", "ipc://", "inproc://")):
                raise EndpointListError(f"{flag}: {v!r} is not a ZMQ address like tcp://127.0.0.1:5557")
    return [
        Endpoint(
            address=a,
            kv_events=events[i] if events else None,
            kv_replay=replays[i] if replays else None,
            name=a,
            role=entries[i][1],
        )
        for i, a in enumerate(addresses)
    ]
