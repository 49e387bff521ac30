"""The shared KV-event codec against the raw vLLM array layout (decoded with plain msgpack)."""

from __future__ import annotations

import msgpack
import pytest

from kvgate.api.contracts.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventDecodeError,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
    parse_topic,
    topic_for,
)


def test_batch_encodes_to_the_vllm_array_layout() -> None:
    batch = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored([11, 22], None, list(range(32)), 16, None, "GPU"),
            BlockRemoved([11], "GPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=None,
    )
    raw = msgpack.unpackb(encode_batch(batch))
    assert raw == [
        12.5,
        [
            ["BlockStored", [11, 22], None, list(range(32)), 16, None, "GPU"],
            ["BlockRemoved", [11], "GPU"],
            ["AllBlocksCleared"],
        ],
        None,
    ]
    assert decode_batch(encode_batch(batch)) == batch


def test_decode_accepts_short_vllm_variants() -> None:
    payload = msgpack.packb([1.0, [["BlockStored", [1], 7, [1, 2], 2], ["BlockRemoved", [1]]]])
    batch = decode_batch(payload)
    assert batch.events[0] == BlockStored([1], 7, [1, 2], 2, None, None)
    assert batch.events[1] == BlockRemoved([1], None)
    assert batch.data_parallel_rank is None


@pytest.mark.parametrize(
    "payload",
    [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0, [["Nope"]]]), msgpack.packb([1.0, [[]]])],
)
def test_bad_payloads_raise_a_decode_error(payload: bytes) -> None:
    with pytest.raises(KVEventDecodeError):
        decode_batch(payload)


def test_topic_and_sequence_frames() -> None:
    topic = topic_for("10.0.0.5:8000", "meta-llama/Llama-3.1-8B")
    assert topic == "kv@10.0.0.5:8000@meta-llama/Llama-3.1-8B"
    assert parse_topic(topic) == ("10.0.0.5:8000", "meta-llama/Llama-3.1-8B")
    assert encode_seq(258) == b"\x00\x00\x00\x00\x00\x00\x01\x02"
    assert decode_seq(encode_seq(2**40)) == 2**40
    with pytest.raises(KVEventDecodeError):
        decode_seq(b"\x00")
    with pytest.raises(KVEventDecodeError):
        parse_topic("bogus")
