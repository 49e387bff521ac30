"""The Files and Batches endpoints through the real `openai` client, in process: the worker
sends to a fake gateway (httpx.MockTransport), so refusals, retries and failures are chosen."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import time
import unittest.mock
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from kvgate.batch.app import Limits, build_app
from kvgate.batch.blobs import Blobs
from kvgate.batch.store import Store
from kvgate.batch.worker import OBJECTIVE_HEADER, Worker

seen: list[httpx.Request] = []
refused_once: set[str] = set()


def gateway(request: httpx.Request) -> httpx.Response:
    seen.append(request)
    body = json.loads(request.content)
    prompt = body.get("prompt", "")
    if prompt == "refuse-once" and prompt not in refused_once:
        refused_once.add(prompt)
        return httpx.Response(429, headers={"retry-after": "0"}, json={"error": {"message": "sheddable"}})
    if prompt == "always-500":
        return httpx.Response(500, text="boom")
    if prompt == "bad":
        return httpx.Response(400, json={"error": {"message": "prompt is bad", "code": "bad_prompt"}})
    return httpx.Response(200, json={"object": "text_completion", "choices": [{"text": "ok:" + prompt}]})


@pytest.fixture
def client(tmp_path: Path) -> Iterator[openai.OpenAI]:
    seen.clear()
    refused_once.clear()
    store = Store(f"sqlite:///{tmp_path / 'b.db'}")
    blobs = Blobs(tmp_path / "files")
    worker = Worker(
        store,
        blobs,
        "http://gateway",
        max_attempts=3,
        poll_s=0.02,
        client=httpx.AsyncClient(transport=httpx.MockTransport(gateway)),
    )
    worker.limiter.min_backoff_s = 0.01
    app = build_app(store, blobs, worker, Limits(max_file_bytes=4096, max_lines=100))
    with TestClient(app) as http:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="k1", http_client=http, max_retries=0)


def jsonl(*prompts: str, url: str = "/v1/completions") -> bytes:
    return "".join(
        json.dumps(
            {"custom_id": f"id-{i}", "method": "POST", "url": url, "body": {"model": "m", "prompt": p}}
        )
        + "\n"
        for i, p in enumerate(prompts)
    ).encode()


def wait_done(client: openai.OpenAI, batch_id: str, timeout: float = 20) -> openai.types.Batch:
    deadline = time.monotonic() + timeout
    while True:
        b = client.batches.retrieve(batch_id)
        if b.status in ("completed", "failed", "cancelled", "expired"):
            return b
        assert time.monotonic() < deadline, b
        time.sleep(0.05)


def results(client: openai.OpenAI, file_id: str | None) -> dict[str, dict]:
    if file_id is None:
        return {}
    lines = [json.loads(x) for x in client.files.content(file_id).text.splitlines()]
    ids = Counter(x["custom_id"] for x in lines)
    assert all(n == 1 for n in ids.values()), ids
    return {x["custom_id"]: x for x in lines}


def test_a_batch_runs_with_refusals_retries_and_failures(client: openai.OpenAI) -> None:
    f = client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl("a", "refuse-once", "always-500", "bad", "b"))), purpose="batch"
    )
    assert f.object == "file" and f.purpose == "batch" and f.filename == "in.jsonl" and f.bytes > 0
    assert client.files.retrieve(f.id).id == f.id
    assert client.files.content(f.id).content == jsonl("a", "refuse-once", "always-500", "bad", "b")
    b = client.batches.create(
        input_file_id=f.id, endpoint="/v1/completions", completion_window="24h", metadata={"k": "v"}
    )
    assert (
        b.status == "validating"
        and b.metadata == {"k": "v"}
        and b.request_counts is not None
        and b.request_counts.total == 5
    )
    b = wait_done(client, b.id)
    assert b.status == "completed", b
    assert b.in_progress_at and b.finalizing_at and b.completed_at
    assert b.request_counts is not None
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (5, 3, 2)
    out = results(client, b.output_file_id)
    err = results(client, b.error_file_id)
    assert set(out) == {"id-0", "id-1", "id-4"} and set(err) == {"id-2", "id-3"}
    assert out["id-1"]["response"]["status_code"] == 200
    assert out["id-1"]["response"]["body"]["choices"][0]["text"] == "ok:refuse-once"
    assert (
        err["id-2"]["error"]["code"] == "server_error"
        and "after 3 attempts" in err["id-2"]["error"]["message"]
    )
    assert err["id-3"]["error"] == {"code": "bad_prompt", "message": "prompt is bad"}
    assert err["id-3"]["response"]["status_code"] == 400
    prompts = Counter(json.loads(r.content)["prompt"] for r in seen)
    assert prompts == {"a": 1, "refuse-once": 2, "always-500": 3, "bad": 1, "b": 1}
    assert all(r.headers[OBJECTIVE_HEADER] == "batch" for r in seen)
    assert all(r.headers["authorization"] == "Bearer k1" for r in seen)
    assert str(seen[0].url).startswith("http://gateway/v1/completions")


def test_upload_errors_are_openai_shaped_400s_with_the_line(client: openai.OpenAI) -> None:
    bad = jsonl("a") + b'{"custom_id": "x", "method": "POST"\n'
    with pytest.raises(openai.BadRequestError) as caught:
        client.files.create(file=("in.jsonl", io.BytesIO(bad)), purpose="batch")
    err = caught.value.body
    assert (
        isinstance(err, dict)
        and err["message"].startswith("Line 2: invalid JSON")
        and err["code"] == "invalid_file"
    )
    with pytest.raises(openai.BadRequestError, match="duplicate custom_id"):
        client.files.create(file=("in.jsonl", io.BytesIO(jsonl("a") + jsonl("b"))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="purpose must be 'batch'"):
        client.files.create(file=("in.jsonl", io.BytesIO(jsonl("a"))), purpose="fine-tune")
    with pytest.raises(openai.APIStatusError) as too_big:
        client.files.create(file=("in.jsonl", io.BytesIO(jsonl(*["x" * 50] * 60))), purpose="batch")
    assert too_big.value.status_code == 413
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl("a"))), purpose="batch")
    with pytest.raises(openai.BadRequestError, match="does not match the batch's endpoint"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError, match="completion_window"):
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="1h")  # type: ignore[arg-type]
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/completions", completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_nope")


def test_lists_paginate_newest_first_and_keys_are_separate(client: openai.OpenAI) -> None:
    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl("a"))), purpose="batch")
    ids = [
        client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h").id
        for _ in range(3)
    ]
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[:0:-1] and page.has_more
    rest = client.batches.list(limit=2, after=page.data[-1].id)
    assert [b.id for b in rest.data] == [ids[0]] and not rest.has_more
    assert [b.id for b in client.batches.list()] == ids[::-1]  # auto-paging
    assert f.id in [x.id for x in client.files.list().data]
    other = client.with_options(api_key="k2")
    assert other.batches.list().data == [] and other.files.list().data == []
    with pytest.raises(openai.NotFoundError):
        other.files.content(f.id)
    for bid in ids:
        wait_done(client, bid)
    with pytest.raises(openai.APIStatusError) as caught:
        client.batches.cancel(ids[0])
    assert caught.value.status_code == 409
    deleted = client.files.delete(f.id)
    assert deleted.deleted and deleted.id == f.id
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


def test_unknown_routes_and_bad_bodies_never_leak_a_trace(client: openai.OpenAI) -> None:
    http = client._client
    r = http.post("http://testserver/v1/batches", content=b"{nope", headers={"authorization": "Bearer k1"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = http.get("http://testserver/v1/nothing")
    assert r.status_code == 404 and "Traceback" not in r.text and "error" in r.json()
    r = http.post(
        "http://testserver/v1/files",
        content=b"x",
        headers={"content-type": "multipart/form-data; boundary=zz"},
    )
    assert r.status_code == 400 and "error" in r.json()


def test_batch_status_prints_a_bar_per_batch(
    client: openai.OpenAI, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvgate.batch import status_cli

    f = client.files.create(file=("in.jsonl", io.BytesIO(jsonl("a", "bad", "b"))), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_done(client, b.id)
    assert status_cli.bar(2, 1, 3, width=6) == "[####xx]"
    assert status_cli.bar(0, 0, 0, width=3) == "[...]"
    http = client._client  # the TestClient: status_cli's requests go through the app
    p = argparse.ArgumentParser()
    status_cli.configure_parser(p)
    with unittest.mock.patch.object(status_cli, "_client", lambda: contextlib.nullcontext(http)):
        assert status_cli.run(p.parse_args(["--url", "http://testserver", "--api-key", "k1"])) == 0
        printed = capsys.readouterr().out
        assert f"{b.id}  completed" in printed and "3/3 (100%), 1 failed" in printed
        assert status_cli.run(p.parse_args([b.id, "--url", "http://testserver/", "--api-key", "k2"])) == 1
        assert "404: No batch found" in capsys.readouterr().err


def test_with_tenants_a_key_must_name_one_and_a_tenant_sees_what_its_keys_made(tmp_path: Path) -> None:
    keys = {"Bearer a1": "acme", "Bearer a2": "acme", "Bearer b1": "beta"}
    store = Store(f"sqlite:///{tmp_path / 't.db'}")
    app = build_app(store, Blobs(tmp_path / "files"), None, tenant_of=keys.get)
    with TestClient(app) as http:

        def as_key(key: str) -> openai.OpenAI:
            return openai.OpenAI(
                base_url="http://testserver/v1", api_key=key, http_client=http, max_retries=0
            )

        f = as_key("a1").files.create(file=("in.jsonl", io.BytesIO(jsonl("a"))), purpose="batch")
        assert as_key("a2").files.retrieve(f.id).id == f.id  # the same tenant, another key
        with pytest.raises(openai.NotFoundError):
            as_key("b1").files.retrieve(f.id)
        with pytest.raises(openai.AuthenticationError) as caught:
            as_key("nope").batches.list()
        assert caught.value.body["code"] == "invalid_api_key"  # type: ignore[index]
        r = http.get("http://testserver/v1/files")  # no key at all
        assert r.status_code == 401 and r.json()["error"]["type"] == "invalid_request_error"
        assert http.get("http://testserver/health").status_code == 200


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_metrics_count_this_replicas_lines_attempts_and_queue_time(client: openai.OpenAI) -> None:
    f = client.files.create(
        file=("in.jsonl", io.BytesIO(jsonl("a", "refuse-once", "bad", "b"))), purpose="batch"
    )
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    wait_done(client, b.id)
    r = client._client.get("http://testserver/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    assert m[("kvgate_batch_lines_total", (("outcome", "completed"),))] == 3
    assert m[("kvgate_batch_lines_total", (("outcome", "failed"),))] == 1
    assert m[("kvgate_batch_attempts_total", (("result", "refused"),))] == 1
    assert m[("kvgate_batch_attempts_total", (("result", "ok"),))] == 3
    assert m[("kvgate_batch_attempts_total", (("result", "error"),))] == 1  # the 400
    assert m[("kvgate_batch_line_queue_seconds_count", ())] == 4  # first sends only, not the resend
    assert m[("kvgate_batch_line_duration_seconds_count", ())] == 4  # answered, refusal excluded
    assert m[("kvgate_batch_in_flight", ())] == 0 and m[("kvgate_batch_concurrency_limit", ())] >= 1
    # Finished batches get no per-batch gauges.
    assert not any(name == "kvgate_batch_requests" for name, _ in m)


def test_a_running_batch_reports_its_lines_rate_and_eta(tmp_path: Path) -> None:
    from kvgate.batch.store import DONE, IN_PROGRESS, VALIDATING

    store = Store(f"sqlite:///{tmp_path / 'g.db'}")
    app = build_app(store, Blobs(tmp_path / "files"), None)  # no worker: nothing moves by itself
    with TestClient(app) as http:
        oa = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
        f = oa.files.create(file=("in.jsonl", io.BytesIO(jsonl("a", "b", "c", "d"))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        store.transition(b.id, (VALIDATING,), IN_PROGRESS, in_progress_at=int(time.time()) - 1000)
        m = _samples(http.get("/metrics").text)
        assert m[("kvgate_batch_requests", (("batch_id", b.id), ("state", "pending")))] == 4
        assert ("kvgate_batch_eta_seconds", (("batch_id", b.id),)) not in m  # no line finished yet
        line = store.claim(b.id, 1)[0]
        assert store.finish_line(line.id, DONE, status_code=200, result="{}")
        m = _samples(http.get("/metrics").text)
        assert m[("kvgate_batch_requests", (("batch_id", b.id), ("state", "completed")))] == 1
        rate = m[("kvgate_batch_throughput_lines_per_second", (("batch_id", b.id),))]
        # one line in 1,000 s and a little (the scrape's own clock): no timing bound on the run
        assert 1 / 1100 < rate <= 1 / 1000
        assert m[("kvgate_batch_eta_seconds", (("batch_id", b.id),))] == pytest.approx(3 / rate)


def test_progress_rate_eta_and_the_status_line() -> None:
    from kvgate.batch import status_cli
    from kvgate.batch.progress import duration, progress

    assert progress(10, 0, 0, 100.0, 150.0).eta_s is None
    p = progress(10, 3, 1, 100.0, 120.0)
    assert p.lines_per_s == pytest.approx(0.2) and p.eta_s == pytest.approx(30.0)
    assert [duration(s) for s in (12.4, 245, 3 * 3600 + 4 * 60 + 5)] == ["12s", "4m05s", "3h04m"]
    doc = {
        "id": "batch_x",
        "status": "in_progress",
        "in_progress_at": 100,
        "request_counts": {"total": 10, "completed": 3, "failed": 1},
    }
    assert status_cli.line(doc, now=120.0).endswith("4/10 (40%), 1 failed, 0.20 lines/s, ETA 30s")
    assert status_cli.line({**doc, "request_counts": {"total": 10}}, now=120.0).endswith("ETA unknown")
    assert "lines/s" not in status_cli.line({**doc, "status": "completed"}, now=120.0)


def test_a_batch_past_its_completion_window_expires_keeping_what_finished(tmp_path: Path) -> None:
    import asyncio

    from sqlalchemy import update

    from kvgate.batch.store import BatchRow

    async def slow_gateway(request: httpx.Request) -> httpx.Response:
        if json.loads(request.content)["prompt"] == "slow":
            await asyncio.sleep(60)  # still in flight when the window ends
        return gateway(request)

    store = Store(f"sqlite:///{tmp_path / 'e.db'}")
    blobs = Blobs(tmp_path / "files")
    worker = Worker(
        store,
        blobs,
        "http://gateway",
        poll_s=0.02,
        client=httpx.AsyncClient(transport=httpx.MockTransport(slow_gateway)),
    )
    with TestClient(build_app(store, blobs, worker)) as http:
        oa = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)
        f = oa.files.create(file=("in.jsonl", io.BytesIO(jsonl("a", "slow", "b", "slow"))), purpose="batch")
        b = oa.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
        deadline = time.monotonic() + 10
        while oa.batches.retrieve(b.id).request_counts.completed < 2:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with store.session.begin() as s:  # the 24 hours are up
            s.execute(update(BatchRow).where(BatchRow.id == b.id).values(expires_at=int(time.time()) - 1))
        done = wait_done(oa, b.id)
        assert done.status == "expired" and done.expired_at == done.expires_at
        assert done.request_counts.completed == 2 and done.request_counts.failed == 2
        assert set(results(oa, done.output_file_id)) == {"id-0", "id-2"}
        errors = results(oa, done.error_file_id)
        assert set(errors) == {"id-1", "id-3"}
        assert {e["error"]["code"] for e in errors.values()} == {"batch_expired"}
        assert store.in_flight(b.id) == 0 and not worker.tasks
