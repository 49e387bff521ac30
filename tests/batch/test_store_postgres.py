"""The store on a real PostgreSQL: replicas claiming at once never get the same line (FOR UPDATE
SKIP LOCKED), leases, a restarted replica taking its own lines back, and a database SIGKILLed
and restarted under a live store."""

from __future__ import annotations

import threading
import time

from sqlalchemy.exc import SQLAlchemyError

from kvgate.batch.store import DONE, IN_PROGRESS, PENDING, LineRow, Store
from kvgate.testing import eventually
from kvgate.testing.postgres import PostgresServer
from tests.batch.test_store import make_batch


def test_replicas_claiming_at_once_never_share_a_line(pg_url: str) -> None:
    stores = [Store(pg_url, replica=f"r{i}") for i in range(4)]
    bid = make_batch(stores[0], 400)
    stores[0].transition(bid, ("validating",), IN_PROGRESS)
    got: dict[str, list[int]] = {s.replica: [] for s in stores}
    barrier = threading.Barrier(len(stores))

    def claim_all(s: Store) -> None:
        barrier.wait()
        while batch := s.claim(bid, 7):
            got[s.replica] += [x.id for x in batch]

    threads = [threading.Thread(target=claim_all, args=(s,)) for s in stores]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for ids in got.values() for i in ids]
    assert len(every) == len(set(every)) == 400
    assert sum(1 for ids in got.values() if ids) >= 2  # they really did claim side by side
    with stores[0].session() as s:
        rows = list(s.query(LineRow).filter(LineRow.batch_id == bid))
    assert all(r.attempts == 1 and r.claimed_by in got for r in rows)
    for s in stores:
        s.close()


def test_leases_restarts_and_stale_outcomes(pg_url: str) -> None:
    a = Store(pg_url, replica="a", lease_s=0.5)
    b = Store(pg_url, replica="b", lease_s=0.5)
    bid = make_batch(a, 3)
    (x,) = a.claim(bid, 1)
    (y,) = b.claim(bid, 1)
    assert b.recover(own=False) == 0  # nobody's lease has run out yet
    time.sleep(0.6)
    b.renew([y.id])
    assert b.recover(own=False) == 1  # a's line: a died
    (x2,) = b.claim(bid, 1)
    assert x2.id == x.id and x2.attempts == 2
    # a comes back late with an answer to its first claim: dropped, b's claim holds the line
    assert not a.finish_line(x.id, DONE, status_code=200, result="{}", attempt=x.attempts)
    assert b.finish_line(x2.id, DONE, status_code=200, result="{}", attempt=x2.attempts)
    # b restarts under its own name: what it was sending (y) is pending again at once
    b2 = Store(pg_url, replica="b", lease_s=30)
    assert b2.recover() == 1
    with b2.session() as s:
        assert s.get(LineRow, y.id).status == PENDING  # type: ignore[union-attr]
    for s_ in (a, b, b2):
        s_.close()


def test_a_store_outlives_a_database_killed_and_restarted(pg_server: PostgresServer, pg_url: str) -> None:
    s = Store(pg_url, replica="r")
    bid = make_batch(s, 2)
    (line,) = s.claim(bid, 1)
    pg_server.kill()
    try:
        try:
            s.counts(bid)
            raise AssertionError("the database is down")
        except SQLAlchemyError:
            pass
    finally:
        pg_server.start()
    # committed before the kill: still there; the pool reconnects (pre-ping)
    assert eventually(lambda: s.finish_line(line.id, DONE, status_code=200, result="{}"), 30, "finish")
    assert s.counts(bid).completed == 1
    s.close()
