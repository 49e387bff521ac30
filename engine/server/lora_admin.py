"""Runtime LoRA adapters, vLLM's endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"}
and POST /v1/unload_lora_adapter {"lora_name"}. Served only with --enable-lora (vLLM also wants
VLLM_ALLOW_RUNTIME_LORA_UPDATING; here the flag alone does) and guarded by --api-key.

A load reads and checks the adapter in a worker thread (steps go on), registers it with the
engine between two steps, and only then lists it in /v1/models, so no request can name an
adapter the engine does not know.

An unload takes the name out of /v1/models at once (routers reading it stop sending there) but
keeps serving it for --lora-unload-grace seconds, so requests a router sent before it noticed
still land; then the engine refuses new ones (404), lets running ones finish under the adapter,
and drops its weights when the last ends. A load of the same name during the grace or that drain
cancels the unload (the adapter stays, with the new weights).

New weights under a name (load_inplace, or a load cancelling an unload from another path) make
the engine drop every prefix-cache block computed with the old ones (see LLMEngine.add_lora).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvgate.engine.server.async_engine import AsyncEngine
from kvgate.engine.server.errors import APIError, bad_request
from kvgate.engine.server.serving import ModelInfo

log = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""
    load_inplace: bool = False  # vLLM: replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_int_id: int | None = None  # vLLM's body carries it; the name decides here


class LoRAAdmin:
    def __init__(self, engine: AsyncEngine, model: ModelInfo, unload_grace_s: float = 0.0) -> None:
        self.engine = engine
        self.model = model
        self.unload_grace_s = unload_grace_s
        self._busy: set[str] = set()  # names with a load or unload in progress
        self._timers: dict[str, asyncio.TimerHandle] = {}  # retiring name -> end of its grace
        self._tasks: set[asyncio.Task[None]] = set()  # grace ends being carried out

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        name, path = req.lora_name.strip(), req.lora_path.strip()
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name in self.model.served_names:
            raise bad_request(f"'{name}' is the base model's name; an adapter needs its own.", "lora_name")
        if name in self.model.adapters and not req.load_inplace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        with self._claim(name):
            timer = self._timers.pop(name, None)
            if timer is not None:  # a retiring name stays served while it loads
                timer.cancel()
            try:
                await self._read_and_add(name, path, req.load_inplace)
            except BaseException:
                if name in self.model.retiring:  # the unload it would have cancelled goes on
                    self._retire_later(name)
                raise
            self.model.retiring.pop(name, None)  # its unload is cancelled
            self.model.adapters[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    async def _read_and_add(self, name: str, path: str, inplace: bool) -> None:
        try:
            loaded = await asyncio.to_thread(_read, self.engine.engine, name, path)
            # the engine drops a pending unload of this name (one still draining its requests),
            # and the prefix cache's blocks of its old weights if these are new ones
            await self.engine.call(lambda engine: engine.add_lora(name, loaded, inplace=inplace))
        except FileNotFoundError:
            raise APIError(
                404,
                f"Loading lora {name} failed: No adapter found for {path}",
                param="lora_path",
                code="lora_not_found",
            ) from None
        except ValueError as exc:  # LoRAAdapterError included: one sentence on what is wrong
            raise bad_request(str(exc), "lora_path", code="invalid_lora_adapter") from None

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        name = req.lora_name.strip()
        if not name:
            raise bad_request("'lora_name' must be provided.", "lora_name")
        if name not in self.model.adapters:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found"
            )
        with self._claim(name):
            # out of /v1/models now: routers stop sending; still served through the grace
            self.model.retiring[name] = self.model.adapters.pop(name)
            if self.unload_grace_s > 0:
                self._retire_later(name)
            else:
                await self._retire(name)
        return f"Success: LoRA adapter '{name}' removed successfully."

    def _retire_later(self, name: str) -> None:
        loop = asyncio.get_running_loop()
        self._timers[name] = loop.call_later(self.unload_grace_s, self._grace_over, name)

    def _grace_over(self, name: str) -> None:
        self._timers.pop(name, None)
        task = asyncio.get_running_loop().create_task(self._retire(name))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _retire(self, name: str) -> None:
        """End of the grace: new requests naming it get 404; running ones finish under it."""
        if self.model.retiring.pop(name, None) is None:
            return  # loaded again meanwhile
        try:
            await self.engine.call(lambda engine: engine.remove_lora(name))
        except APIError:  # the engine stopped: nothing left to unregister from
            log.warning("adapter %s: the engine stopped before its unload", name)

    def _claim(self, name: str) -> _Claim:
        if name in self._busy:
            raise APIError(
                409,
                f"The lora adapter '{name}' is being loaded or unloaded; retry shortly.",
                param="lora_name",
                code="lora_busy",
            )
        return _Claim(self._busy, name)


def _read(engine: Any, name: str, path: str) -> Any:
    """Worker thread: the adapter read and checked (vLLM answers a path that is not there 404;
    a simulated engine reads nothing and takes any path)."""
    try:
        return engine.load_lora(name, path)
    except ValueError:
        if not Path(path).expanduser().exists():
            raise FileNotFoundError(path) from None
        raise


class _Claim:
    def __init__(self, busy: set[str], name: str) -> None:
        self.busy, self.name = busy, name

    def __enter__(self) -> None:
        self.busy.add(self.name)

    def __exit__(self, *exc: object) -> None:
        self.busy.discard(self.name)
