"""KV events decoded with plain pyzmq + msgpack, the way llm-d's indexer reads them."""

from __future__ import annotations

import itertools
import struct
import uuid

import httpx
import msgpack
import zmq

from kvgate.testing import eventually
from kvgate.testing.engine_server import EngineProcess, subscribe_kv_events

from .conftest import API_KEY

AUTH = {"authorization": f"Bearer {API_KEY}"}
BLOCK = 16


def _decode(frames: list[bytes]) -> tuple[str, int, list]:
    topic, seq, payload = frames
    ts, events, *_dp_rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float)
    return topic.decode(), struct.unpack(">Q", seq)[0], events


def _subscribe(eng: EngineProcess) -> zmq.Socket:
    assert eng.kv_endpoint is not None
    return subscribe_kv_events(eng.kv_endpoint, lambda: _complete(eng, f"warm up {uuid.uuid4().hex} " * 4))


def _complete(eng: EngineProcess, prompt: str, max_tokens: int = 2) -> dict:
    r = httpx.post(
        f"{eng.base_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True},
        headers=AUTH,
        timeout=30,
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_block_stored_matches_the_tokenized_prompt(sim_engine: EngineProcess) -> None:
    assert sim_engine.topic == f"kv@{sim_engine.base_url.removeprefix('http://')}@sim-model"
    sub = _subscribe(sim_engine)
    prompt = "The quick brown fox jumps over the lazy dog. " * 6 + uuid.uuid4().hex
    ids = httpx.post(f"{sim_engine.base_url}/tokenize", json={"prompt": prompt}, headers=AUTH).json()[
        "tokens"
    ]
    assert len(ids) > 3 * BLOCK
    _complete(sim_engine, prompt, max_tokens=1)

    stored: list[list] = []
    seqs: list[int] = []
    while sub.poll(500):
        topic, seq, events = _decode(sub.recv_multipart())
        assert topic == sim_engine.topic
        seqs.append(seq)
        stored += [e for e in events if e[0] == "BlockStored"]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "sequence numbers must be consecutive"
    full = len(ids) // BLOCK
    tokens = [t for e in stored for t in e[3]]
    assert tokens[: full * BLOCK] == ids[: full * BLOCK]
    first = stored[0]
    # ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
    assert len(first) == 7
    assert first[2] is None  # the prompt's first block has no parent
    assert first[4] == BLOCK and first[5] is None and first[6] == "GPU"
    assert len(first[1]) * BLOCK == len(first[3])
    hashes = [h for e in stored for h in e[1]]
    assert len(set(hashes)) == len(hashes) and all(isinstance(h, int) for h in hashes)
    for prev, nxt in itertools.pairwise(stored):
        assert nxt[2] == prev[1][-1], "blocks chain from their parent"

    # The same prompt again is a prefix-cache hit: no new BlockStored for its full blocks.
    before = sim_engine.metrics()
    again = _complete(sim_engine, prompt, max_tokens=1)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= full * BLOCK - BLOCK
    after = sim_engine.metrics()
    assert (
        after["vllm:prefix_cache_hits_total"] - before["vllm:prefix_cache_hits_total"] >= (full - 1) * BLOCK
    )
    while sub.poll(300):
        _, _, events = _decode(sub.recv_multipart())
        for e in events:
            if e[0] == "BlockStored":
                assert e[3] != ids[:BLOCK]
    sub.close()


def test_replay_serves_missed_batches(sim_engine: EngineProcess) -> None:
    sub = _subscribe(sim_engine)
    _complete(sim_engine, "replay me please " * 8 + uuid.uuid4().hex)
    live = []
    while sub.poll(400):
        frames = sub.recv_multipart()
        live.append((struct.unpack(">Q", frames[1])[0], frames[2]))
    assert live
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(sim_engine.replay_endpoint)
    dealer.send_multipart([b"", struct.pack(">Q", live[0][0])])
    replayed = []
    while True:
        assert dealer.poll(5000), "replay did not answer"
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == b"\xff" * 8:  # end marker: seq -1, empty payload
            assert payload == b""
            break
        replayed.append((struct.unpack(">Q", seq)[0], payload))
    assert replayed[: len(live)] == live
    # A start past the newest batch replays nothing but the end marker.
    dealer.send_multipart([b"", struct.pack(">Q", 2**62)])
    assert dealer.poll(5000)
    assert dealer.recv_multipart() == [b"", b"\xff" * 8, b""]
    dealer.close()
    sub.close()


def test_connect_mode_pushes_to_a_binding_subscriber(engine_factory) -> None:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.bind("tcp://127.0.0.1:*")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    endpoint = sub.getsockopt_string(zmq.LAST_ENDPOINT)
    eng = engine_factory("--simulate", "--kv-events-endpoint", endpoint, "--kv-events-connect")

    def pushed() -> bool:
        if sub.poll(100):
            return True
        r = httpx.post(
            f"{eng.base_url}/v1/completions", json={"prompt": uuid.uuid4().hex * 8, "max_tokens": 1}
        )
        assert r.status_code == 200
        return False

    eventually(pushed, 10, "KV events pushed", interval=0)
    topic, _, events = _decode(sub.recv_multipart())
    assert topic.startswith("kv@127.0.0.1:") and topic.endswith("@default")
    assert events and events[0][0] == "BlockStored"
    sub.close()


def test_unbindable_endpoint_is_a_clear_cli_error() -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-P", "-m", "kvgate", "engine", "serve", "--simulate", "--port", "0",
         "--kv-events-endpoint", "tcp://192.0.2.1:5557"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "--kv-events-connect" in out.stderr


def test_eviction_publishes_block_removed_for_stored_hashes(engine_factory) -> None:
    eng = engine_factory(
        "--simulate", "--sim-time-scale", "0", "--sim-kv-blocks", "24", "--max-model-len", "256",
        "--kv-events-endpoint", "tcp://127.0.0.1:*", "--kv-events-replay-endpoint", "tcp://127.0.0.1:*",
    )  # fmt: skip
    for i in range(12):  # 12 distinct 5-block prompts through a 24-block pool: old blocks get evicted
        prompt = [1000 + i * 100 + j for j in range(80)]
        r = httpx.post(f"{eng.base_url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=30)
        assert r.status_code == 200
    # The whole history, from seq 0, through the replay socket (no slow-joiner race).
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(eng.replay_endpoint)
    dealer.send_multipart([b"", struct.pack(">Q", 0)])
    stored: set[int] = set()
    removed: list[int] = []
    seqs = []
    while True:
        assert dealer.poll(5000), "replay did not answer"
        _, seq, payload = dealer.recv_multipart()
        if seq == b"\xff" * 8:
            break
        seqs.append(struct.unpack(">Q", seq)[0])
        for e in msgpack.unpackb(payload)[1]:
            if e[0] == "BlockStored":
                stored.update(e[1])
            elif e[0] == "BlockRemoved":
                assert e[2] == "GPU"
                removed.extend(e[1])
    assert seqs == list(range(len(seqs)))
    assert removed, "a full pool must evict and announce it"
    assert set(removed) <= stored, "only announced blocks are ever removed"
    dealer.close()


def test_admissions_of_epp_picks_are_announced(sim_engine: EngineProcess) -> None:
    """A request a kvgate EPP picked (x-kvgate-picked-by) is announced on the KV-event socket
    under its own topic, with the prompt's tokens; others are not, and a subscriber filtering
    on "kv@" (as the tests above and llm-d's indexer do) never sees one. With a valid
    x-kvgate-service-tokens the announcement also names the tenant and the service charged."""
    from kvgate.api.contracts import admissions

    assert sim_engine.kv_endpoint is not None
    poke = lambda: _complete(sim_engine, f"warm up {uuid.uuid4().hex} " * 4)  # noqa: E731
    sub = subscribe_kv_events(sim_engine.kv_endpoint, poke, topic=b"")  # every topic
    prompt = "announce this admission " * 4 + uuid.uuid4().hex
    ids = httpx.post(f"{sim_engine.base_url}/tokenize", json={"prompt": prompt}, headers=AUTH).json()[
        "tokens"
    ]
    for header in (
        {},
        {admissions.PICKED_BY_HEADER: "not a replica id"},
        {admissions.PICKED_BY_HEADER: "a9"},
        {
            admissions.PICKED_BY_HEADER: "b7",
            admissions.FAIRNESS_ID_HEADER: "team-a",
            admissions.SERVICE_TOKENS_HEADER: "321.5",
        },
        {  # a service that is not a number: announced, without tenant or service
            admissions.PICKED_BY_HEADER: "c8",
            admissions.FAIRNESS_ID_HEADER: "team-a",
            admissions.SERVICE_TOKENS_HEADER: "nan",
        },
        {  # a fairness id that is no tenant's name: the same
            admissions.PICKED_BY_HEADER: "d6",
            admissions.FAIRNESS_ID_HEADER: "team a",
            admissions.SERVICE_TOKENS_HEADER: "5",
        },
    ):
        r = httpx.post(
            f"{sim_engine.base_url}/v1/completions",
            json={"prompt": prompt, "max_tokens": 1},
            headers={**AUTH, **header},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    # two sequences of one request: the service it was charged is announced once
    r = httpx.post(
        f"{sim_engine.base_url}/v1/completions",
        json={"prompt": prompt, "max_tokens": 1, "n": 2},
        headers={
            **AUTH,
            admissions.PICKED_BY_HEADER: "e5",
            admissions.FAIRNESS_ID_HEADER: "team-b",
            admissions.SERVICE_TOKENS_HEADER: "40",
        },
        timeout=30,
    )
    assert r.status_code == 200, r.text
    announced = []
    while sub.poll(500):
        frames = sub.recv_multipart()
        if admissions.is_admission_topic(frames[0]):
            assert len(frames) == 2
            announced.append((frames[0], admissions.decode(frames[1])))
        else:
            assert len(frames) == 3 and frames[0].startswith(b"kv@")  # KV events keep vLLM's layout
    sub.close()
    assert [a.picked_by for _, a in announced] == ["a9", "b7", "c8", "d6", "e5", "e5"], (
        "only the requests with a valid replica id are announced"
    )
    topic, adm = announced[0]
    assert topic == admissions.topic_for(sim_engine.base_url.removeprefix("http://"), "sim-model")
    assert adm.picked_by == "a9" and adm.token_ids == ids and adm.lora_id is None
    assert (adm.fairness_id, adm.service_tokens) == (None, 0.0)
    told = announced[1][1]
    assert told.token_ids == ids and (told.fairness_id, told.service_tokens) == ("team-a", 321.5)
    for _, plain in announced[2:4]:
        assert (plain.fairness_id, plain.service_tokens) == (None, 0.0)
    assert [(a.fairness_id, a.service_tokens) for _, a in announced[4:]] == [("team-b", 40.0), (None, 0.0)]
