"""KV-cache events in vLLM's ZMQ wire layout (the one llm-d's KV indexer decodes).

A message is three ZMQ frames: topic ``kv@<host:port>@<model>``, an 8-byte big-endian
sequence number, and a msgpack payload ``[ts, [event, ...], dp_rank]``. Each event is an
array tagged by its first element:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

Engines publish these; the EPP decodes them. Both sides import only this module.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any

import msgpack

DEFAULT_MEDIUM = "GPU"


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = DEFAULT_MEDIUM


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = DEFAULT_MEDIUM


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


class KVEventDecodeError(ValueError):
    """A payload that is not a valid vLLM KV-event batch."""


def topic_for(endpoint: str, model: str) -> str:
    """``kv@<pod-ip:port>@<model>``: llm-d's indexer reads the pod and model from it."""
    return f"kv@{endpoint}@{model}"


def parse_topic(topic: str) -> tuple[str, str]:
    parts = topic.split("@", 2)
    if len(parts) != 3 or parts[0] != "kv":
        raise KVEventDecodeError(f"not a KV-event topic: {topic!r}")
    return parts[1], parts[2]


def _event_to_wire(ev: KVEvent) -> list[Any]:
    if isinstance(ev, BlockStored):
        return [
            "BlockStored",
            list(ev.block_hashes),
            ev.parent_block_hash,
            list(ev.token_ids),
            ev.block_size,
            ev.lora_id,
            ev.medium,
        ]
    if isinstance(ev, BlockRemoved):
        return ["BlockRemoved", list(ev.block_hashes), ev.medium]
    return ["AllBlocksCleared"]


def encode_batch(batch: KVEventBatch) -> bytes:
    payload = [batch.ts, [_event_to_wire(e) for e in batch.events], batch.data_parallel_rank]
    return msgpack.packb(payload, use_bin_type=True)


def _event_from_wire(raw: Any) -> KVEvent:
    if not isinstance(raw, list | tuple) or not raw:
        raise KVEventDecodeError(f"event is not a tagged array: {raw!r}")
    tag = raw[0]
    if tag == "BlockStored":
        if len(raw) < 5:
            raise KVEventDecodeError("BlockStored needs at least 5 fields")
        return BlockStored(
            block_hashes=list(raw[1]),
            parent_block_hash=raw[2],
            token_ids=list(raw[3]),
            block_size=int(raw[4]),
            lora_id=raw[5] if len(raw) > 5 else None,
            medium=raw[6] if len(raw) > 6 else None,
        )
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise KVEventDecodeError("BlockRemoved needs block_hashes")
        return BlockRemoved(block_hashes=list(raw[1]), medium=raw[2] if len(raw) > 2 else None)
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    raise KVEventDecodeError(f"unknown KV event tag {tag!r}")


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise KVEventDecodeError(f"payload is not msgpack: {exc}") from exc
    if not isinstance(raw, list | tuple) or len(raw) < 2:
        raise KVEventDecodeError("batch must be [ts, events, dp_rank]")
    events = [_event_from_wire(e) for e in raw[1]]
    dp_rank = raw[2] if len(raw) > 2 else None
    return KVEventBatch(ts=float(raw[0]), events=events, data_parallel_rank=dp_rank)


def encode_seq(seq: int) -> bytes:
    return struct.pack(">Q", seq)


def decode_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise KVEventDecodeError(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int(struct.unpack(">Q", frame)[0])
