"""The plugin registry: one module per plugin, each registering itself and declaring what it
consumes; the EPP's data sources and the operator's token-scorer list follow the declarations."""

from __future__ import annotations

import importlib.util
import pkgutil
from pathlib import Path
from typing import Any, ClassVar

import pytest

from kvgate.api.k8s.crds import TOKEN_SCORERS
from kvgate.epp.scheduling import plugins
from kvgate.epp.scheduling.config import BUILTIN_PROFILES, load_config
from kvgate.epp.scheduling.framework import AdmissionObserver, Filter, Picker, Scorer
from kvgate.epp.scheduling.plugins.pd_profile_handler import PrefillDecodeHandler
from kvgate.epp.scheduling.registry import Consumes, consumers_of, plugin_types, register
from kvgate.epp.server import data_sources, needs_tokenizer

ROOT = Path(__file__).resolve().parents[2]
PLUGINS_DIR = ROOT / "epp" / "scheduling" / "plugins"
TESTS_DIR = Path(__file__).parent / "plugins"

# The types the config accepted before the registry (GIE's names): none may go missing.
KNOWN_TYPES = {
    "bounded-load-filter",
    "fresh-metrics-filter",
    "header-based-testing-filter",
    "kv-cache-utilization-scorer",
    "least-kv-cache-filter",
    "least-queue-filter",
    "load-aware-scorer",
    "lora-affinity-filter",
    "lora-affinity-scorer",
    "low-queue-filter",
    "max-score-picker",
    "model-served-filter",
    "precise-prefix-cache-scorer",
    "predicted-latency-scorer",
    "prefix-cache-scorer",
    "queue-scorer",
    "random-picker",
    "round-robin-picker",
    "weighted-random-picker",
}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(plugins.__path__) if not m.name.startswith("_"))


def test_every_known_plugin_type_is_registered() -> None:
    assert set(plugin_types()) >= KNOWN_TYPES


def test_each_plugin_lives_in_the_module_named_after_its_type_with_its_test_beside() -> None:
    types = plugin_types()
    by_module = {cls.__module__.rsplit(".", 1)[-1]: name for name, cls in types.items()}
    assert len(by_module) == len(types), "one plugin per module"
    for module, name in by_module.items():
        assert module == name.replace("-", "_"), f"{name} is in {module}.py"
    for module in _modules():
        assert module in by_module or module.endswith("_profile_handler"), f"{module}.py registers nothing"
        assert (TESTS_DIR / f"test_{module}.py").exists(), (
            f"{module}.py has no tests/epp/plugins/test_{module}.py"
        )


def test_each_registered_plugin_is_a_filter_scorer_or_picker_and_declares_what_it_consumes() -> None:
    for name, cls in plugin_types().items():
        plugin = cls()
        assert isinstance(plugin, Filter | Scorer | Picker), name
        assert plugin.name == name
        assert isinstance(cls.consumes, frozenset) and all(isinstance(c, Consumes) for c in cls.consumes)
        if isinstance(plugin, AdmissionObserver):  # told of other replicas' picks: says so
            assert Consumes.ADMISSIONS in cls.consumes, name


def test_register_asks_for_the_declarations_and_refuses_a_type_twice() -> None:
    class Undeclared:
        type_name: ClassVar[str] = "test-undeclared"

    with pytest.raises(TypeError, match="consumes"):
        register(Undeclared)

    class Twice:
        type_name: ClassVar[str] = "queue-scorer"
        consumes: ClassVar[frozenset[Consumes]] = frozenset()

    with pytest.raises(ValueError, match="registered twice"):
        register(Twice)


def test_the_tokenizer_is_loaded_for_what_the_plugins_declare() -> None:
    for name in BUILTIN_PROFILES:
        config = load_config(None, name)
        declared = any(Consumes.TOKENS in p.consumes() for p in _profiles(config))
        assert needs_tokenizer(config) == declared, name
    assert [n for n in BUILTIN_PROFILES if needs_tokenizer(load_config(None, n))] == [
        "precise-prefix",
        "precise-prefix-weights",
        "llm-d-tiered",
    ]
    # P/D counts uncached prompt tokens whatever the profile
    assert Consumes.TOKENS in PrefillDecodeHandler.consumes
    assert needs_tokenizer(load_config(None, "round-robin"), pd_threshold=0)
    assert Consumes.TOKENS in data_sources(load_config(None, "default"), pd_threshold=256)


def _profiles(config: Any) -> list[Any]:
    from kvgate.epp.scheduling.config import build_profiles

    return build_profiles(config)


def test_the_operators_token_scorers_are_generated_from_the_declarations() -> None:
    """api/ may not import epp/ (the import floors): scripts/gen_crds.py writes the list into
    api/contracts/epp_plugins.py; this fails while that file is stale."""
    spec = importlib.util.spec_from_file_location("gen_crds", ROOT / "scripts" / "gen_crds.py")
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.CONTRACT.read_text() == gen.rendered_contract(), "stale: run scripts/gen_crds.py"
    assert TOKEN_SCORERS == consumers_of(Consumes.TOKENS)
    assert set(TOKEN_SCORERS) == {"precise-prefix-cache-scorer", "predicted-latency-scorer"}
