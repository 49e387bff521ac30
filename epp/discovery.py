"""Where the endpoints are: a static list locally, the InferencePool's Ready pods in Kubernetes."""

from __future__ import annotations

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


def static_endpoints(
    endpoints: str, kv_events: str | None = None, kv_replay: str | None = None
) -> list[Endpoint]:
    """``--endpoints a:1,b:2`` with optional ZMQ addresses in the same order (or one per list)."""
    addresses = [check_address(a) for a in _split(endpoints)]
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
        )
        for i, a in enumerate(addresses)
    ]
