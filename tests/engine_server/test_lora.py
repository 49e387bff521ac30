"""LoRA adapters on a real simulated engine server: vLLM's flags, /v1/models, requests naming
an adapter, vllm:lora_requests_info, and adapter-keyed prefix caching."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from kvgate.testing import processes as harness
from kvgate.testing.engine_server import launch
from kvgate.testing.polling import eventually

pytestmark = pytest.mark.timeout(90)

PROMPT = "an adapter keys its own cached blocks apart from the base model " * 6


def test_adapters_are_models_with_the_base_as_parent(tmp_path) -> None:
    module = json.dumps({"name": "json-lora", "path": "/adapters/j", "base_model_name": "x"})
    eng = harness.start_engine(
        tmp_path,
        "--enable-lora",
        "--lora-modules",
        "sql-lora=/adapters/sql",
        "--lora-modules",
        module,
        "--max-loras",
        "2",
    ).wait_ready()
    try:
        with httpx.Client(base_url=f"http://{eng.address}", timeout=20) as c:
            cards = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
            base = next(name for name, m in cards.items() if m["parent"] is None)
            assert cards["sql-lora"]["parent"] == base and cards["sql-lora"]["root"] == "/adapters/sql"
            assert cards["json-lora"]["parent"] == base and cards["json-lora"]["root"] == "/adapters/j"
            assert c.get("/v1/models/sql-lora").json()["parent"] == base

            def cached(model: str) -> int:
                r = c.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 1})
                assert r.status_code == 200, r.text
                assert r.json()["model"] == model
                details = r.json()["usage"].get("prompt_tokens_details") or {}
                return int(details.get("cached_tokens") or 0)

            cached(base)
            assert cached(base) > 0  # the base model hits its own blocks
            assert cached("sql-lora") == 0  # an adapter does not hit the base model's blocks
            assert cached("sql-lora") > 0  # ...but its own

            r = c.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 1})
            assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
            metrics = c.get("/metrics").text
        info = [line for line in metrics.splitlines() if line.startswith("vllm:lora_requests_info{")]
        assert len(info) == 1 and 'max_lora="2"' in info[0], info
    finally:
        harness.stop_all(eng.proc)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--lora-modules", "a=/p"], "--lora-modules needs --enable-lora"),
        (["--enable-lora", "--lora-modules", "nopath"], "NAME=PATH or JSON"),
        (["--enable-lora", "--lora-modules", '{"name": "a"}'], '"name" and "path"'),
        (["--enable-lora", "--lora-modules", "{bad"], "invalid JSON"),
        (["--enable-lora", "--lora-modules", "a=/p", "--lora-modules", "a=/q"], "used twice"),
        (["--enable-lora", "--max-loras", "3", "--max-cpu-loras", "2"], "must be at least --max-loras (3)"),
    ],
)
def test_bad_lora_flags_are_clear_errors(args: list[str], message: str) -> None:
    port = harness.free_port()
    cmd = [sys.executable, "-P", "-m", "kvgate", "engine", "serve", "--simulate", "--port", str(port), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def _metric_line(c: httpx.Client) -> str:
    (line,) = [x for x in c.get("/metrics").text.splitlines() if x.startswith("vllm:lora_requests_info{")]
    return line


def test_runtime_load_and_unload(tmp_path) -> None:
    eng = harness.start_engine(
        tmp_path, "--enable-lora", "--api-key", "k", "--lora-unload-grace", "0"
    ).wait_ready()
    auth = {"Authorization": "Bearer k"}
    try:
        with httpx.Client(base_url=f"http://{eng.address}", timeout=20, headers=auth) as c:
            base = c.get("/v1/models").json()["data"][0]["id"]
            load = {"lora_name": "new", "lora_path": str(tmp_path)}
            assert httpx.post(f"http://{eng.address}/v1/load_lora_adapter", json=load).status_code == 401
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "new"})
            assert r.status_code == 400 and "'lora_path'" in r.json()["error"]["message"], r.text
            r = c.post("/v1/load_lora_adapter", json={"lora_name": base, "lora_path": str(tmp_path)})
            assert r.status_code == 400, r.text

            r = c.post("/v1/load_lora_adapter", json=load)
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' added successfully."
            card = c.get("/v1/models/new").json()
            assert card["parent"] == base and card["root"] == str(tmp_path)
            r = c.post("/v1/load_lora_adapter", json=load)
            assert r.status_code == 400 and "already been loaded" in r.json()["error"]["message"]
            r = c.post("/v1/completions", json={"model": "new", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 200 and r.json()["model"] == "new"

            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'new' removed successfully."
            assert "new" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
            r = c.post("/v1/completions", json={"model": "new", "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 404
            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "new"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found"
            # and back again
            assert c.post("/v1/load_lora_adapter", json=load).status_code == 200
    finally:
        harness.stop_all(eng.proc)


def test_load_and_unload_under_load_fail_no_request(tmp_path) -> None:
    """Clients stream requests at the base model and adapter `a` while `b` is loaded and
    unloaded again and again, and `a` itself is unloaded with requests in flight: every request
    sent while its model was listed succeeds (running ones finish under the adapter)."""
    eng = harness.start_engine(
        tmp_path, "--enable-lora", "--max-loras", "2", "--lora-modules", "a=/adapters/a",
        "--sim-itl", "0.01", "--sim-time-scale", "1", "--sim-lora-load-time", "0.005",
        "--lora-unload-grace", "0",
    ).wait_ready()  # fmt: skip
    url = f"http://{eng.address}"
    failures: list[str] = []
    stop = threading.Event()

    def client(model: str) -> None:
        with httpx.Client(base_url=url, timeout=30) as c:
            while not stop.is_set():
                body = {"model": model, "prompt": "load me", "max_tokens": 8, "ignore_eos": True}
                r = c.post("/v1/completions", json=body)
                if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 8:
                    failures.append(f"{model}: {r.status_code} {r.text[:200]}")

    try:
        with httpx.Client(base_url=url, timeout=30) as c:
            base = c.get("/v1/models").json()["data"][0]["id"]
            threads = [threading.Thread(target=client, args=(m,)) for m in (base, base, "a")]
            for t in threads:
                t.start()
            for _ in range(8):
                r = c.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/adapters/b"})
                assert r.status_code == 200, r.text
                body = {"model": "b", "prompt": "x", "max_tokens": 3}
                assert c.post("/v1/completions", json=body).status_code == 200
                assert c.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
            stop.set()
            for t in threads:
                t.join()
            assert not failures, failures[:5]

            # unload `a` while a long request runs under it: that request still completes
            done: list[httpx.Response] = []
            body = {"model": "a", "prompt": "long", "max_tokens": 40, "ignore_eos": True}
            runner = threading.Thread(
                target=lambda: done.append(httpx.post(f"{url}/v1/completions", json=body, timeout=30))
            )
            runner.start()
            eventually(lambda: 'running_lora_adapters="a"' in _metric_line(c), 10, "a running")
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
            assert c.post("/v1/completions", json={"model": "a", "prompt": "x"}).status_code == 404
            runner.join()
            assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 40
    finally:
        stop.set()
        harness.stop_all(eng.proc)


def test_endpoints_exist_only_with_enable_lora(tmp_path) -> None:
    eng = harness.start_engine(tmp_path).wait_ready()
    try:
        r = httpx.post(
            f"http://{eng.address}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/"}
        )
        assert r.status_code == 404
    finally:
        harness.stop_all(eng.proc)


def test_lora_requests_info_names_running_and_waiting_adapters(tmp_path) -> None:
    """One slot (--max-loras 1), two adapters busy at once: one runs, the other waits; the
    metric says so, as vLLM's does, and settles back to empty lists."""
    eng = harness.start_engine(
        tmp_path,
        "--enable-lora",
        "--lora-modules", "a=/adapters/a",
        "--lora-modules", "b=/adapters/b",
        "--sim-itl", "0.05",
        "--sim-time-scale", "1",
    ).wait_ready()  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://{eng.address}", timeout=30) as c:
            assert _metric_line(c).startswith(
                'vllm:lora_requests_info{max_lora="1",waiting_lora_adapters="",running_lora_adapters=""}'
            )

            def slow(model: str) -> None:
                body = {"model": model, "prompt": "x", "max_tokens": 30, "ignore_eos": True}
                assert (
                    httpx.post(f"http://{eng.address}/v1/completions", json=body, timeout=30).status_code
                    == 200
                )

            threads = [threading.Thread(target=slow, args=(m,)) for m in ("a", "b")]
            for t in threads:
                t.start()
                time.sleep(0.2)
            eventually(
                lambda: 'waiting_lora_adapters="b",running_lora_adapters="a"' in _metric_line(c),
                10,
                "a running, b waiting",
            )
            eventually(lambda: 'running_lora_adapters="b"' in _metric_line(c), 10, "b running after a")
            for t in threads:
                t.join()
            eventually(
                lambda: 'waiting_lora_adapters="",running_lora_adapters=""' in _metric_line(c), 10, "idle"
            )
    finally:
        harness.stop_all(eng.proc)


