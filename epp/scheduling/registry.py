"""The plugin registry: each plugin registers its own class with ``@register`` in its own module
under ``kvgate.epp.scheduling.plugins`` and declares what it consumes (``Consumes``).

The config file names plugins by their ``type_name`` (GIE's plugin types); the EPP imports every
module of the plugins package (``plugin_types()``), so a new plugin is one new module there, with
its test beside the others in tests/epp/plugins/. From the declarations the EPP decides which data
sources to build (kvgate.epp.server.data_sources), and scripts/gen_crds.py writes the plugin types
that key on tokens, which the operator reads (kvgate.api.contracts.epp_plugins).
"""

from __future__ import annotations

import enum
import importlib
import pkgutil
from collections.abc import Iterable
from typing import TypeVar


class Consumes(enum.Enum):
    """A signal a plugin reads, from a data source the EPP builds for it."""

    # The request's exact prompt tokens: the EPP loads the served model's tokenizer.
    TOKENS = "tokens"
    # The precise prefix index, fed by the engines' KV events (one ZMQ subscription per engine).
    KV_INDEX = "kv-index"
    # The engines' scraped /metrics (queue, running, KV use, counters); always scraped: the
    # saturation detector, flow control and readiness read them too.
    METRICS = "metrics"
    # The engines' admission announcements (other replicas' picks, our own picks confirmed),
    # which arrive on the KV-event subscription: what an endpoint's queue and load count and
    # what a plugin's observe_admission is told.
    ADMISSIONS = "admissions"
    # What each engine serves: its GET /v1/models list and the LoRA adapters its metrics show.
    ADAPTERS = "adapters"


PLUGINS_PACKAGE = "kvgate.epp.scheduling.plugins"

T = TypeVar("T", bound=type)

_TYPES: dict[str, type] = {}
_loaded = False


def register(cls: T) -> T:
    """Class decorator: makes ``cls`` configurable under its ``type_name``. The class declares
    ``type_name`` (GIE's kebab-case plugin type) and ``consumes`` (a frozenset of Consumes) as
    ClassVars, so mypy sees them on every instance."""
    type_name = cls.__dict__.get("type_name")
    if not isinstance(type_name, str) or not type_name:
        raise TypeError(f"{cls.__qualname__}: a registered plugin declares type_name: ClassVar[str]")
    consumes = cls.__dict__.get("consumes")
    if not isinstance(consumes, frozenset) or not all(isinstance(c, Consumes) for c in consumes):
        raise TypeError(
            f"{cls.__qualname__}: a registered plugin declares consumes: ClassVar[frozenset[Consumes]]"
        )
    known = _TYPES.get(type_name)
    if known is not None and (known.__module__, known.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"plugin type {type_name!r} is registered twice: {known!r} and {cls!r}")
    _TYPES[type_name] = cls
    return cls


def load_plugins() -> None:
    """Imports every module of the plugins package (those not starting with "_"), which
    registers what they define. Only the package's own modules: nothing else is scanned. Once
    per process."""
    global _loaded
    if _loaded:
        return
    package = importlib.import_module(PLUGINS_PACKAGE)
    for info in sorted(pkgutil.iter_modules(package.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            importlib.import_module(f"{PLUGINS_PACKAGE}.{info.name}")
    _loaded = True


def plugin_types() -> dict[str, type]:
    """type_name -> class, for every plugin the plugins package registers."""
    load_plugins()
    return dict(sorted(_TYPES.items()))


def consumers_of(signal: Consumes) -> tuple[str, ...]:
    """The plugin types that declare ``signal``, sorted."""
    return tuple(name for name, cls in plugin_types().items() if signal in consumed_by(cls))


def consumed_by(plugin: object) -> frozenset[Consumes]:
    """What a plugin (class or instance) declares; nothing if it declares nothing."""
    found: object = getattr(plugin, "consumes", frozenset())
    return found if isinstance(found, frozenset) else frozenset()


def union(plugins: Iterable[object]) -> frozenset[Consumes]:
    out: frozenset[Consumes] = frozenset()
    for p in plugins:
        out |= consumed_by(p)
    return out


__all__ = [
    "Consumes",
    "consumed_by",
    "consumers_of",
    "load_plugins",
    "plugin_types",
    "register",
    "union",
]
