"""Hugging Face Hub ids → local folders: the cache first, then a download of only what is needed.

The EPP needs the tokenizer files of the model it routes for (a few MB), the engine needs the
weights as well. Both resolve `org/name[@revision]` (or `hf://org/name[@revision]`) here, with the
`huggingface_hub` client, so the standard variables apply: `HF_TOKEN` for gated or private
repos, `HF_HOME` / `HF_HUB_CACHE` for where files land (a writable volume in a pod),
`HF_ENDPOINT` for a mirror, `HF_HUB_OFFLINE=1` to never touch the network.

A snapshot already in the cache that holds what is needed is used without a network call, so a
restarted pod with a surviving cache starts offline and fast.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

log = logging.getLogger("kvgate.hub")

Need = Literal["tokenizer", "model"]

# What a tokenizer (fast or slow) and its chat template can be made of; config.json tells the
# model family; never any weights.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "config.json",
    "generation_config.json",
)
# Safetensors only: the .bin/.pt/.h5/.msgpack copies many repos also carry would double the
# download for nothing the engine reads.
MODEL_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model", "*.gguf")

_REPO_RE = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+$")


class HubError(FileNotFoundError):
    """A Hub id that cannot be turned into local files; the message says why and what to do."""


@dataclass(frozen=True)
class HubRef:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_ref(text: str, revision: str | None = None) -> HubRef | None:
    """`org/name`, `org/name@rev` or `hf://org/name[@rev]` → a HubRef; anything else → None.

    An explicit `revision` argument wins over one written in the text.
    """
    body = text.removeprefix("hf://")
    repo, _, written = body.partition("@")
    if not _REPO_RE.match(repo) or (body == text and Path(text).expanduser().exists()):
        return None
    return HubRef(repo, revision or written or None)


def _has(folder: Path, need: Need) -> bool:
    if need == "tokenizer":
        return (folder / "tokenizer.json").is_file() or (folder / "tokenizer.model").is_file()
    return (folder / "config.json").is_file() and (
        any(folder.glob("*.safetensors")) or any(folder.glob("*.gguf"))
    )


def cached_snapshot(ref: HubRef, need: Need) -> Path | None:
    """The cached snapshot of `ref` if it holds what `need` asks for; never touches the network."""
    from huggingface_hub import snapshot_download

    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError and friends: simply not cached
        return None
    return folder if _has(folder, need) else None


def fetch(ref: HubRef, need: Need) -> Path:
    """A local folder with `need`'s files of `ref`: from the cache, else downloaded."""
    cached = cached_snapshot(ref, need)
    if cached is not None:
        return cached
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from huggingface_hub.utils import disable_progress_bars

    disable_progress_bars()  # one log line per download instead of interleaved bars
    patterns = list(TOKENIZER_FILES) if need == "tokenizer" else list(MODEL_PATTERNS)
    where = constants.HF_HUB_CACHE
    log.info("downloading the %s files of %s from %s into %s", need, ref, constants.ENDPOINT, where)
    started = time.monotonic()
    token_hint = "set HF_TOKEN (a ModelDeployment names its Secret in spec.model.hfTokenSecret)"
    try:
        folder = Path(snapshot_download(ref.repo_id, revision=ref.revision, allow_patterns=patterns))
    except GatedRepoError as exc:
        raise HubError(f"{ref} is a gated repository and this token may not read it: {token_hint}") from exc
    except RepositoryNotFoundError as exc:
        raise HubError(f"{ref} is not on the Hub, or it is private: check the name, or {token_hint}") from exc
    except RevisionNotFoundError as exc:
        raise HubError(f"{ref}: the repository has no revision {ref.revision!r}") from exc
    except LocalEntryNotFoundError as exc:
        offline = " (HF_HUB_OFFLINE is set)" if os.environ.get("HF_HUB_OFFLINE") else ""
        raise HubError(
            f"{ref} is not in the Hugging Face cache ({where}) and the Hub at {constants.ENDPOINT} "
            f"cannot be reached{offline}"
        ) from exc
    except HfHubHTTPError as exc:
        raise HubError(f"{ref}: the Hub answered {exc}") from exc
    except OSError as exc:
        raise HubError(
            f"{ref}: cannot write the Hugging Face cache at {where} ({exc}); set HF_HOME to a writable folder"
        ) from exc
    if not _has(folder, need):
        what = (
            "tokenizer.json or tokenizer.model"
            if need == "tokenizer"
            else "config.json and safetensors weights"
        )
        raise HubError(f"{ref} has no {what}")
    log.info("downloaded %s in %.1f s", ref, time.monotonic() - started)
    return folder
