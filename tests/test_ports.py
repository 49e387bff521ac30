"""Port planning: a port planned but not yet bound is never planned again in the same process."""

from __future__ import annotations

import pytest

from kvgate.local import ports


@pytest.mark.parametrize("below_ephemeral", [True, False], ids=["planned-range", "kernel-fallback"])
def test_planned_ports_are_not_handed_out_twice(
    monkeypatch: pytest.MonkeyPatch, below_ephemeral: bool
) -> None:
    # A slow server (the EPP imports for seconds) binds long after its ports were planned; the
    # next plan (Envoy's) must not get the same still-free port. CI once failed exactly so.
    if not below_ephemeral:
        monkeypatch.setattr(ports, "_ephemeral_low", lambda: 0)
    seen: list[int] = []
    for _ in range(300):
        seen += ports.free_ports(3)
    assert len(seen) == len(set(seen))


def test_planned_ports_are_free_and_distinct() -> None:
    planned = ports.free_ports(8)
    assert len(set(planned)) == 8
    assert all(ports.port_is_free(p) for p in planned)


def test_a_port_range_from_the_environment_keeps_plans_inside_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two processes planning at once (two test workers) each get their own range."""
    monkeypatch.setenv(ports.PORT_RANGE_ENV, "23000-24500")
    planned = [p for _ in range(20) for p in ports.free_ports(4)]
    assert all(23000 <= p < 24500 for p in planned)


@pytest.mark.parametrize("spec", ["nonsense", "30000-20000", "80-90", "20000-70000"])
def test_a_bad_port_range_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, spec: str) -> None:
    monkeypatch.setenv(ports.PORT_RANGE_ENV, spec)
    with pytest.raises(ports.PortBusyError, match="KVGATE_PORT_RANGE"):
        ports.free_ports(1)