def _peft_folder(folder: Path, hidden: int = 576, r: int = 8, seed: int = 0) -> Path:
    """A PEFT-layout adapter for the default model (SmolLM2-135M: hidden 576, 3 KV heads of
    64, MLP 1536, 30 layers) on q/v/down, random nonzero A and B."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    folder.mkdir(parents=True)
    conf = {
        "peft_type": "LORA",
        "r": r,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj", "down_proj"],
    }
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    shapes = {
        "self_attn.q_proj": (hidden, 576),
        "self_attn.v_proj": (hidden, 192),
        "mlp.down_proj": (1536, hidden),
    }
    tensors = {}
    for layer in range(30):
        for proj, (d_in, d_out) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen) * 0.15
            tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen) * 0.15
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


@pytest.mark.slow
def test_real_model_serves_adapters_and_refuses_bad_ones(tmp_path: Path) -> None:
    good = _peft_folder(tmp_path / "good")
    other = _peft_folder(tmp_path / "other", hidden=2048)
    big = _peft_folder(tmp_path / "big", r=32)
    # start-up: a bad adapter is a clear message, exit 2, no traceback
    done = harness.run_kvgate(
        "engine", "serve", "--port", "0", "--enable-lora", "--lora-modules", f"bad={other}", timeout=120
    )
    assert done.returncode == 2 and "trained for another base model" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr

    srv = launch(
        tmp_path / "logs", "--enable-lora", "--max-loras", "2", "--lora-modules", f"good={good}",
        "--cpu-threads", "1", "--max-model-len", "256", timeout=180,
    )  # fmt: skip
    try:
        with httpx.Client(base_url=srv.base_url, timeout=60) as c:
            base = c.get("/v1/models").json()["data"][0]["id"]

            def complete(model: str) -> str:
                body = {
                    "model": model,
                    "prompt": "The capital of France is",
                    "max_tokens": 8,
                    "temperature": 0,
                }
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return str(r.json()["choices"][0]["text"])

            assert complete("good") != complete(base)
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "other", "lora_path": str(other)})
            assert r.status_code == 400 and "trained for another base model" in r.json()["error"]["message"]
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/adapter"})
            assert r.status_code == 404 and r.json()["error"]["code"] == "lora_not_found", r.text
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(big)})
            assert r.status_code == 400 and "exceeds --max-lora-rank 16" in r.json()["error"]["message"]
            again = _peft_folder(tmp_path / "again", seed=1)
            assert (
                c.post(
                    "/v1/load_lora_adapter", json={"lora_name": "again", "lora_path": str(again)}
                ).status_code
                == 200
            )
            assert complete("again") not in (complete(base), complete("good"))
            assert 'max_lora="2"' in _metric_line(c)
    finally:
        srv.stop(signal.SIGKILL)


def test_unloaded_adapter_is_served_through_the_grace_then_404(tmp_path) -> None:
    """--lora-unload-grace: the unload answers at once and /v1/models drops the adapter at once
    (routers stop sending), but a request sent 0.5 s later (one a router had already picked this
    engine for) is served; after the grace it is an unknown model, vLLM's 404. The grace is long
    against the 0.5 s: under a loaded CI the request sent then once took over a second."""
    grace = 4.0
    eng = harness.start_engine(tmp_path, "--enable-lora", "--lora-unload-grace", str(grace)).wait_ready()
    body = {"model": "g", "prompt": "hi", "max_tokens": 2}
    try:
        with httpx.Client(base_url=f"http://{eng.address}", timeout=20) as c:
            load = {"lora_name": "g", "lora_path": "/adapters/g"}
            assert c.post("/v1/load_lora_adapter", json=load).status_code == 200
            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "g"})
            answered = time.monotonic()
            assert r.status_code == 200 and r.text == "Success: LoRA adapter 'g' removed successfully."
            assert "g" not in [m["id"] for m in c.get("/v1/models").json()["data"]]
            assert c.get("/v1/models/g").status_code == 404
            again = c.post("/v1/unload_lora_adapter", json={"lora_name": "g"})
            assert again.status_code == 404 and again.json()["error"]["code"] == "lora_not_found"

            time.sleep(max(0.0, answered + 0.5 - time.monotonic()))
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and r.json()["model"] == "g", r.text
            assert time.monotonic() - answered < grace  # still within the grace

            time.sleep(max(0.0, answered + grace + 0.3 - time.monotonic()))
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 404, r.text
            unknown = c.post("/v1/completions", json={**body, "model": "nope"})
            assert r.json() == json.loads(unknown.text.replace("nope", "g"))  # an unknown model's
            # and nothing of it is left: the name loads again as new
            assert c.post("/v1/load_lora_adapter", json=load).status_code == 200
    finally:
        harness.stop_all(eng.proc)


def test_a_load_cancels_a_pending_unload(tmp_path) -> None:
    """Loading a name again while its unload waits (in the grace, or for its last running
    request) cancels the unload: the adapter stays, with the new path, and keeps serving."""
    eng = harness.start_engine(
        tmp_path, "--enable-lora", "--lora-unload-grace", "1",
        "--sim-itl", "0.05", "--sim-time-scale", "1",
    ).wait_ready()  # fmt: skip
    url = f"http://{eng.address}"
    body = {"model": "g", "prompt": "hi", "max_tokens": 2}
    try:
        with httpx.Client(base_url=url, timeout=30) as c:

            def card() -> dict | None:
                return next((m for m in c.get("/v1/models").json()["data"] if m["id"] == "g"), None)

            assert (
                c.post("/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": "/one"}).status_code
                == 200
            )
            # in the grace
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "g"}).status_code == 200
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": "/two"})
            assert r.status_code == 200, r.text
            time.sleep(1.5)  # past where the grace would have ended
            assert (card() or {}).get("root") == "/two"
            assert c.post("/v1/completions", json=body).status_code == 200

            # draining: the grace is over while a long request still runs under it
            done: list[httpx.Response] = []
            long = {"model": "g", "prompt": "long", "max_tokens": 60, "ignore_eos": True}
            runner = threading.Thread(
                target=lambda: done.append(httpx.post(f"{url}/v1/completions", json=long, timeout=30))
            )
            runner.start()
            eventually(lambda: 'running_lora_adapters="g"' in _metric_line(c), 10, "g running")
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "g"}).status_code == 200
            eventually(lambda: c.post("/v1/completions", json=body).status_code == 404, 5, "grace over: 404")
            assert runner.is_alive()  # so the unload is still waiting for it
            r = c.post("/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": "/three"})
            assert r.status_code == 200, r.text  # was 400: "still being unloaded"
            assert c.post("/v1/completions", json=body).status_code == 200
            runner.join()
            assert done[0].status_code == 200 and done[0].json()["usage"]["completion_tokens"] == 60
            time.sleep(1.2)  # no grace timer of the old unload is left to fire
            assert (card() or {}).get("root") == "/three"
            assert c.post("/v1/completions", json=body).status_code == 200
    finally:
        harness.stop_all(eng.proc)


def test_new_weights_under_a_name_miss_the_old_prefix_cache(tmp_path) -> None:
    """load_inplace (vLLM's: new files under a loaded name) and a load that cancels a pending
    unload from another path give the adapter new weights: the same prompt then finds nothing
    cached (it would reuse KV of the old weights). A load cancelling an unload from the same
    path keeps the hits. Before the fix every reload kept them."""
    eng = harness.start_engine(tmp_path, "--enable-lora", "--lora-unload-grace", "5").wait_ready()
    try:
        with httpx.Client(base_url=f"http://{eng.address}", timeout=20) as c:

            def load(path: str, **extra: object) -> None:
                r = c.post("/v1/load_lora_adapter", json={"lora_name": "g", "lora_path": path, **extra})
                assert r.status_code == 200, r.text

            def cached() -> int:
                r = c.post("/v1/completions", json={"model": "g", "prompt": PROMPT, "max_tokens": 1})
                assert r.status_code == 200, r.text
                return int((r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

            load("/one")
            assert cached() == 0 and cached() > 0
            load("/one", load_inplace=True)
            assert cached() == 0  # the files at /one were replaced
            assert cached() > 0
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "g"}).status_code == 200
            load("/one")  # cancels the unload: the same weights
            assert cached() > 0
            assert c.post("/v1/unload_lora_adapter", json={"lora_name": "g"}).status_code == 200
            load("/two")  # cancels the unload with other weights
            assert cached() == 0
    finally:
        harness.stop_all(eng.proc)


def _replay(endpoint: str, since: int) -> tuple[list, int]:
    """The engine's KV events from sequence `since` on, through its replay socket."""
    import struct

    import zmq

    from kvgate.api.contracts.kv_events import decode_batch, decode_seq

    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", struct.pack(">Q", since)])
    events: list = []
    try:
        while True:
            assert dealer.poll(5000), "replay did not answer"
            _, seq, payload = dealer.recv_multipart()
            if seq == b"\xff" * 8:
                return events, since
            since = decode_seq(seq) + 1
            events += decode_batch(payload).events
    finally:
        dealer.close()


def test_the_epps_precise_index_drops_an_adapters_blocks_when_its_weights_change(tmp_path) -> None:
    """The engine's KV events fed to the EPP's own PreciseIndex: after load_inplace the index
    holds none of the adapter's blocks for this engine (before the fix it kept them all, so the
    EPP kept sending that prefix here for hits on stale KV); the next request stores them again."""
    from kvgate.api.lora import lora_int_id
    from kvgate.epp.prefix_index import PreciseIndex, block_keys

    eng = launch(
        tmp_path, "--simulate", "--sim-time-scale", "0", "--enable-lora", "--lora-modules", "g=/one",
        "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*",
    )  # fmt: skip
    assert eng.replay_endpoint is not None
    prompt = [1000 + j for j in range(80)]  # 5 full blocks of 16
    index, since = PreciseIndex(), 0
    keys = block_keys(prompt, 16, lora_int_id("g"))

    def held() -> int:
        nonlocal since
        events, since = _replay(eng.replay_endpoint, since)
        index.apply("e", events)
        return index.prefix_blocks(keys, ["e"]).get("e", 0)

    try:
        with httpx.Client(base_url=eng.base_url, timeout=20) as c:

            def complete() -> None:
                r = c.post("/v1/completions", json={"model": "g", "prompt": prompt, "max_tokens": 1})
                assert r.status_code == 200, r.text

            complete()
            assert held() == 5
            load = {"lora_name": "g", "lora_path": "/one", "load_inplace": True}
            assert c.post("/v1/load_lora_adapter", json=load).status_code == 200
            eventually(lambda: held() == 0, 5, "the index drops the adapter's blocks")
            complete()
            assert held() == 5
    finally:
        eng.stop(signal.SIGKILL)
