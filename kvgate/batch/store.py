"""The batch service's state in SQL (SQLAlchemy 2): files, batches and each batch's lines.

Every change is its own committed transaction, so what a client is told (a line finished, a
batch completed) has been written first. Request counts are counted from the lines' rows, never
kept beside them, so they cannot drift from what the output file will hold.

Several replicas may share one PostgreSQL database. A replica claims lines with
``SELECT ... FOR UPDATE SKIP LOCKED`` (two replicas never claim the same line) and holds each
claimed line on a lease it renews while the request runs; a line whose lease ran out (its
replica died) goes back to pending, and a replica restarted under the same ``replica`` name takes
its own in-flight lines back at once. An outcome is written only by the claim that is still the
line's (same replica, same attempt), so a late answer to a claim that was taken back is dropped.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from sqlalchemy import (
    Float,
    ForeignKey,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
    func,
    or_,
    select,
    text,
    update,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from kvgate.batch import migrations
from kvgate.batch.jsonl import InputLine

# Line states
PENDING, IN_FLIGHT, DONE, FAILED = "pending", "in_flight", "done", "failed"
# Batch states (OpenAI's)
VALIDATING, IN_PROGRESS, FINALIZING, COMPLETED = "validating", "in_progress", "finalizing", "completed"
FAILED_BATCH, CANCELLING, CANCELLED, EXPIRED = "failed", "cancelling", "cancelled", "expired"
ACTIVE = (VALIDATING, IN_PROGRESS, FINALIZING, CANCELLING)
CANCELLABLE = (VALIDATING, IN_PROGRESS)


class Base(DeclarativeBase):
    pass


class FileRow(Base):
    __tablename__ = "files"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    filename: Mapped[str] = mapped_column(String(512))
    purpose: Mapped[str] = mapped_column(String(32))
    bytes: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(String(1024))


class BatchRow(Base):
    __tablename__ = "batches"
    seq: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(64), unique=True, index=True)
    owner: Mapped[str] = mapped_column(String(64), index=True)
    authorization: Mapped[str | None] = mapped_column(Text, nullable=True)  # forwarded to the gateway
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    metadata_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    errors_json: Mapped[str | None] = mapped_column(Text, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    created_at: Mapped[int] = mapped_column(Integer)
    expires_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    in_progress_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    finalizing_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancelling_at: Mapped[int | None] = mapped_column(Integer, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(Integer, nullable=True)


class LineRow(Base):
    __tablename__ = "lines"
    __table_args__ = (UniqueConstraint("batch_id", "custom_id"), UniqueConstraint("batch_id", "idx"))
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    batch_id: Mapped[str] = mapped_column(String(64), ForeignKey("batches.id"), index=True)
    idx: Mapped[int] = mapped_column(Integer)
    custom_id: Mapped[str] = mapped_column(String(512))
    url: Mapped[str] = mapped_column(String(64))
    body: Mapped[str] = mapped_column(Text)
    status: Mapped[str] = mapped_column(String(16), index=True)
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    status_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    result: Mapped[str | None] = mapped_column(Text, nullable=True)  # the response body (JSON)
    error: Mapped[str | None] = mapped_column(Text, nullable=True)  # why it failed
    request_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    claimed_by: Mapped[str | None] = mapped_column(String(128), nullable=True)  # the replica sending it
    lease_until: Mapped[float | None] = mapped_column(Float, nullable=True)  # epoch s; then reclaimable


def owner_of(authorization: str | None) -> str:
    """Who a request is from: a hash of its Authorization header ('' without one)."""
    if not authorization:
        return ""
    return hashlib.sha256(authorization.encode()).hexdigest()[:32]


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class TransitionError(ValueError):
    """A batch asked to move where its status does not allow."""


@dataclass(frozen=True)
class Counts:
    total: int
    completed: int
    failed: int


@dataclass(frozen=True)
class LineToSend:
    id: int
    batch_id: str
    custom_id: str
    url: str
    body: str
    attempts: int
    authorization: str | None


DEFAULT_LEASE_S = 30.0


class Store:
    def __init__(self, url: str, *, replica: str = "", lease_s: float = DEFAULT_LEASE_S) -> None:
        self.url = url
        self.replica = replica  # who claims lines through this store (a stable name per replica)
        self.lease_s = lease_s
        if url.startswith("postgres"):
            # psycopg 3 is the driver the `batch` extra installs; postgresql:// alone would
            # ask SQLAlchemy for psycopg2
            url = _postgres_url(url)
        self.engine = create_engine(url, pool_pre_ping=True)  # a restarted database is reconnected
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_pragmas)
        with self.engine.begin() as conn:
            if self.engine.dialect.name == "postgresql":
                # replicas starting together: one creates the tables, the others wait and see them
                conn.execute(text("SELECT pg_advisory_xact_lock(4545045)"))
            migrations.upgrade(conn)
        self.session = sessionmaker(self.engine, expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    # files
    def add_file(self, row: FileRow) -> FileRow:
        with self.session.begin() as s:
            s.add(row)
        return row

    def get_file(self, file_id: str, owner: str) -> FileRow | None:
        with self.session() as s:
            return s.scalar(select(FileRow).where(FileRow.id == file_id, FileRow.owner == owner))

    def list_files(self, owner: str, purpose: str | None, after: str | None, limit: int) -> list[FileRow]:
        with self.session() as s:
            q = select(FileRow).where(FileRow.owner == owner)
            if purpose:
                q = q.where(FileRow.purpose == purpose)
            if after:
                seq = s.scalar(select(FileRow.seq).where(FileRow.id == after, FileRow.owner == owner))
                if seq is not None:
                    q = q.where(FileRow.seq < seq)
            return list(s.scalars(q.order_by(FileRow.seq.desc()).limit(limit)))

    def delete_file(self, file_id: str, owner: str) -> FileRow | None:
        with self.session.begin() as s:
            row = s.scalar(select(FileRow).where(FileRow.id == file_id, FileRow.owner == owner))
            if row is not None:
                s.delete(row)
            return row

    # batches
    def create_batch(self, row: BatchRow, lines: list[InputLine]) -> BatchRow:
        """The batch (validating) and all its lines (pending), in one transaction."""
        with self.session.begin() as s:
            s.add(row)
            s.flush()
            s.add_all(
                LineRow(
                    batch_id=row.id,
                    idx=line.index,
                    custom_id=line.custom_id,
                    url=line.url,
                    body=json.dumps(line.body),
                    status=PENDING,
                    attempts=0,
                )
                for line in lines
            )
        return row

    def get_batch(self, batch_id: str, owner: str | None = None) -> BatchRow | None:
        with self.session() as s:
            q = select(BatchRow).where(BatchRow.id == batch_id)
            if owner is not None:
                q = q.where(BatchRow.owner == owner)
            return s.scalar(q)

    def list_batches(self, owner: str, after: str | None, limit: int) -> list[BatchRow]:
        with self.session() as s:
            q = select(BatchRow).where(BatchRow.owner == owner)
            if after:
                seq = s.scalar(select(BatchRow.seq).where(BatchRow.id == after, BatchRow.owner == owner))
                if seq is not None:
                    q = q.where(BatchRow.seq < seq)
            return list(s.scalars(q.order_by(BatchRow.seq.desc()).limit(limit)))

    def batches_in(self, *statuses: str) -> list[BatchRow]:
        with self.session() as s:
            return list(
                s.scalars(select(BatchRow).where(BatchRow.status.in_(statuses)).order_by(BatchRow.seq))
            )

    def transition(self, batch_id: str, allowed_from: tuple[str, ...], to: str, **fields: Any) -> BatchRow:
        """Moves a batch to ``to`` (stamping ``<to>_at``) if its status is one of allowed_from."""
        now = int(time.time())
        with self.session.begin() as s:
            row = s.scalar(select(BatchRow).where(BatchRow.id == batch_id).with_for_update())
            if row is None:
                raise TransitionError(f"no batch {batch_id}")
            if row.status not in allowed_from:
                raise TransitionError(f"a batch with status {row.status} cannot become {to}")
            row.status = to
            stamp = f"{to}_at"
            if hasattr(row, stamp) and getattr(row, stamp) is None:
                setattr(row, stamp, now)
            for k, v in fields.items():
                setattr(row, k, v)
            return row

    def counts(self, batch_id: str) -> Counts:
        with self.session() as s:
            rows = s.execute(
                select(LineRow.status, func.count())
                .where(LineRow.batch_id == batch_id)
                .group_by(LineRow.status)
            ).all()
        by = {status: n for status, n in rows}
        return Counts(total=sum(by.values()), completed=by.get(DONE, 0), failed=by.get(FAILED, 0))

    # lines
    def recover(self, *, own: bool = True) -> int:
        """In-flight lines back to pending (their attempt counted): those whose lease ran out
        and, with ``own``, this replica's (it restarted: whatever it was sending is lost)."""
        now = time.time()
        stale = or_(LineRow.lease_until.is_(None), LineRow.lease_until < now)
        if own:
            stale = or_(stale, LineRow.claimed_by == self.replica)
        with self.session.begin() as s:
            result = s.execute(
                update(LineRow)
                .where(LineRow.status == IN_FLIGHT, stale)
                .values(status=PENDING, claimed_by=None, lease_until=None)
            )
            return int(result.rowcount or 0)  # type: ignore[attr-defined]

    def renew(self, line_ids: list[int]) -> None:
        """This replica's leases on the lines it is still sending, extended by lease_s."""
        if not line_ids:
            return
        with self.session.begin() as s:
            s.execute(
                update(LineRow)
                .where(
                    LineRow.id.in_(line_ids), LineRow.status == IN_FLIGHT, LineRow.claimed_by == self.replica
                )
                .values(lease_until=time.time() + self.lease_s)
            )

    def claim(self, batch_id: str, n: int) -> list[LineToSend]:
        """Up to n pending lines of a batch, marked in flight (this replica's, on a lease) with one
        more attempt. Lines another replica is claiming at this moment are skipped, not waited for."""
        if n <= 0:
            return []
        with self.session.begin() as s:
            auth = s.scalar(select(BatchRow.authorization).where(BatchRow.id == batch_id))
            rows = list(
                s.scalars(
                    select(LineRow)
                    .where(LineRow.batch_id == batch_id, LineRow.status == PENDING)
                    .order_by(LineRow.idx)
                    .limit(n)
                    .with_for_update(skip_locked=True)
                )
            )
            until = time.time() + self.lease_s
            for row in rows:
                row.status = IN_FLIGHT
                row.attempts += 1
                row.claimed_by = self.replica
                row.lease_until = until
            return [LineToSend(r.id, r.batch_id, r.custom_id, r.url, r.body, r.attempts, auth) for r in rows]

    def _still_ours(self, line_id: int, attempt: int | None) -> Any:
        cond = [LineRow.id == line_id, LineRow.status == IN_FLIGHT, LineRow.claimed_by == self.replica]
        if attempt is not None:
            cond.append(LineRow.attempts == attempt)
        return cond

    def in_flight(self, batch_id: str) -> int:
        """Lines of the batch some replica is sending (on a lease that has not run out)."""
        with self.session() as s:
            return int(
                s.scalar(
                    select(func.count())
                    .select_from(LineRow)
                    .where(LineRow.batch_id == batch_id, LineRow.status == IN_FLIGHT)
                )
                or 0
            )

    def finish_line(
        self,
        line_id: int,
        status: str,
        *,
        status_code: int | None = None,
        result: str | None = None,
        error: str | None = None,
        request_id: str | None = None,
        attempt: int | None = None,
    ) -> bool:
        """A line's outcome, committed; only a line still in flight on this replica's claim
        (``attempt``, when given, the claim's) is changed. False: it was not (taken back)."""
        with self.session.begin() as s:
            changed = s.execute(
                update(LineRow)
                .where(*self._still_ours(line_id, attempt))
                .values(
                    status=status,
                    status_code=status_code,
                    result=result,
                    error=error,
                    request_id=request_id,
                    lease_until=None,
                )
            )
            return bool(changed.rowcount)  # type: ignore[attr-defined]

    def release_line(self, line_id: int, *, refund_attempt: bool, attempt: int | None = None) -> None:
        """Back to pending (refused by the gateway, or the batch is being cancelled)."""
        with self.session.begin() as s:
            values: dict[str, Any] = {"status": PENDING, "claimed_by": None, "lease_until": None}
            if refund_attempt:
                values["attempts"] = LineRow.attempts - 1
            s.execute(update(LineRow).where(*self._still_ours(line_id, attempt)).values(**values))

    def unfinished(self, batch_id: str) -> int:
        with self.session() as s:
            return int(
                s.scalar(
                    select(func.count())
                    .select_from(LineRow)
                    .where(LineRow.batch_id == batch_id, LineRow.status.in_((PENDING, IN_FLIGHT)))
                )
                or 0
            )

    def expire_pending(self, batch_id: str, error: str) -> int:
        """The batch's lines still pending fail with ``error`` (its completion window ended);
        how many."""
        with self.session.begin() as s:
            rows = list(
                s.scalars(
                    select(LineRow)
                    .where(LineRow.batch_id == batch_id, LineRow.status == PENDING)
                    .with_for_update(skip_locked=True)
                )
            )
            for row in rows:
                row.status = FAILED
                row.error = error
                row.claimed_by = None
                row.lease_until = None
            return len(rows)

    def finished_lines(self, batch_id: str) -> list[LineRow]:
        with self.session() as s:
            return list(
                s.scalars(
                    select(LineRow)
                    .where(LineRow.batch_id == batch_id, LineRow.status.in_((DONE, FAILED)))
                    .order_by(LineRow.idx)
                )
            )

    def finalize(self, batch_id: str, to: str, files: list[tuple[str, FileRow]], **fields: Any) -> BatchRow:
        """The result files' rows and the batch's final status, in one transaction."""
        now = int(time.time())
        with self.session.begin() as s:
            row = s.scalar(select(BatchRow).where(BatchRow.id == batch_id).with_for_update())
            assert row is not None
            if row.status in (COMPLETED, CANCELLED, FAILED_BATCH, EXPIRED):
                return row  # finalized already
            for attr, f in files:
                s.add(f)
                setattr(row, attr, f.id)
            row.status = to
            if hasattr(BatchRow, f"{to}_at"):  # (expired has no column: see objects.py)
                setattr(row, f"{to}_at", now)
            for k, v in fields.items():
                setattr(row, k, v)
            return row


def _postgres_url(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    if scheme in ("postgres", "postgresql"):
        return "postgresql+psycopg" + sep + rest
    return url


def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=FULL")  # a committed result survives a power cut, not only a crash
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()
