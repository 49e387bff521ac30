"""`--tokenizer org/name` fetches only the tokenizer files from the Hub (the real
`huggingface_hub` client against a Hub on loopback), honours HF_TOKEN for gated repos, works
offline from the cache afterwards, and fails with a message that says what to do.

Each load runs in a child process: `huggingface_hub` reads HF_ENDPOINT / HF_HOME once, at import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.api.hub import TOKENIZER_FILES, parse_hub_ref
from kvgate.api.tokenizer import load_tokenizer
from kvgate.testing import fake_hub

pytestmark = pytest.mark.timeout(120)

LOAD = """
import json, sys
from kvgate.api.tokenizer import ModelNotFoundError, load_tokenizer
try:
    tok = load_tokenizer(sys.argv[1], sys.argv[2] or None)
except ModelNotFoundError as exc:
    print(json.dumps({"error": str(exc)}))
else:
    print(json.dumps({"ids": tok.encode("Hello, routed world!"), "template": bool(tok.chat_template)}))
"""


def load_in_child(hub_url: str, hf_home: Path, model: str, revision: str = "", **env: str) -> dict:
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    child_env.update(HF_ENDPOINT=hub_url, HF_HOME=str(hf_home), **env)
    out = subprocess.run(
        [sys.executable, "-c", LOAD, model, revision],
        env=child_env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hub() -> fake_hub.FakeHub:
    files = fake_hub.default_tokenizer_files()
    hub = fake_hub.FakeHub()
    hub.repos["acme/chat"] = fake_hub.FakeRepo(dict(files), revisions=("main", "v1"))
    hub.repos["acme/gated"] = fake_hub.FakeRepo(dict(files), token="hf_secret")
    with fake_hub.serve(hub):
        yield hub


def expected_ids() -> list[int]:
    return load_tokenizer("default").encode("Hello, routed world!")


def test_hub_ids_parse() -> None:
    assert parse_hub_ref("acme/chat") == parse_hub_ref("hf://acme/chat")
    assert str(parse_hub_ref("hf://acme/chat@v1")) == "acme/chat@v1"
    assert parse_hub_ref("acme/chat@v1", revision="v2").revision == "v2"  # the flag wins
    for not_hub in ("default", "/models/x", "./x/y", "acme", "a/b/c", "pvc://claim/x"):
        assert parse_hub_ref(not_hub) is None, not_hub


def test_tokenizer_only_download_then_offline(hub: fake_hub.FakeHub, tmp_path: Path) -> None:
    hub.requests.clear()
    got = load_in_child(hub.url, tmp_path, "acme/chat", "v1")
    assert got == {"ids": expected_ids(), "template": True}
    fetched = hub.downloaded()
    assert "tokenizer.json" in fetched and "tokenizer_config.json" in fetched
    assert set(fetched) <= set(TOKENIZER_FILES), fetched  # never the weights or the README

    # A restarted pod with its cache volume: no network needed, no request made.
    hub.requests.clear()
    again = load_in_child("http://127.0.0.1:9", tmp_path, "hf://acme/chat@v1")
    assert again["ids"] == got["ids"] and hub.requests == []


def test_gated_repo_needs_hf_token(hub: fake_hub.FakeHub, tmp_path: Path) -> None:
    refused = load_in_child(hub.url, tmp_path / "a", "acme/gated")
    assert "gated" in refused["error"] or "private" in refused["error"]
    assert "HF_TOKEN" in refused["error"]
    allowed = load_in_child(hub.url, tmp_path / "b", "acme/gated", HF_TOKEN="hf_secret")
    assert allowed["ids"] == expected_ids()


def test_clear_errors(hub: fake_hub.FakeHub, tmp_path: Path) -> None:
    missing = load_in_child(hub.url, tmp_path, "acme/nope")["error"]
    assert "acme/nope" in missing and "not on the Hub" in missing
    revision = load_in_child(hub.url, tmp_path, "acme/chat", "v9")["error"]
    assert "no revision 'v9'" in revision
    unreachable = load_in_child("http://127.0.0.1:9", tmp_path, "acme/other")["error"]
    assert "cannot be reached" in unreachable and str(tmp_path) in unreachable
    offline = load_in_child(hub.url, tmp_path, "acme/other", HF_HUB_OFFLINE="1")["error"]
    assert "HF_HUB_OFFLINE" in offline
