"""Prefill/decode disaggregation, the server half: a producer pins a finished prompt's blocks
and serves them once over HTTP; a consumer asks a producer to prefill, pulls the blocks into
its own prefix cache, and decodes. Whatever fails on the way, the consumer computes the prompt
itself: a hand-off can make a request faster, never lose it.

The wire: ``GET /v1/kv_transfer/{transfer_id}`` (API key as on every route; never public at
the gateway) answers ``application/octet-stream``: one JSON line (``layout``, ``block_hashes``,
``block_bytes``), then per block an 8-byte BLAKE2b digest and the block's bytes, then a 32-byte
HMAC-SHA256 over all of it keyed with the pool's shared secret (``KVGATE_KV_TRANSFER_SECRET``,
else the API key). Pulled blocks join the prefix cache every request shares, so a consumer
believes only a transfer whose tag checks out; with no secret, only loopback producers. The
producer unpins the blocks once they are sent, or when the pin times out (a consumer that died).

llm-d runs the decode side of this as a sidecar next to vLLM (it reads ``x-prefiller-host-port``,
calls the prefiller, then vLLM with the returned ``kv_transfer_params``); kvgate's engine server
reads the header itself, so a decode pod is one container. What runs on the engine thread (pinning
blocks, taking pulled ones in) is `kvgate.engine.kv_transfer_blocks`.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import ipaddress
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvgate.engine import kv_transfer_blocks as blocks
from kvgate.engine.core.runner_api import SimulatesTransfer, SupportsKVTransfer
from kvgate.engine.server.async_engine import AsyncEngine
from kvgate.engine.server.metrics import EngineMetrics

log = logging.getLogger("kvgate.engine.kv_transfer")

TRANSFER_PATH = "/v1/kv_transfer"
ROLES = ("none", "producer", "consumer", "both")
DIGEST_BYTES = 8
TAG_BYTES = 32  # HMAC-SHA256 after the last block
_HOST_PORT = re.compile(r"^(?:[A-Za-z0-9.\-]{1,253}|\[[0-9A-Fa-f:.]{2,45}\]):[0-9]{1,5}$")
_READ_CHUNK_BLOCKS = 32  # blocks read from the runner (and written) at a time


class TransferFailed(Exception):
    """A hand-off that did not happen; `reason` labels kvgate:kv_transfer_fallbacks_total."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def valid_peer(value: str | None) -> str | None:
    """A prefiller address as ``host:port`` (anything else names no peer)."""
    if not value or not _HOST_PORT.match(value) or not 0 < int(value.rsplit(":", 1)[1]) < 65536:
        return None
    return value


