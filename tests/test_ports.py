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
