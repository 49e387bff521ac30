"""The engine pod's LoRA adapter fetcher (the operator's `fetch-adapters` sidecar):

    kvgate engine fetch-adapters --list /etc/kvgate/adapters/hf-adapters.json --dir /adapters/hf

Every `--interval` seconds it reads the list (a JSON array of {"repo", "revision", "dir"}, from a
ConfigMap the kubelet refreshes in place) and downloads each entry whose folder is missing from
the Hub into `<dir>/<entry dir>`: first into a `.partial` folder, renamed into place when
complete, so an engine loading the adapter never reads half a download. A failed download is
logged and retried on the next pass; folders no longer listed are left alone (an engine may read
an adapter it still serves from disk again). Needs huggingface_hub (the engine image has it).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("kvgate.engine.lora_fetch")
PARTIAL = ".partial"


def read_list(path: Path) -> list[dict[str, Any]]:
    """The listed entries, or none while the list is missing or unreadable (said in the log)."""
    try:
        entries = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        log.warning("cannot read the adapter list %s: %s", path, exc)
        return []
    if not isinstance(entries, list):
        log.warning("the adapter list %s is not a JSON array", path)
        return []
    good = []
    for entry in entries:
        folder = entry.get("dir") if isinstance(entry, dict) else None
        # A folder name only: a list naming ../ or / must not write outside --dir.
        if not isinstance(folder, str) or not folder or "/" in folder or folder in (".", ".."):
            log.warning("skipping a bad adapter list entry: %r", entry)
            continue
        if not isinstance(entry.get("repo"), str):
            log.warning("skipping an adapter list entry without repo: %r", entry)
            continue
        good.append(entry)
    return good


def fetch(entry: dict[str, Any], root: Path) -> bool:
    """Downloads one entry unless its folder is there; True when the folder is now complete."""
    target = root / entry["dir"]
    if target.is_dir():
        return True
    from huggingface_hub import snapshot_download

    partial = root / (entry["dir"] + PARTIAL)
    try:
        snapshot_download(repo_id=entry["repo"], revision=entry.get("revision"), local_dir=str(partial))
        # The download's own bookkeeping folder is no part of the adapter.
        shutil.rmtree(partial / ".cache", ignore_errors=True)
        os.rename(partial, target)
    except Exception as exc:  # any Hub or disk error: say it, try again next pass
        log.warning("fetching %s@%s failed: %s", entry["repo"], entry.get("revision") or "main", exc)
        return False
    log.info("fetched %s@%s into %s", entry["repo"], entry.get("revision") or "main", target)
    return True


def run_once(list_path: Path, root: Path) -> int:
    """One pass; returns how many listed adapters are not on disk yet."""
    return sum(not fetch(entry, root) for entry in read_list(list_path))


HELP = (
    "fetch the hf:// LoRA adapters a list names into a folder, and keep doing so (the engine pod's sidecar)"
)


def configure_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--list", required=True, type=Path, help="JSON list of {repo, revision, dir} (re-read each pass)"
    )
    p.add_argument("--dir", required=True, type=Path, help="folder the adapters are fetched into")
    p.add_argument("--interval", type=float, default=10.0, help="seconds between passes")
    p.add_argument(
        "--once", action="store_true", help="one pass; exit 1 if a listed adapter is still missing"
    )


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.once:
        return 1 if run_once(args.list, args.dir) else 0
    while True:
        run_once(args.list, args.dir)
        time.sleep(args.interval)
