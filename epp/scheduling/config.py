"""GIE's ``EndpointPickerConfig`` (YAML) → scheduling profiles, plus kvgate's built-in profiles."""

from __future__ import annotations

import re
from dataclasses import fields
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from kvgate.api.contracts.metrics import SATURATION_KV_CACHE_UTILIZATION, SATURATION_QUEUE_DEPTH
from kvgate.epp.saturation import METRICS_STALENESS_S, SaturationDetector
from kvgate.epp.scheduling.framework import Filter, Picker, Plugin, SchedulingProfile, Scorer
from kvgate.epp.scheduling.plugins.max_score_picker import MaxScorePicker
from kvgate.epp.scheduling.registry import plugin_types

API_VERSION = "inference.networking.x-k8s.io/v1alpha1"
KIND = "EndpointPickerConfig"


class ConfigError(ValueError):
    """The picker configuration is invalid; the message says where."""


class PluginSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: str
    name: str | None = None
    parameters: dict[str, Any] = Field(default_factory=dict)


class ProfilePluginRef(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    plugin_ref: str = Field(alias="pluginRef")
    weight: float | None = None


class ProfileSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    plugins: list[ProfilePluginRef]


class SaturationSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    queue_depth_threshold: float = Field(SATURATION_QUEUE_DEPTH, alias="queueDepthThreshold", gt=0)
    kv_cache_util_threshold: float = Field(
        SATURATION_KV_CACHE_UTILIZATION, alias="kvCacheUtilThreshold", gt=0
    )
    metrics_staleness_threshold: float = Field(METRICS_STALENESS_S, alias="metricsStalenessThreshold", gt=0)

    @field_validator("metrics_staleness_threshold", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Any:
        return parse_duration(v) if isinstance(v, str) else v


class EndpointPickerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    api_version: str = Field(API_VERSION, alias="apiVersion")
    kind: str = KIND
    plugins: list[PluginSpec] = Field(default_factory=list)
    scheduling_profiles: list[ProfileSpec] = Field(default_factory=list, alias="schedulingProfiles")
    saturation_detector: SaturationSpec = Field(
        default_factory=lambda: SaturationSpec.model_validate({}), alias="saturationDetector"
    )
    # kvgate extension: InferenceObjective name -> priority (negative = sheddable)
    objectives: dict[str, int] = Field(default_factory=dict)
    # kvgate extension: prefill/decode disaggregation above this many uncached prompt tokens
    # (epp/scheduling/plugins/pd_profile_handler.py); unset: off. The EPP's --pd-threshold overrides it.
    pd_threshold: int | None = Field(None, alias="pdThreshold", ge=0)

    @field_validator("kind")
    @classmethod
    def _kind(cls, v: str) -> str:
        if v != KIND:
            raise ValueError(f"kind must be {KIND}, got {v!r}")
        return v


def parse_duration(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.]+)\s*(ms|s|m)?\s*", text)
    if not m:
        raise ValueError(f"not a duration: {text!r} (use e.g. 50ms, 2s)")
    value = float(m.group(1))
    return value * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]


