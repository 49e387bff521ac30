"""The prefill/decode hand-off of the OpenAI endpoints (disaggregated serving, see docs/disaggregation.md).

What a completions or chat request does on an engine with a --kv-role: a producer answers a
do_remote_decode prefill with the kv_transfer_params to pull its blocks with; a consumer pulls a
prompt's KV from a producer (or has the chosen prefiller compute it) into its prefix cache before
the request is queued, and releases the pulled blocks when the request ends. `KVTransfer` moves
the blocks; this module is the request-level glue, kept apart so the endpoints read as generation.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvgate.engine.server.async_engine import RequestHandle
from kvgate.engine.server.errors import bad_request
from kvgate.engine.server.protocol import ChatCompletionRequest, CompletionRequest

if TYPE_CHECKING:
    from kvgate.engine.server.kv_transfer_http import Imported, KVTransfer


@dataclass(frozen=True)
class Handoff:
    """What a prefill/decode hand-off needs of the HTTP request: the route and body to send the
    prefiller, the prefiller the EPP chose (x-prefiller-host-port), the caller's credentials."""

    path: str
    raw_body: bytes
    prefiller: str | None = None
    authorization: str | None = None


class PDHandoff:
    """One engine's side of the hand-off; with no `KVTransfer` (no --kv-role) it does nothing."""

    def __init__(self, kv: KVTransfer | None) -> None:
        self.kv = kv

    def produces(self, req: CompletionRequest | ChatCompletionRequest) -> bool:
        """A prefill for a decode engine (vLLM's do_remote_decode): answered with the
        kv_transfer_params to pull its blocks with. Only on a producer; elsewhere ignored."""
        params = req.kv_transfer_params
        if params is None or not params.do_remote_decode or self.kv is None or not self.kv.settings.produces:
            return False
        if req.stream:
            raise bad_request("kv_transfer_params.do_remote_decode needs stream false.", "kv_transfer_params")
        return True

    async def pin_for_pull(self, prompt_ids: list[int], lora_id: int | None) -> dict[str, Any]:
        """A producer's answer (`produces` was true): the prompt's blocks pinned for the decoder."""
        assert self.kv is not None
        return await self.kv.pin_for_pull(prompt_ids, lora_id)

    async def pull_in(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        handoff: Handoff | None,
        prompt_ids: list[int],
        lora_id: int | None,
    ) -> Imported | None:
        """A consumer's hand-off, before the request is queued: the prompt's KV pulled from a
        producer into this engine's prefix cache (None: none, or it failed: computed here)."""
        kv = self.kv
        if kv is None or not kv.settings.consumes:
            return None
        auth = handoff.authorization if handoff else None
        params = req.kv_transfer_params
        if params is not None and params.do_remote_prefill:
            got = await kv.pull(params.model_dump(), prompt_ids, lora_id, auth)
        elif handoff is not None and handoff.prefiller:
            try:
                body = json.loads(handoff.raw_body)
            except ValueError:
                return None
            got = await kv.prefill_remotely(handoff.prefiller, handoff.path, body, prompt_ids, lora_id, auth)
        else:
            return None
        metrics = kv.metrics
        with metrics.lock:
            metrics.external_queries.inc(len(prompt_ids))
            metrics.external_hits.inc(got.tokens if got else 0)
            metrics.touch()
        return got

    async def release(self, imported: Imported | None) -> None:
        if imported is not None and self.kv is not None:
            await self.kv.release(imported)

    def closer(self, handle: RequestHandle, imported: Imported | None) -> Callable[[], None]:
        """A stream's close: the request's, then (off the caller's stack) the pulled blocks'."""
        if imported is None:
            return handle.close

        def close() -> None:
            handle.close()
            asyncio.get_running_loop().create_task(self.release(imported))

        return close
