"""Runtime LoRA adapters, vLLM's endpoints: POST /v1/load_lora_adapter {"lora_name", "lora_path"}
and POST /v1/unload_lora_adapter {"lora_name"}. Served only with --enable-lora (vLLM also wants
VLLM_ALLOW_RUNTIME_LORA_UPDATING; here the flag alone does) and guarded by --api-key.

A load reads and checks the adapter in a worker thread (steps go on), registers it with the
engine between two steps, and only then lists it in /v1/models, so no request can name an
adapter the engine does not know. An unload removes the name first (new requests get 404);
requests already running finish under the adapter, whose weights go when the last one ends.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from kvgate.engine.server.async_engine import AsyncEngine
from kvgate.engine.server.errors import APIError, bad_request
from kvgate.engine.server.serving import ModelInfo


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
    def __init__(self, engine: AsyncEngine, model: ModelInfo) -> None:
        self.engine = engine
        self.model = model
        self._busy: set[str] = set()  # names with a load or unload in progress

    async def load(self, req: LoadLoRAAdapterRequest) -> str:
        name, path = req.lora_name.strip(), req.lora_path.strip()
        if not name or not path:
            raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", "lora_name")
        if name in self.model.served_names:
            raise bad_request(f"'{name}' is the base model's name; an adapter needs its own.", "lora_name")
        if name in self.model.adapters and not req.load_inplace:
            raise bad_request(f"The lora adapter '{name}' has already been loaded.", "lora_name")
        with self._claim(name):
            try:
                loaded = await asyncio.to_thread(_read, self.engine.engine, name, path)
                await self.engine.call(lambda engine: engine.add_lora(name, loaded))
            except FileNotFoundError:
                raise APIError(
                    404,
                    f"Loading lora {name} failed: No adapter found for {path}",
                    param="lora_path",
                    code="lora_not_found",
                ) from None
            except ValueError as exc:  # LoRAAdapterError included: one sentence on what is wrong
                raise bad_request(str(exc), "lora_path", code="invalid_lora_adapter") from None
            self.model.adapters[name] = path
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, req: UnloadLoRAAdapterRequest) -> str:
        name = req.lora_name.strip()
        if not name:
            raise bad_request("'lora_name' must be provided.", "lora_name")
        if name not in self.model.adapters:
            raise APIError(
                404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="lora_not_found"
            )
        with self._claim(name):
            del self.model.adapters[name]  # new requests naming it: 404 from now on
            await self.engine.call(lambda engine: engine.remove_lora(name))
        return f"Success: LoRA adapter '{name}' removed successfully."

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
