"""LoRA adapters on a real simulated engine server: vLLM's flags, /v1/models, requests naming
an adapter, vllm:lora_requests_info, and adapter-keyed prefix caching."""

from __future__ import annotations

import json
import subprocess
import sys

import httpx
import pytest

from kvgate.testing import processes as harness

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
        (["--enable-lora"], "--enable-lora needs --simulate"),
    ],
)
def test_bad_lora_flags_are_clear_errors(args: list[str], message: str) -> None:
    port = harness.free_port()
    simulate = [] if message.startswith("--enable-lora needs") else ["--simulate"]
    cmd = [sys.executable, "-P", "-m", "kvgate", "engine", "serve", *simulate, "--port", str(port), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and message in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
