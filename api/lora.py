"""The one mapping from a LoRA adapter's name to the integer id that keys its KV blocks.

The engine seeds its prefix-cache hash chain (and the ``lora_id`` of its ``BlockStored``
events) with this id; the EPP hashes a request for that adapter with the same id to look its
prefix up. Both sides must agree without talking, so the id is a pure function of the name:
not vLLM's load-order counter, which differs between engines and restarts."""

from __future__ import annotations

import hashlib


def lora_int_id(name: str) -> int:
    """A stable positive 63-bit id for an adapter name (never 0: vLLM reserves 0 for 'no LoRA')."""
    digest = hashlib.blake2b(name.encode("utf-8"), digest_size=8, person=b"kvgate-lora").digest()
    return (int.from_bytes(digest, "big") >> 1) or 1


__all__ = ["lora_int_id"]