def _loopback(peer: str) -> bool:
    host = peer.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _digest(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


@dataclass
class KVTransferSettings:
    role: str = "none"
    advertise_host: str = "127.0.0.1"  # how other engines reach this one
    advertise_port: int = 0
    engine_id: str = ""
    pin_timeout: float = 30.0  # a producer's blocks wait this long for their pull
    timeout: float = 30.0  # a consumer's whole hand-off: the prefill call and the pull
    # Shared by a pool's engines: producers sign each transfer with it, consumers check. None:
    # only loopback producers are believed (pulled blocks join a cache all requests share).
    secret: bytes | None = None

    @property
    def produces(self) -> bool:
        return self.role in ("producer", "both")

    @property
    def consumes(self) -> bool:
        return self.role in ("consumer", "both")


@dataclass
class _Pinned:
    pin: blocks.Pin
    hashes: list[int]
    timer: asyncio.TimerHandle | None = None


@dataclass
class Imported:
    """A consumer's pulled blocks, held until its request no longer needs them."""

    pin: blocks.Pin
    tokens: int  # prompt tokens they hold
    seconds: float = 0.0
    released: bool = field(default=False)


class KVTransfer:
    def __init__(
        self, engine: AsyncEngine, settings: KVTransferSettings, metrics: EngineMetrics, api_key: str | None
    ) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        self.api_key = api_key
        self._pins: dict[str, _Pinned] = {}
        self._client: httpx.AsyncClient | None = None
        llm = engine.engine
        self.block_size: int = llm.block_size
        self.layout = blocks.runner_kv_layout(llm)
        if settings.role != "none" and self.layout is None:
            raise ValueError("--kv-role needs a model runner that can read and write KV blocks")

    def _kv_runner(self) -> SupportsKVTransfer:
        runner = self.engine.engine.kv_runner
        assert runner is not None, "a KV transfer needs a runner that reads and writes blocks"
        return runner

    @property
    def pinned_blocks(self) -> int:
        return sum(len(p.pin.blocks) for p in self._pins.values())

    def _client_for(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(self.settings.timeout, connect=2.0))
        return self._client

    async def close(self) -> None:
        for tid in list(self._pins):
            await self._unpin(tid)
        if self._client is not None:
            await self._client.aclose()

    # -- producer ---------------------------------------------------------------------------
    async def pin_for_pull(self, prompt_ids: list[int], lora_id: int | None) -> dict[str, Any]:
        """After a `do_remote_decode` request: hold its prompt's cached blocks for one pull and
        say where to pull them (vLLM's field names)."""
        hashes = blocks.prompt_block_hashes(prompt_ids, self.block_size, lora_id)
        pin = await self.engine.call(lambda llm: blocks.pin_cached_prefix(llm, hashes))
        tid = secrets.token_urlsafe(18)
        entry = _Pinned(pin, hashes[: len(pin.blocks)])
        self._pins[tid] = entry
        loop = asyncio.get_running_loop()
        entry.timer = loop.call_later(self.settings.pin_timeout, lambda: loop.create_task(self._expire(tid)))
        self._gauge()
        self._count("requests", {"role": "producer"})
        return {
            "do_remote_decode": False,
            "do_remote_prefill": True,
            "remote_engine_id": self.settings.engine_id,
            "remote_host": self.settings.advertise_host,
            "remote_port": self.settings.advertise_port,
            "remote_block_ids": pin.block_ids,
            "transfer_id": tid,
        }

    async def _expire(self, tid: str) -> None:
        if tid in self._pins:
            log.warning(
                "KV transfer %s: not pulled within %.0fs; blocks freed", tid, self.settings.pin_timeout
            )
            self._count("fallbacks", {"reason": "pin_expired"})
            await self._unpin(tid)

    async def _unpin(self, tid: str) -> None:
        entry = self._pins.pop(tid, None)
        if entry is None:
            return
        if entry.timer is not None:
            entry.timer.cancel()
        await self.engine.call(lambda llm: blocks.release(llm, entry.pin))
        self._gauge()

    def take_pull(self, tid: str) -> Callable[[], AsyncIterator[bytes]] | None:
        """The response body for one pull (None: no such transfer, or pulled already). The
        blocks are unpinned when it ends, sent or not."""
        entry = self._pins.get(tid)
        if entry is None:
            return None
        if entry.timer is not None:
            entry.timer.cancel()
            entry.timer = None
        runner = self._kv_runner()
        layout = self.layout or {}
        size = int(0 if layout.get("simulated") else layout.get("bytes_per_block", 0))
        # a simulated engine moves no bytes but counts the ones its model stands for
        modelled = int(layout.get("bytes_per_block", 0)) if layout.get("simulated") else 0

        async def body() -> AsyncIterator[bytes]:
            sent = 0
            try:
                head_line = json.dumps(
                    {"layout": layout, "block_hashes": entry.hashes, "block_bytes": size}
                ).encode()
                tag = self._tagger(tid, head_line)
                yield head_line + b"\n"
                ids = entry.pin.block_ids
                for start in range(0, len(ids), _READ_CHUNK_BLOCKS):
                    chunk = ids[start : start + _READ_CHUNK_BLOCKS]
                    blobs = await asyncio.to_thread(runner.read_kv_blocks, chunk)
                    for blob in blobs:
                        digest = _digest(blob)
                        tag.update(digest)
                        yield digest
                        yield bytes(blob)
                        sent += DIGEST_BYTES + len(blob) + modelled
                yield tag.digest()
            finally:
                self._count("bytes", {"direction": "sent"}, sent)
                await self._unpin(tid)

        return body

    # -- consumer ---------------------------------------------------------------------------
    async def prefill_remotely(
        self,
        prefiller: str,
        path: str,
        body: dict[str, Any],
        prompt_ids: list[int],
        lora_id: int | None,
        authorization: str | None,
    ) -> Imported | None:
        """Have `prefiller` compute the prompt, then pull its KV. None: do it here instead."""

        async def handoff() -> Imported:
            self._check_trusted(prefiller)
            params = await self._ask_prefill(prefiller, path, body, authorization)
            return await self._pull(params, prompt_ids, lora_id, authorization)

        return await self._bounded(prefiller, handoff)

    async def pull(
        self, params: dict[str, Any], prompt_ids: list[int], lora_id: int | None, authorization: str | None
    ) -> Imported | None:
        """A request that came with a producer's `kv_transfer_params` (vLLM's proxy flow)."""
        peer = f"{params.get('remote_host')}:{params.get('remote_port')}"
        return await self._bounded(peer, lambda: self._pull(params, prompt_ids, lora_id, authorization))

    async def _bounded(self, peer: str, handoff: Callable[[], Awaitable[Imported]]) -> Imported | None:
        """One consumer hand-off within --kv-transfer-timeout, counted; None when it failed."""
        t0 = time.monotonic()
        self._count("requests", {"role": "consumer"})
        try:
            async with asyncio.timeout(self.settings.timeout):
                got = await handoff()
        except TransferFailed as exc:
            self._fallback(exc.reason, str(exc), peer)
            return None
        except TimeoutError:
            self._fallback("timeout", f"over {self.settings.timeout:.0f}s", peer)
            return None
        got.seconds = time.monotonic() - t0
        self._observe(got.seconds)
        return got

    async def release(self, got: Imported | None) -> None:
        if got is None or got.released:
            return
        got.released = True
        try:
            await self.engine.call(lambda llm: blocks.release(llm, got.pin))
        except Exception:  # the engine is gone: nothing left to give back
            log.debug("KV transfer: release after the engine stopped", exc_info=True)

    def _fallback(self, reason: str, detail: str, peer: str) -> None:
        log.warning("KV transfer from %s failed (%s); prefilling locally", peer, detail)
        self._count("fallbacks", {"reason": reason})

    def _auth(self, authorization: str | None) -> dict[str, str]:
        if self.api_key:
            return {"authorization": f"Bearer {self.api_key}"}
        return {"authorization": authorization} if authorization else {}

    async def _ask_prefill(
        self, prefiller: str, path: str, body: dict[str, Any], authorization: str | None
    ) -> dict[str, Any]:
        ask = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "n", "best_of")}
        ask["kv_transfer_params"] = {"do_remote_decode": True}
        ask["max_tokens"] = 1
        if "max_completion_tokens" in ask:
            ask["max_completion_tokens"] = 1
        try:
            resp = await self._client_for().post(
                f"http://{prefiller}{path}", json=ask, headers=self._auth(authorization)
            )
        except httpx.HTTPError as exc:
            raise TransferFailed("prefiller_unreachable", f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            raise TransferFailed("prefiller_error", f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            params = resp.json()["kv_transfer_params"]
        except (ValueError, KeyError, TypeError):
            raise TransferFailed(
                "prefiller_error", "no kv_transfer_params in its answer (is it --kv-role producer?)"
            ) from None
        if not isinstance(params, dict) or not params.get("transfer_id"):
            raise TransferFailed(
                "prefiller_error", "no kv_transfer_params in its answer (is it --kv-role producer?)"
            )
        return params

    async def _pull(
        self, params: dict[str, Any], prompt_ids: list[int], lora_id: int | None, authorization: str | None
    ) -> Imported:
        host, port, tid = params.get("remote_host"), params.get("remote_port"), params.get("transfer_id")
        peer = valid_peer(f"{host}:{port}")
        if peer is None or not isinstance(tid, str) or not re.fullmatch(r"[A-Za-z0-9_\-]{8,64}", tid):
            raise TransferFailed("bad_params", f"cannot pull from {host!r}:{port!r}")
        self._check_trusted(peer)
        ours = blocks.prompt_block_hashes(prompt_ids, self.block_size, lora_id)
        received = 0
        plan: blocks.ImportPlan | None = None
        try:
            async with self._client_for().stream(
                "GET", f"http://{peer}{TRANSFER_PATH}/{tid}", headers=self._auth(authorization)
            ) as resp:
                if resp.status_code != 200:
                    raise TransferFailed("pull_refused", f"HTTP {resp.status_code}")
                frames = _Frames(resp.aiter_raw())
                head_line = await frames.line(1 << 24)
                head = json.loads(head_line)
                theirs = [int(h) for h in head["block_hashes"]]
                size = int(head["block_bytes"])
                if head.get("layout") != self.layout:
                    raise TransferFailed("layout_mismatch", f"{head.get('layout')} vs {self.layout}")
                if not theirs:
                    raise TransferFailed("no_full_block", "the prompt fills no whole block")
                ours_layout = self.layout or {}
                modelled = int(ours_layout.get("bytes_per_block", 0)) if ours_layout.get("simulated") else 0
                matched = 0
                while matched < min(len(theirs), len(ours)) and theirs[matched] == ours[matched]:
                    matched += 1
                if matched == 0:
                    raise TransferFailed("no_match", "the producer's blocks are not this prompt's")
                plan = await self.engine.call(lambda llm: blocks.reserve_import(llm, ours[:matched]))
                runner = self._kv_runner()
                tag = self._tagger(tid, head_line)
                pending_ids: list[int] = []
                pending: list[bytes] = []
                # Every frame is read (the tag covers them all); only planned blocks are written,
                # into blocks nobody can find until the tag has been checked.
                for i in range(len(theirs)):
                    digest = await frames.exactly(DIGEST_BYTES)
                    data = await frames.exactly(size)
                    received += DIGEST_BYTES + size + modelled
                    if _digest(data) != digest:
                        raise TransferFailed("bad_data", f"block {i} fails its checksum")
                    tag.update(digest)
                    if i < len(plan.hashes) and plan.fresh[i]:
                        pending_ids.append(plan.block_ids[i])
                        pending.append(data)
                    if len(pending) >= _READ_CHUNK_BLOCKS:
                        await asyncio.to_thread(runner.write_kv_blocks, pending_ids, pending)
                        pending_ids, pending = [], []
                if pending:
                    await asyncio.to_thread(runner.write_kv_blocks, pending_ids, pending)
                if not hmac.compare_digest(await frames.exactly(TAG_BYTES), tag.digest()):
                    raise TransferFailed(
                        "unauthenticated", "the transfer's tag does not match (another secret?)"
                    )
                if isinstance(runner, SimulatesTransfer):
                    await asyncio.sleep(runner.transfer_seconds(sum(plan.fresh)))
        except TransferFailed:
            await self._abandon(plan)
            raise
        except httpx.HTTPError as exc:
            await self._abandon(plan)
            raise TransferFailed("pull_failed", f"{type(exc).__name__}: {exc}") from None
        except (ValueError, KeyError, TypeError) as exc:
            await self._abandon(plan)
            raise TransferFailed("bad_data", str(exc)) from None
        except BaseException:
            await self._abandon(plan)
            raise
        finally:
            self._count("bytes", {"direction": "received"}, received)
        final = plan
        kept = await self.engine.call(
            lambda llm: blocks.commit_import(llm, final, len(final.hashes), prompt_ids, lora_id)
        )
        return Imported(final.pin, kept * self.block_size)

    def _check_trusted(self, peer: str) -> None:
        if self.settings.secret is None and not _loopback(peer):
            # Pulled blocks join the prefix cache every request shares: without a secret to
            # authenticate the producer, only this machine's engines are believed.
            raise TransferFailed(
                "untrusted_peer",
                f"{peer}: set KVGATE_KV_TRANSFER_SECRET (or --api-key) on the pool's engines",
            )

    def _tagger(self, tid: str, head_line: bytes) -> Any:
        """HMAC-SHA256 over the transfer id, its head line and every block digest, keyed with
        the pool's shared secret (none: a constant, and only loopback peers are believed)."""
        mac = hmac.new(self.settings.secret or b"", digestmod=hashlib.sha256)
        mac.update(tid.encode() + b"\n" + head_line + b"\n")
        return mac

    async def _abandon(self, plan: blocks.ImportPlan | None) -> None:
        if plan is not None:
            await self.engine.call(lambda llm: blocks.commit_import(llm, plan, 0, [], None))

    # -- metrics ----------------------------------------------------------------------------
    def _count(self, what: str, labels: dict[str, str], amount: float = 1.0) -> None:
        with self.metrics.lock:
            self.metrics.kv_transfer(what, labels).inc(amount)
            self.metrics.touch()

    def _observe(self, seconds: float) -> None:
        with self.metrics.lock:
            self.metrics.kv_transfer_seconds.observe(seconds)
            self.metrics.touch()

    def _gauge(self) -> None:
        with self.metrics.lock:
            self.metrics.kv_transfer_pinned.set(self.pinned_blocks)
            self.metrics.touch()


class _Frames:
    """Exact-size reads over a byte-chunk stream."""

    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = bytearray()

    async def _fill(self, n: int) -> None:
        while len(self._buf) < n:
            try:
                chunk = await anext(self._chunks)
            except StopAsyncIteration:
                raise ValueError(f"the transfer ended early ({len(self._buf)} of {n} bytes)") from None
            self._buf += chunk

    async def exactly(self, n: int) -> bytes:
        if n == 0:
            return b""
        await self._fill(n)
        out = bytes(self._buf[:n])
        del self._buf[:n]
        return out

    async def line(self, limit: int) -> bytes:
        while b"\n" not in self._buf:
            if len(self._buf) > limit:
                raise ValueError("the transfer's header line is too long")
            await self._fill(len(self._buf) + 1)
        end = self._buf.index(b"\n")
        out = bytes(self._buf[:end])
        del self._buf[: end + 1]
        return out
