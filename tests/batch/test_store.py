"""The batch state machine and line bookkeeping, on SQLite in a temporary folder."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.batch.jsonl import parse_input
from kvgate.batch.store import (
    CANCELLABLE,
    CANCELLING,
    COMPLETED,
    DONE,
    FAILED,
    IN_PROGRESS,
    VALIDATING,
    BatchRow,
    Store,
    TransitionError,
    new_id,
    owner_of,
)


def make_batch(store: Store, n: int = 3, owner: str = "") -> str:
    text = "\n".join(
        f'{{"custom_id": "c{i}", "method": "POST", "url": "/v1/completions", "body": {{"prompt": "x"}}}}'
        for i in range(n)
    )
    row = BatchRow(
        id=new_id("batch_"),
        owner=owner,
        input_file_id="file-x",
        endpoint="/v1/completions",
        completion_window="24h",
        status=VALIDATING,
        created_at=int(time.time()),
    )
    store.create_batch(row, parse_input(text.encode()))
    return row.id


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(f"sqlite:///{tmp_path / 'b.db'}")
    yield s
    s.close()


def test_transitions_stamp_times_and_refuse_the_wrong_ones(store: Store) -> None:
    bid = make_batch(store)
    row = store.transition(bid, (VALIDATING,), IN_PROGRESS)
    assert row.status == IN_PROGRESS and row.in_progress_at is not None
    with pytest.raises(TransitionError, match="in_progress cannot become in_progress"):
        store.transition(bid, (VALIDATING,), IN_PROGRESS)
    store.transition(bid, CANCELLABLE, CANCELLING)
    with pytest.raises(TransitionError):
        store.transition(bid, CANCELLABLE, CANCELLING)
    assert store.get_batch(bid).cancelling_at is not None  # type: ignore[union-attr]


def test_claim_finish_and_counts_come_from_the_lines(store: Store) -> None:
    bid = make_batch(store, 3)
    first = store.claim(bid, 2)
    assert [x.custom_id for x in first] == ["c0", "c1"] and all(x.attempts == 1 for x in first)
    assert [x.custom_id for x in store.claim(bid, 5)] == ["c2"]
    assert store.claim(bid, 5) == []
    store.finish_line(first[0].id, DONE, status_code=200, result="{}")
    store.finish_line(first[1].id, FAILED, status_code=400, result="{}", error="bad: no")
    counts = store.counts(bid)
    assert (counts.total, counts.completed, counts.failed) == (3, 1, 1)
    assert store.unfinished(bid) == 1
    # a finished line is never changed again (a late duplicate outcome is ignored)
    store.finish_line(first[0].id, FAILED, error="late: x")
    assert store.counts(bid).completed == 1


def test_restart_makes_in_flight_lines_pending_with_their_attempt_counted(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}"
    s = Store(url)
    bid = make_batch(s, 2)
    claimed = s.claim(bid, 2)
    s.finish_line(claimed[0].id, DONE, status_code=200, result="{}")
    s.close()
    s2 = Store(url)  # "after a crash"
    assert s2.recover() == 1
    again = s2.claim(bid, 5)
    assert [(x.custom_id, x.attempts) for x in again] == [("c1", 2)]
    s2.close()


def test_release_refunds_an_attempt_when_asked(store: Store) -> None:
    bid = make_batch(store, 1)
    (x,) = store.claim(bid, 1)
    store.release_line(x.id, refund_attempt=True)
    (y,) = store.claim(bid, 1)
    assert y.attempts == 1
    store.release_line(y.id, refund_attempt=False)
    (z,) = store.claim(bid, 1)
    assert z.attempts == 2


def test_finalize_once_and_owners_see_only_their_batches(store: Store) -> None:
    bid = make_batch(store, 1, owner=owner_of("Bearer k1"))
    store.transition(bid, (VALIDATING,), IN_PROGRESS)
    row = store.finalize(bid, COMPLETED, [])
    assert row.status == COMPLETED and row.completed_at is not None
    assert store.finalize(bid, COMPLETED, []).completed_at == row.completed_at
    assert store.get_batch(bid, owner_of("Bearer k1")) is not None
    assert store.get_batch(bid, owner_of("Bearer k2")) is None
    assert store.list_batches(owner_of("Bearer k2"), None, 10) == []
