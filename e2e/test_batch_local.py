"""The Batch API at `kvgate up --simulate`'s gateway, through the real `openai` client: one base_url
for chat, files and batches; a 1,000-line batch answered once per custom_id, its one malformed
request in the error file; a cancel mid-run that keeps the finished lines; the batch service
SIGKILLed three times mid-run, restarted by `kvgate up`, and still every custom_id answered once."""

from __future__ import annotations

import io
import json
import os
import signal
from collections import Counter
from collections.abc import Iterator

import openai
import pytest

from kvgate.testing import eventually
from kvgate.testing.local_up import UpProcess, start_up, stop_up
from kvgate.testing.processes import pid_alive, run_kvgate

FINAL = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpProcess]:
    up = start_up(tmp_path_factory.mktemp("batch-up"), "--simulate", "--engines", "2")
    try:
        up.wait_for_line(r"^curl ")
        yield up
    finally:
        stop_up(up)


def client_for(up: UpProcess, key: str = "k1") -> openai.OpenAI:
    return openai.OpenAI(base_url=up.stack["gateway_url"] + "/v1", api_key=key)


def chat_lines(model: str, n: int, max_tokens: int, malformed: int | None = None) -> bytes:
    out = []
    for i in range(n):
        body: dict = {
            "model": model,
            "messages": [{"role": "user", "content": f"line {i}: tell me about the number {i}"}],
            "max_tokens": max_tokens,
        }
        if i == malformed:
            body["messages"] = "not a list of messages"  # valid JSONL, a request the engine refuses
        out.append({"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body})
    return "".join(json.dumps(x) + "\n" for x in out).encode()


def submit(client: openai.OpenAI, data: bytes) -> openai.types.Batch:
    f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait_final(
    client: openai.OpenAI, batch_id: str, up: UpProcess, within: float = 600
) -> openai.types.Batch:
    def final() -> openai.types.Batch | None:
        b = client.batches.retrieve(batch_id)
        return b if b.status in FINAL else None

    return eventually(final, within, f"batch {batch_id} finished", interval=0.5, watch=[up])


def lines_of(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def once_each(*files: list[dict]) -> Counter[str]:
    ids = Counter(x["custom_id"] for lines in files for x in lines)
    assert all(n == 1 for n in ids.values()), [k for k, n in ids.items() if n > 1]
    return ids


def test_one_base_url_serves_chat_files_and_batches(stack: UpProcess) -> None:
    info = stack.stack
    assert len(info["batch_pids"]) == 1 and pid_alive(info["batch_pids"][0])
    assert "batch ready" in "\n".join(stack.lines)
    client = client_for(stack)
    reply = client.chat.completions.create(
        model=info["model"], messages=[{"role": "user", "content": "hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    assert client.batches.list().data == []
    with pytest.raises(openai.NotFoundError) as caught:
        client.files.retrieve("file-nope")
    assert caught.value.body["message"].startswith("No such File object")  # type: ignore[index]
    # a bad upload: OpenAI's error shape, from the batch service, through Envoy
    with pytest.raises(openai.BadRequestError) as bad:
        client.files.create(file=("in.jsonl", io.BytesIO(b"{nope\n")), purpose="batch")
    assert bad.value.body["code"] == "invalid_file"  # type: ignore[index]


def test_a_thousand_lines_each_answered_once_and_the_malformed_one_in_the_error_file(
    stack: UpProcess,
) -> None:
    client = client_for(stack)
    model = stack.stack["model"]
    b = submit(client, chat_lines(model, 1000, max_tokens=4, malformed=500))
    assert b.request_counts is not None and b.request_counts.total == 1000
    b = wait_final(client, b.id, stack)
    assert b.status == "completed", b
    assert b.request_counts is not None
    assert (b.request_counts.completed, b.request_counts.failed) == (999, 1)
    out, err = lines_of(client, b.output_file_id), lines_of(client, b.error_file_id)
    assert set(once_each(out, err)) == {f"req-{i}" for i in range(1000)}
    assert [x["custom_id"] for x in err] == ["req-500"]
    assert 400 <= err[0]["response"]["status_code"] < 500 and err[0]["error"]["code"]
    assert all(x["response"]["status_code"] == 200 for x in out)
    assert all(x["response"]["body"]["object"] == "chat.completion" for x in out)
    status = run_kvgate(
        "batch", "status", b.id, "--stack-file", str(stack.log_dir / "stack.json"), "--api-key", "k1"
    )
    assert status.returncode == 0, status.stderr
    assert f"{b.id}  completed" in status.stdout and "1000/1000 (100%), 1 failed" in status.stdout
    # another key sees none of it
    other = client_for(stack, "k2")
    assert other.batches.list().data == []
    with pytest.raises(openai.NotFoundError):
        other.files.content(b.output_file_id)  # type: ignore[arg-type]


def test_a_cancel_mid_run_ends_cancelled_keeping_the_finished_lines(stack: UpProcess) -> None:
    client = client_for(stack)
    b = submit(client, chat_lines(stack.stack["model"], 400, max_tokens=48))

    def some_done() -> bool:
        counts = client.batches.retrieve(b.id).request_counts
        return counts is not None and counts.completed >= 20

    eventually(some_done, 300, "some lines finished", interval=0.2, watch=[stack])
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait_final(client, b.id, stack)
    assert done.status == "cancelled" and done.cancelled_at is not None, done
    out = lines_of(client, done.output_file_id)
    assert done.request_counts is not None
    assert 20 <= len(out) == done.request_counts.completed < 400
    once_each(out, lines_of(client, done.error_file_id))
    assert all(x["response"]["status_code"] == 200 for x in out)


def test_the_batch_service_killed_three_times_mid_run_still_answers_each_line_once(
    stack: UpProcess,
) -> None:
    client = client_for(stack)
    b = submit(client, chat_lines(stack.stack["model"], 300, max_tokens=16))
    seen_pids = {stack.stack["batch_pids"][0]}
    for kill in range(3):
        floor = 50 * (kill + 1)

        def progressed(floor: int = floor) -> bool:
            counts = client.batches.retrieve(b.id).request_counts
            return counts is not None and counts.completed >= floor

        eventually(progressed, 300, f"{floor} lines done before kill {kill + 1}", interval=0.2, watch=[stack])
        pid = stack.stack["batch_pids"][0]
        os.kill(pid, signal.SIGKILL)

        def restarted(old: int = pid) -> int | None:
            new = stack.stack["batch_pids"][0]
            return new if new != old and pid_alive(new) else None

        seen_pids.add(eventually(restarted, 60, "the batch service restarted", watch=[stack]))
    assert len(seen_pids) == 4
    done = wait_final(client, b.id, stack)
    assert done.status == "completed", done
    out, err = lines_of(client, done.output_file_id), lines_of(client, done.error_file_id)
    assert set(once_each(out, err)) == {f"req-{i}" for i in range(300)}
    assert err == []
    assert sum("batch exited with signal SIGKILL" in line for line in stack.lines) == 3