# GIE's default profile (queue 2, kv-cache 2, approximate prefix 3, LoRA affinity 2) and kvgate's own.
# Each starts with model-served-filter: never an engine that does not serve the request's model
# (an adapter loaded on some engines only); where every engine serves it, it keeps them all.
CONFORMANCE_PROFILE = "conformance"
BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "default": {
        "plugins": [
            {"type": "model-served-filter"},
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "prefix-cache-scorer"},
            {"type": "lora-affinity-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "model-served-filter"},
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "lora-affinity-scorer", "weight": 2},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    },
    # kvgate's default: the lowest predicted time to first token (the exact prefix each engine
    # holds from its KV events, the prefill work queued there, the pool's learnt speed) plus
    # what a pick costs the pool (see epp/scheduling/plugins/predicted_latency_scorer.py).
    "precise-prefix": {
        "plugins": [
            {"type": "model-served-filter"},
            {"type": "lora-affinity-filter", "parameters": {"loadedOnly": False}},
            {"type": "bounded-load-filter", "parameters": {"absoluteSlack": 16, "relativeSlack": 2}},
            {"type": "predicted-latency-scorer"},
            {"type": "lora-affinity-scorer"},
            {"type": "load-aware-scorer", "parameters": {"threshold": 16}},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "precise-prefix",
                "plugins": [
                    {"pluginRef": "model-served-filter"},
                    # an adapter request never waits for a slot where another engine has one
                    {"pluginRef": "lora-affinity-filter"},
                    # Affinity within bounds: an engine far busier than the least busy one
                    # (16 requests more and twice as many) takes no more, so one hot prompt
                    # (a system prompt every conversation shares) spreads before its holder's
                    # KV thrashes, which the TTFT estimate alone does not foresee.
                    {"pluginRef": "bounded-load-filter"},
                    {"pluginRef": "predicted-latency-scorer", "weight": 1},
                    # Neutral for base-model requests; for an adapter, a pick that needs no
                    # adapter load (or no eviction) wins, as in GIE's default, within what
                    # bounded-load-filter lets through. At 0.5 the latency scorer's balance
                    # term overrode it and loaded adapters again (--preset lora, 8 req/s: 41
                    # loads against 37, TTFT p90 0.33 s against 0.29).
                    {"pluginRef": "lora-affinity-scorer", "weight": 2},
                    # A tie-break, not a trade: among picks predicted alike (an adapter or prompt
                    # cold everywhere, its first request) the less loaded engine wins, so hot
                    # adapters and prefixes start out apart instead of sharing one engine.
                    {"pluginRef": "load-aware-scorer", "weight": 0.1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    },
    # kvgate's earlier default, kept for comparison: the exact prefix traded against absolute
    # load with fixed weights, so a holder loses once it is clearly busier than its peers.
    "precise-prefix-weights": {
        "plugins": [
            {"type": "model-served-filter"},
            {"type": "precise-prefix-cache-scorer"},
            {"type": "load-aware-scorer", "parameters": {"threshold": 16}},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "precise-prefix-weights",
                "plugins": [
                    {"pluginRef": "model-served-filter"},
                    {"pluginRef": "precise-prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "load-aware-scorer", "weight": 4},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    },
    # llm-d's tiered prefix cache, for comparison: two precise prefix scorers at fixed weights,
    # one counting the blocks on the device, one the blocks the engine holds in either tier
    # (a device block counts for both: 1.0 + 0.8, a host-tier block 0.8, as llm-d weighs the
    # tiers), beside llm-d's queue and KV-cache scorers.
    "llm-d-tiered": {
        "plugins": [
            {"type": "model-served-filter"},
            {"type": "precise-prefix-cache-scorer", "name": "gpu-prefix-cache-scorer"},
            {
                "type": "precise-prefix-cache-scorer",
                "name": "cpu-prefix-cache-scorer",
                "parameters": {"tier": "any"},
            },
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "llm-d-tiered",
                "plugins": [
                    {"pluginRef": "model-served-filter"},
                    {"pluginRef": "gpu-prefix-cache-scorer", "weight": 3},
                    {"pluginRef": "cpu-prefix-cache-scorer", "weight": 2.4},
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    },
    "round-robin": {
        "plugins": [{"type": "model-served-filter"}, {"type": "round-robin-picker"}],
        "schedulingProfiles": [
            {
                "name": "round-robin",
                "plugins": [{"pluginRef": "model-served-filter"}, {"pluginRef": "round-robin-picker"}],
            }
        ],
    },
    "random": {
        "plugins": [{"type": "model-served-filter"}, {"type": "random-picker"}],
        "schedulingProfiles": [
            {
                "name": "random",
                "plugins": [{"pluginRef": "model-served-filter"}, {"pluginRef": "random-picker"}],
            }
        ],
    },
    # GIE's conformance suite: the client names the pods (test-epp-endpoint-selection), and the
    # EPP reports the endpoint the gateway says served it (x-conformance-test-served-endpoint)
    CONFORMANCE_PROFILE: {
        "plugins": [{"type": "header-based-testing-filter"}, {"type": "round-robin-picker"}],
        "schedulingProfiles": [
            {
                "name": CONFORMANCE_PROFILE,
                "plugins": [
                    {"pluginRef": "header-based-testing-filter"},
                    {"pluginRef": "round-robin-picker"},
                ],
            }
        ],
    },
}
DEFAULT_PROFILE = "precise-prefix"


def load_config(path: str | None, profile: str | None = None) -> EndpointPickerConfig:
    """A config file, else the named built-in profile (kvgate's precise-prefix by default)."""
    if path:
        try:
            with open(path) as fh:
                raw = yaml.safe_load(fh)
        except OSError as exc:
            raise ConfigError(f"cannot read --config-file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config-file {path} is not valid YAML: {exc}") from None
        return parse_config(raw, source=path)
    name = profile or DEFAULT_PROFILE
    if name not in BUILTIN_PROFILES:
        raise ConfigError(f"unknown profile {name!r}; built-in profiles: {', '.join(BUILTIN_PROFILES)}")
    return parse_config(BUILTIN_PROFILES[name], source=f"built-in profile {name}")


def parse_config(raw: Any, source: str = "config") -> EndpointPickerConfig:
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: expected a mapping (an EndpointPickerConfig)")
    try:
        cfg = EndpointPickerConfig.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{source}: {where}: {first['msg']}") from None
    build_profiles(cfg, source)  # fail early on unknown plugins / bad parameters
    return cfg


def _camel_to_snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


# GIE parameter spellings that do not map mechanically onto ours.
_PARAM_ALIASES = {"maxNumOfEndpoints": "max_num_of_endpoints", "lruCapacityPerServer": "lru_capacity"}


def _instantiate(spec: PluginSpec, source: str) -> Plugin:
    known = plugin_types()
    cls = known.get(spec.type)
    if cls is None:
        raise ConfigError(f"{source}: unknown plugin type {spec.type!r}; known: {', '.join(sorted(known))}")
    allowed = {f.name for f in fields(cls) if f.init and f.name not in ("name", "rng")}
    kwargs: dict[str, Any] = {}
    for key, value in spec.parameters.items():
        attr = _PARAM_ALIASES.get(key, _camel_to_snake(key))
        if attr == "max_prefix_blocks_to_match":
            attr = "max_prefix_blocks"
        if attr not in allowed:
            raise ConfigError(f"{source}: plugin {spec.type!r} has no parameter {key!r}")
        if isinstance(value, str) and attr.endswith("_seconds"):
            value = parse_duration(value)
        kwargs[attr] = value
    try:
        return cls(name=spec.name or spec.type, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: plugin {spec.type!r}: {exc}") from None


def build_profiles(cfg: EndpointPickerConfig, source: str = "config") -> list[SchedulingProfile]:
    instances: dict[str, Plugin] = {}
    for spec in cfg.plugins:
        plugin = _instantiate(spec, source)
        if plugin.name in instances:
            raise ConfigError(f"{source}: two plugins are named {plugin.name!r}")
        instances[plugin.name] = plugin
    if not cfg.scheduling_profiles:
        raise ConfigError(f"{source}: schedulingProfiles is empty")
    profiles: list[SchedulingProfile] = []
    for prof in cfg.scheduling_profiles:
        flt: list[Filter] = []
        scr: list[tuple[Scorer, float]] = []
        pick: Picker | None = None
        for ref in prof.plugins:
            found = instances.get(ref.plugin_ref)
            if found is None:
                raise ConfigError(
                    f"{source}: profile {prof.name!r} refers to unknown plugin {ref.plugin_ref!r}"
                )
            if isinstance(found, Scorer):
                scr.append((found, 1.0 if ref.weight is None else ref.weight))
            elif isinstance(found, Filter):
                flt.append(found)
            elif isinstance(found, Picker):
                if pick is not None:
                    raise ConfigError(f"{source}: profile {prof.name!r} has two pickers")
                pick = found
        profiles.append(SchedulingProfile(prof.name, flt, scr, pick or MaxScorePicker()))
    return profiles


def saturation_detector(cfg: EndpointPickerConfig) -> SaturationDetector:
    s = cfg.saturation_detector
    return SaturationDetector(
        s.queue_depth_threshold, s.kv_cache_util_threshold, s.metrics_staleness_threshold
    )
