"""A Hugging Face Hub on loopback, speaking the HTTP API `huggingface_hub` calls to download:
repo info, the file tree, and `resolve` (HEAD for metadata, GET for bytes).

Only what cannot run here is faked: the real `huggingface_hub` client talks to it through
`HF_ENDPOINT`. Repos can be gated behind a token, and every request is recorded so tests can
say what was (not) downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass
class FakeRepo:
    files: dict[str, bytes]
    revisions: tuple[str, ...] = ("main",)
    token: str | None = None  # gated: only this bearer token may read it

    @property
    def sha(self) -> str:
        digest = hashlib.sha1()
        for name in sorted(self.files):
            digest.update(name.encode() + b"\0" + hashlib.sha1(self.files[name]).digest())
        return digest.hexdigest()


@dataclass
class FakeHub:
    repos: dict[str, FakeRepo] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)  # (method, path)
    url: str = ""

    def add_folder(
        self,
        repo_id: str,
        folder: Path,
        names: list[str] | None = None,
        revisions: tuple[str, ...] = ("main",),
        token: str | None = None,
    ) -> None:
        chosen = names or [p.name for p in folder.iterdir() if p.is_file()]
        files = {n: (folder / n).read_bytes() for n in chosen}
        self.repos[repo_id] = FakeRepo(files, revisions=revisions, token=token)

    def downloaded(self) -> list[str]:
        """File names fetched with GET .../resolve/..., in order."""
        return [
            path.rsplit("/", 1)[-1]
            for method, path in self.requests
            if method == "GET" and "/resolve/" in path
        ]


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _reply(
            self, status: int, body: bytes = b"", headers: dict[str, str] | None = None, head: bool = False
        ) -> None:
            self.send_response(status)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if not head:
                self.wfile.write(body)

        def _error(self, status: int, code: str, message: str, head: bool = False) -> None:
            body = json.dumps({"error": message}).encode()
            self._reply(status, body, {"X-Error-Code": code, "X-Error-Message": message}, head)

        def _repo(self, repo_id: str, revision: str, head: bool = False) -> FakeRepo | None:
            repo = hub.repos.get(repo_id)
            auth = self.headers.get("Authorization", "")
            if repo is None:
                self._error(401, "RepoNotFound", "Repository not found", head)
                return None
            if repo.token is not None and auth != f"Bearer {repo.token}":
                self._error(401, "GatedRepo", "Access to model is restricted", head)
                return None
            if revision not in repo.revisions and revision != repo.sha:
                self._error(404, "RevisionNotFound", "Invalid rev id", head)
                return None
            return repo

        def _route(self, head: bool) -> None:
            path = urlsplit(self.path).path
            hub.requests.append((self.command, path))
            parts = [unquote(p) for p in path.strip("/").split("/")]
            if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
                repo_id, revision = f"{parts[2]}/{parts[3]}", parts[5]
                repo = self._repo(repo_id, revision, head)
                if repo is None:
                    return
                info: object
                if parts[4] == "revision":
                    info = {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": repo.sha,
                        "siblings": [{"rfilename": n} for n in sorted(repo.files)],
                    }
                else:
                    info = [
                        {"type": "file", "path": n, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                        for n, data in sorted(repo.files.items())
                    ]
                self._reply(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, head)
                return
            if len(parts) >= 5 and parts[2] == "resolve":
                repo_id, revision, name = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
                repo = self._repo(repo_id, revision, head)
                if repo is None:
                    return
                if name not in repo.files:
                    self._error(404, "EntryNotFound", "Entry not found", head)
                    return
                data = repo.files[name]
                headers = {
                    "X-Repo-Commit": repo.sha,
                    "ETag": f'"{hashlib.sha1(data).hexdigest()}"',
                    "Content-Type": "application/octet-stream",
                }
                self._reply(200, data, headers, head)
                return
            self._error(404, "NotFound", f"no route for {path}", head)

        def do_GET(self) -> None:
            self._route(head=False)

        def do_HEAD(self) -> None:
            self._route(head=True)

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[FakeHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def default_tokenizer_files() -> dict[str, bytes]:
    """The default model's tokenizer as a Hub repo would hold it (tokenizer.json +
    tokenizer_config.json with its chat template and special tokens), plus a weights file that a
    tokenizer-only download must not fetch."""
    from kvgate.api.tokenizer import load_tokenizer

    tok = load_tokenizer("default")
    config = {"chat_template": tok.chat_template, **tok.special_tokens}
    return {
        "tokenizer.json": tok.backend.to_str().encode(),
        "tokenizer_config.json": json.dumps(config).encode(),
        "config.json": json.dumps({"model_type": "llama"}).encode(),
        "model.safetensors": b"\0" * 4096,
        "README.md": b"# fake\n",
    }


def tiny_llama(folder: Path) -> Path:
    """A random-weights one-layer Llama (seeded, fp32) with the default model's tokenizer, saved
    as a Hugging Face folder: it loads in about a second on a CPU, for tests that need an engine
    to load real weights from a volume or a Hub, not to say anything sensible."""
    import torch
    import transformers

    files = default_tokenizer_files()
    vocab = len(json.loads(files["tokenizer.json"])["model"]["vocab"])
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes(files[name])
    return folder
