"""Parsing of vLLM's ``--lora-modules`` values: ``name=path`` or the JSON form
``{"name": .., "path": .., "base_model_name": ..}``."""

from __future__ import annotations

import argparse
import json


def parse_lora_module(text: str) -> tuple[str, str]:
    """(name, path) of one --lora-modules value; argparse turns the ValueError into a usage error."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"invalid JSON LoRA module {text!r}: {exc}") from None
        if (
            not isinstance(obj, dict)
            or not isinstance(obj.get("name"), str)
            or not isinstance(obj.get("path"), str)
        ):
            raise argparse.ArgumentTypeError(f'JSON LoRA module needs string "name" and "path": {text!r}')
        name, path = obj["name"], obj["path"]
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"LoRA module must be NAME=PATH or JSON, got {text!r}")
    if not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"LoRA module needs a non-empty name and path: {text!r}")
    return name.strip(), path.strip()
