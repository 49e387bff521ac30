"""The batch service on a real PostgreSQL behind `kvgate up --simulate --batch-database-url`:
two replicas on one database finish a batch with no line run twice (each engine request counted),
and a run where the batch service is SIGKILLed three times and PostgreSQL once still answers
every custom_id exactly once."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from sqlalchemy import create_engine, select

from e2e.test_batch_local import chat_lines, client_for, lines_of, once_each, submit, wait_final
from kvgate.api.contracts.metrics import REQUEST_SUCCESS_TOTAL
from kvgate.batch.store import LineRow
from kvgate.local.ports import LOOPBACK, free_ports
from kvgate.local.stack import kvgate_argv
from kvgate.testing import eventually
from kvgate.testing.local_up import UpProcess, engine_gauges, start_up, stop_up
from kvgate.testing.postgres import PostgresServer, available, postgres_server
from kvgate.testing.processes import pid_alive

pytestmark = pytest.mark.skipif(available() is not None, reason=str(available()))


@pytest.fixture(scope="module")
def pg() -> Iterator[PostgresServer]:
    with postgres_server() as server:
        yield server


@pytest.fixture(scope="module")
def db_url(pg: PostgresServer) -> str:
    return pg.create_database()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, db_url: str) -> Iterator[UpProcess]:
    up = start_up(
        tmp_path_factory.mktemp("batch-pg"), "--simulate", "--engines", "2", "--batch-database-url", db_url
    )
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


def engine_successes(up: UpProcess) -> float:
    return sum(engine_gauges(u).get(REQUEST_SUCCESS_TOTAL, 0.0) for u in up.stack["engine_urls"])


def batch_lines(db_url: str, batch_id: str) -> list[LineRow]:
    engine = create_engine(db_url.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            return list(conn.execute(select(LineRow).where(LineRow.batch_id == batch_id)).all())  # type: ignore[arg-type]
    finally:
        engine.dispose()


def test_two_replicas_on_one_database_finish_a_batch_with_no_line_run_twice(
    stack: UpProcess, db_url: str, tmp_path: Path
) -> None:
    info = stack.stack
    assert "PostgreSQL" in "\n".join(stack.lines)
    port = free_ports(1)[0]
    log = (tmp_path / "second.log").open("wb")
    second = subprocess.Popen(
        kvgate_argv(
            "batch",
            "serve",
            "--host",
            LOOPBACK,
            "--port",
            str(port),
            "--gateway-url",
            info["gateway_url"],
            "--batch-dir",
            info["batch_dir"],  # shared: the files' bytes
            "--database-url",
            db_url,
            "--replica-id",
            "second",
        ),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        eventually(
            lambda: httpx.get(f"http://{LOOPBACK}:{port}/health").status_code == 200,
            60,
            "the second replica up",
        )
        before = engine_successes(stack)
        client = client_for(stack)
        b = submit(client, chat_lines(info["model"], 300, max_tokens=8))
        done = wait_final(client, b.id, stack)
        assert done.status == "completed", done
        out = lines_of(client, done.output_file_id)
        assert set(once_each(out)) == {f"req-{i}" for i in range(300)}
        rows = batch_lines(db_url, b.id)
        assert all(r.attempts == 1 for r in rows), [
            (r.custom_id, r.attempts) for r in rows if r.attempts != 1
        ]
        by = {r.claimed_by for r in rows}
        assert "second" in by and len(by) == 2, by  # both replicas ran lines
        # and the engines were asked exactly once per line
        assert engine_successes(stack) - before == 300
        # the second replica serves the same state: the batch is there through it too
        direct = openai.OpenAI(base_url=f"http://{LOOPBACK}:{port}/v1", api_key="k1")
        assert direct.batches.retrieve(b.id).status == "completed"
    finally:
        second.send_signal(signal.SIGTERM)
        try:
            second.wait(timeout=20)
        except subprocess.TimeoutExpired:
            second.kill()
        log.close()


def test_batch_service_killed_three_times_and_postgres_once_answers_each_line_once(
    stack: UpProcess, pg: PostgresServer
) -> None:
    client = client_for(stack)
    b = submit(client, chat_lines(stack.stack["model"], 300, max_tokens=16))
    faults = ["batch", "postgres", "batch", "batch"]
    for k, fault in enumerate(faults):
        floor = 40 * (k + 1)

        def progressed(floor: int = floor) -> bool:
            counts = client.batches.retrieve(b.id).request_counts
            return counts is not None and counts.completed >= floor

        eventually(progressed, 300, f"{floor} lines done before fault {k + 1}", interval=0.2, watch=[stack])
        if fault == "postgres":
            pg.kill()
            pg.start()
            continue
        pid = stack.stack["batch_pids"][0]
        os.kill(pid, signal.SIGKILL)

        def restarted(old: int = pid) -> bool:
            new = stack.stack["batch_pids"][0]
            return new != old and pid_alive(new)

        eventually(restarted, 60, "the batch service restarted", watch=[stack])
    done = wait_final(client, b.id, stack)
    assert done.status == "completed", done
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert err == []
    assert set(once_each(out)) == {f"req-{i}" for i in range(300)}
