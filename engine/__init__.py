"""kvgate's inference engine. `from kvgate.engine import LLM, SamplingParams` for offline use.

Exports resolve lazily so that importing a submodule (the server, the simulated runner) pays
only for what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvgate.engine.config import EngineConfig as EngineConfig
    from kvgate.engine.config import SimulationConfig as SimulationConfig
    from kvgate.engine.llm import LLM as LLM
    from kvgate.engine.llm import CompletionOutput as CompletionOutput
    from kvgate.engine.llm import CompletionRequestOutput as CompletionRequestOutput
    from kvgate.engine.llm_engine import EngineStats as EngineStats
    from kvgate.engine.llm_engine import LLMEngine as LLMEngine
    from kvgate.engine.sampling_params import SamplingParams as SamplingParams

_EXPORTS = {
    "LLM": "kvgate.engine.llm",
    "CompletionOutput": "kvgate.engine.llm",
    "CompletionRequestOutput": "kvgate.engine.llm",
    "LLMEngine": "kvgate.engine.llm_engine",
    "EngineStats": "kvgate.engine.llm_engine",
    "SamplingParams": "kvgate.engine.sampling_params",
    "EngineConfig": "kvgate.engine.config",
    "SimulationConfig": "kvgate.engine.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvgate.engine' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
