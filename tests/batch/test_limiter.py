"""AIMD concurrency: halve on refusal, +1 on success up to the cap, Retry-After honoured."""

from __future__ import annotations

from kvgate.batch.limiter import Aimd, retry_after


def test_aimd_grows_to_the_cap_and_halves_on_refusal() -> None:
    a = Aimd(cap=8)
    assert a.room(now=0) == 1
    for _ in range(20):
        a.success()
    assert a.limit == 8
    a.refused(2.0, now=100.0)
    assert a.limit == 4
    assert a.room(now=101.0) == 0 and a.wait_s(now=101.0) == 1.0
    assert a.room(now=102.0) == 4
    a.in_flight = 3
    assert a.room(now=102.0) == 1
    for _ in range(5):
        a.refused(0, now=200.0)
    assert a.limit == 1


def test_backoff_without_retry_after_doubles_and_is_capped() -> None:
    a = Aimd(cap=4, min_backoff_s=0.5, max_backoff_s=3)
    a.refused(None, now=0)
    assert a.not_before == 0.5
    a.refused(None, now=0)
    assert a.not_before == 1.0
    for _ in range(10):
        a.refused(None, now=10)
    assert a.not_before == 13
    a.success()
    a.refused(None, now=20)
    assert a.not_before == 20.5


def test_retry_after_parsing() -> None:
    assert retry_after("3") == 3.0
    assert retry_after(" 0.5 ") == 0.5
    assert retry_after(None) is None
    assert retry_after("Wed, 21 Oct 2015 07:28:00 GMT") is None
    assert retry_after("-1") is None
