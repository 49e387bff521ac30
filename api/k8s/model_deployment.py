"""kvgate's own kind, `ModelDeployment` (`kvgate.dev/v1alpha1`): one served model, from which the
operator builds the engine Deployment, the InferencePool, the endpoint picker and the autoscaler.

Its CRD declaration (with GIE's kinds) is in `crds.py`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import yaml
from pydantic import ConfigDict, Field, field_validator, model_validator

from kvgate.api.contracts.epp_plugins import TOKEN_SCORERS  # the EPP plugins that key on prompt tokens
from kvgate.api.k8s.base import (
    DNS_LABEL_PATTERN,
    GROUP_PATTERN,
    KIND_PATTERN,
    Condition,
    K8sModel,
    PortNumber,
    conditions_field,
)
from kvgate.api.k8s.quantity import GIB, memory_bytes, parse_quantity

KVGATE_GROUP = "kvgate.dev"
KVGATE_VERSION = "v1alpha1"

MODEL_SOURCE_PATTERN = r"^(hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+(@[-A-Za-z0-9_./]+)?|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|/.+)$"
_PVC_RE = re.compile(r"^pvc://(?P<claim>[a-z0-9]([-a-z0-9]*[a-z0-9])?)(?P<path>/.*)?$")


# A model source, or a bare Hub id (`org/name[@revision]`) for a tokenizer.
TOKENIZER_SOURCE_PATTERN = (
    r"^((hf://)?[A-Za-z0-9][-A-Za-z0-9_.]*/[-A-Za-z0-9_.]+(@[-A-Za-z0-9_./]+)?"
    r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/.*)?|/.+)$"
)
PRECISE_PREFIX_SCORER = "precise-prefix-cache-scorer"


class SourceKind:
    """How a `source` string (MODEL_SOURCE_PATTERN) is read: shared by the model and its adapters."""

    source: str

    def kind(self) -> Literal["hf", "pvc", "path"]:
        if self.source.startswith("hf://"):
            return "hf"
        if self.source.startswith("pvc://"):
            return "pvc"
        return "path"

    def hf_repo(self) -> tuple[str, str | None]:
        """(org/name, revision) of an hf:// source."""
        repo, _, revision = self.source.removeprefix("hf://").partition("@")
        return repo, revision or None

    def pvc(self) -> tuple[str, str]:
        """(claim, path inside the claim) of a pvc:// source."""
        match = _PVC_RE.match(self.source)
        if match is None:
            raise ValueError(f"not a pvc:// source: {self.source}")
        return match.group("claim"), (match.group("path") or "/").lstrip("/")


class ModelSource(K8sModel, SourceKind):
    source: str = Field(
        pattern=MODEL_SOURCE_PATTERN,
        description=(
            "Where the weights come from: `hf://org/name[@revision]` (downloaded at start-up), "
            "`pvc://claim/path` (mounted read-only), or an absolute path inside the image "
            "(a model folder or a .gguf file)."
        ),
    )
    served_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        description="The model name clients send; defaults to the source's last path element.",
    )
    max_model_len: int | None = Field(default=None, ge=16, description="Context length limit for the engine.")
    hf_token_secret: str | None = Field(
        default=None,
        description="A Secret (key `token`) holding a Hugging Face token, for gated hf:// models.",
    )

    def effective_served_name(self) -> str:
        if self.served_name:
            return self.served_name
        if self.kind() == "hf":
            return self.hf_repo()[0]
        tail = self.source.rstrip("/").rsplit("/", 1)[-1]
        return tail.removesuffix(".gguf") or "model"


class EnvVar(K8sModel):
    name: str = Field(min_length=1)
    value: str | None = None
    value_from: dict[str, Any] | None = Field(
        default=None, description="A core/v1 EnvVarSource (secretKeyRef, configMapKeyRef, fieldRef ...)."
    )


class ResourceRequirements(K8sModel):
    requests: dict[str, int | str] | None = None
    limits: dict[str, int | str] | None = None


class EngineSpec(K8sModel):
    image: str | None = Field(default=None, description="Engine image; the operator's default when unset.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    args: list[str] = Field(default_factory=list, description="Extra `kvgate engine serve` arguments.")
    env: list[EnvVar] = Field(default_factory=list)
    resources: ResourceRequirements | None = None
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=16,
        description=(
            "GPUs per replica (nvidia.com/gpu). The engine has no tensor parallelism yet: the operator "
            "refuses values above 1 (InvalidSpec) rather than start pods that cannot use the GPUs."
        ),
    )
    accelerator: Literal["nvidia", "none"] = Field(
        default="nvidia",
        description="`nvidia` requests nvidia.com/gpu = tensorParallelSize; `none` runs on CPU.",
    )
    port: PortNumber = Field(default=8000, description="The engine's HTTP port (OpenAI API, /metrics).")
    kv_events_port: PortNumber = Field(default=5557, description="The engine's ZMQ KV-event publisher port.")
    kv_events_replay_port: int = Field(
        default=5558,
        ge=0,
        le=65535,
        description=(
            "The engine's ZMQ KV-event replay port: a picker that missed events (a restart, a slow "
            "subscriber) asks for them again instead of guessing. 0: no replay."
        ),
        json_schema_extra={"format": "int32"},
    )
    startup_timeout_seconds: int = Field(
        default=1800,
        ge=30,
        description="How long weight download and loading may take before the pod is restarted.",
    )
    drain_seconds: int = Field(
        default=30,
        ge=0,
        le=600,
        description="preStop wait so gateways take the pod out of rotation before it stops admitting.",
    )
    shutdown_timeout_seconds: int = Field(
        default=60, ge=0, le=3600, description="How long in-flight requests may finish after SIGTERM."
    )
    node_selector: dict[str, str] | None = None
    tolerations: list[dict[str, Any]] | None = None

    @field_validator("tensor_parallel_size")
    @classmethod
    def _no_tensor_parallelism_yet(cls, size: int) -> int:
        # Kept out of the CRD schema on purpose: the API server would refuse the object with no
        # trace on it, while the operator's InvalidSpec condition and event say why and what to do.
        if size > 1:
            raise ValueError(
                f"tensorParallelSize {size} is not supported: `kvgate engine serve` has no tensor "
                "parallelism yet; use 1 (one GPU per replica) and scale with replicas"
            )
        return size


class ScorerSpec(K8sModel):
    type: str = Field(min_length=1, description="An EPP scorer plugin type, e.g. prefix-cache-scorer.")
    weight: int = Field(default=1, ge=0, le=100)
    parameters: dict[str, Any] | None = None


def _default_scorers() -> list[ScorerSpec]:
    # GIE's default profile.
    return [
        ScorerSpec(type="queue-scorer", weight=2),
        ScorerSpec(type="kv-cache-utilization-scorer", weight=2),
        ScorerSpec(type="prefix-cache-scorer", weight=3),
    ]


# A Gateway API duration (GEP-2257): 1 to 4 numbers, each with a unit, e.g. 30s, 1m30s, 500ms.
DURATION_PATTERN = r"^([0-9]{1,5}(h|m|s|ms)){1,4}$"
_DURATION_PART = re.compile(r"([0-9]{1,5})(h|ms|m|s)")
_DURATION_UNIT_SECONDS = {"h": 3600, "m": 60, "s": 1, "ms": 0.001}
# A Secret's name (a DNS subdomain) and the name of one of its keys.
SECRET_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
# Where the endpoint picker's container sees spec.tenants' Secret (read-only).
TENANTS_DIR = "/etc/kvgate/tenants"


def duration_seconds(text: str) -> float:
    """A Gateway API duration (DURATION_PATTERN) in seconds. ValueError: not one."""
    if not re.fullmatch(DURATION_PATTERN, text):
        raise ValueError(f"{text!r} is not a duration (e.g. 30s, 1m30s, 500ms)")
    return sum(int(n) * _DURATION_UNIT_SECONDS[unit] for n, unit in _DURATION_PART.findall(text))


class FlowControlSpec(K8sModel):
    """The endpoint picker's flow control (`kvgate epp serve --flow-*`): requests held in the picker
    and dispatched by priority, then by fairness between tenants, when an engine has room. Every
    field left out keeps the picker's own default."""

    enabled: bool = Field(
        default=True,
        description=(
            "false: no flow control (`--no-flow-control`): every request is routed at once, as "
            "it arrives; the other fields are then not passed."
        ),
    )
    max_queued: int | None = Field(
        default=None,
        ge=1,
        description="Requests held at most, all flows together (`--flow-max-queued`); beyond, a 429/503.",
        json_schema_extra={"format": "int64"},
    )
    max_queued_per_flow: int | None = Field(
        default=None,
        ge=1,
        description=(
            "Requests held at most per flow, one tenant at one priority (`--flow-max-queued-per-flow`); "
            "beyond, a 429."
        ),
        json_schema_extra={"format": "int64"},
    )
    # Like resource quantities, an int-or-string the CRD does not check further: the operator's
    # InvalidSpec condition says what is wrong with it.
    max_queued_bytes: int | str | None = Field(
        default=None,
        description=(
            "Memory held requests may take, all flows together (bodies and prompt tokens): a byte count or a quantity, e.g. 512Mi "
            "(`--flow-max-queued-bytes`, in bytes)."
        ),
    )
    ttl: str | None = Field(
        default=None,
        description=(
            "How long a request may be held before it is answered 429 (sheddable) or 503: a duration "
            "above 0, e.g. 30s, 1m30s, 500ms (`--flow-ttl`, in seconds)."
        ),
        # The pattern is checked by _ttl_is_a_positive_duration, whose message says more than
        # pydantic's pattern error; the CRD carries it, with a CEL rule for a zero duration (and
        # a maxLength, which bounds the rule's estimated cost).
        json_schema_extra={
            "pattern": DURATION_PATTERN,
            "maxLength": 32,
            "x-kubernetes-validations": [
                {"rule": "self.matches('[1-9]')", "message": "ttl must be above 0, e.g. 30s"}
            ],
        },
    )
    dispatch: Literal["pool", "endpoint"] | None = Field(
        default=None,
        description=(
            "When a held request goes (`--flow-dispatch`): pool (the picker's default, GIE's) while the "
            "pool is not saturated, picked among every engine; endpoint while some engine has room for "
            "it (the dispatch* fields), picked among those: tighter isolation between tenants, looser "
            "prefix affinity."
        ),
    )
    dispatch_queue_depth: int | None = Field(
        default=None,
        ge=1,
        description=(
            "endpoint dispatch: an engine has room while fewer requests than this wait in its own "
            "queue (`--flow-dispatch-queue-depth`)."
        ),
        json_schema_extra={"format": "int64"},
    )
    max_unconfirmed_picks: int | None = Field(
        default=None,
        ge=1,
        description=(
            "endpoint dispatch: ... and this picker has sent it fewer requests than this that its "
            "metrics do not show yet (`--flow-max-unconfirmed-picks`)."
        ),
        json_schema_extra={"format": "int64"},
    )
    short_reserve: int | None = Field(
        default=None,
        ge=0,
        description=(
            "endpoint dispatch: engines kept free of long prompts while short ones keep arriving "
            "(`--flow-short-reserve`; 0: off)."
        ),
        json_schema_extra={"format": "int64"},
    )
    short_prompt_tokens: int | None = Field(
        default=None,
        ge=1,
        description="Prompts of at most this many tokens are short: with dispatch endpoint they go where no "
        "prompt work is ahead when they can, and shortReserve keeps engines for them (`--flow-short-prompt-tokens`).",
        json_schema_extra={"format": "int64"},
    )
    dispatch_prefill_tokens: int | None = Field(
        default=None,
        ge=0,
        description=(
            "... and, where the engine reports it, while less prompt work than this many tokens is "
            "ahead of a new request there (`--flow-dispatch-prefill-tokens`; 0: not checked)."
        ),
        json_schema_extra={"format": "int64"},
    )

    @field_validator("max_queued_bytes")
    @classmethod
    def _bytes_is_a_positive_size(cls, value: int | str | None) -> int | str | None:
        if value is None:
            return None
        try:
            exact = parse_quantity(value)
        except ValueError:
            raise ValueError(
                f"{value!r} is not a byte count or a Kubernetes quantity (e.g. 536870912, 512Mi, 1G)"
            ) from None
        if exact < 1:
            raise ValueError(f"{value!r}: must be above 0 bytes")
        if exact != int(exact):
            raise ValueError(f"{value!r} is not a whole number of bytes (e.g. 536870912, 512Mi, 1G)")
        return value

    @field_validator("ttl")
    @classmethod
    def _ttl_is_a_positive_duration(cls, value: str | None) -> str | None:
        # The CRD's pattern and CEL rule say the same; this says why where the API server did not check.
        if value is not None and duration_seconds(value) <= 0:
            raise ValueError(f"{value!r}: ttl must be above 0 (how long a request may be held), e.g. 30s")
        return value

    fair_share_half_life: str | None = Field(
        default=None,
        description=(
            "pool dispatch: while the pool is saturated, a flow that sent less than its weighted share "
            "of the recent work of its priority and below still goes (the engines run it first), the "
            "work halved every this long (`--flow-fair-share-half-life`; default 10s; 0s: saturation "
            "holds every flow, for engines that serve in arrival order)."
        ),
        json_schema_extra={"pattern": DURATION_PATTERN, "maxLength": 32},
    )
    fair_share_max_queue: float | None = Field(
        default=None,
        ge=0,
        description=(
            "pool dispatch: ... while the engines' queues hold fewer requests than this on average "
            "(`--flow-fair-share-max-queue`; default 20); past it every flow is held."
        ),
    )

    def fair_share_half_life_seconds(self) -> float | None:
        return None if self.fair_share_half_life is None else duration_seconds(self.fair_share_half_life)

    def max_queued_byte_count(self) -> int | None:
        return None if self.max_queued_bytes is None else memory_bytes(self.max_queued_bytes)

    def ttl_seconds(self) -> float | None:
        return None if self.ttl is None else duration_seconds(self.ttl)


class TenantsSpec(K8sModel):
    """A Secret holding the endpoint picker's tenants file."""

    secret_name: str = Field(
        min_length=1,
        max_length=253,
        pattern=SECRET_NAME_PATTERN,
        description=(
            "A Secret in the ModelDeployment's namespace; the operator mounts it read-only into the "
            f"endpoint picker pods at {TENANTS_DIR}. With tenants the engines require a key of their own "
            "that only the picker sends (engine.env KVGATE_API_KEY, else a random one the operator keeps "
            "in the Secret <name>-engine-key): a pod that reaches an engine directly skips no tenant's key."
        ),
    )
    key: str = Field(
        default="tenants.yaml",
        min_length=1,
        max_length=253,
        pattern=SECRET_KEY_PATTERN,
        description=(
            "The Secret's key holding the tenants file: a YAML list of {name, key, weight, priority} "
            f"(`kvgate epp serve --tenants {TENANTS_DIR}/<key>`)."
        ),
    )

    @field_validator("key")
    @classmethod
    def _key_is_a_file_name(cls, key: str) -> str:
        # Kubernetes refuses these as Secret keys too: the key is a file name in the mount.
        if key in (".", "..") or key.startswith(".."):
            raise ValueError(f"{key!r} is not a Secret key (it must not be '.', '..' or start with '..')")
        return key

    def path(self) -> str:
        """The tenants file as the picker's container sees it."""
        return f"{TENANTS_DIR}/{self.key}"


class RoutingSpec(K8sModel):
    epp_image: str | None = Field(
        default=None, description="Endpoint picker image; the operator's default when unset."
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose", description="What the gateway does when the endpoint picker does not answer."
    )
    scorers: list[ScorerSpec] = Field(
        default_factory=_default_scorers,
        min_length=1,
        description="Scorers of the default scheduling profile and their weights (GIE's default when unset).",
    )
    picker: str = Field(default="max-score-picker", min_length=1)
    config: str | None = Field(
        default=None,
        description="A complete EndpointPickerConfig YAML; replaces the one built from scorers and picker.",
    )
    tokenizer: str | None = Field(
        default=None,
        pattern=TOKENIZER_SOURCE_PATTERN,
        description=(
            "Tokenizer the endpoint picker uses for prefix keys: `hf://org/name[@revision]` or "
            "`org/name[@revision]` (only its tokenizer files are fetched), `pvc://claim/path` (mounted "
            "read-only), or an absolute path inside the picker's image. The model's source by default."
        ),
    )
    secure_serving: bool = Field(default=True, description="Serve ext_proc over TLS (self-signed).")
    epp_replicas: int = Field(
        default=2,
        ge=1,
        le=16,
        description=(
            "Endpoint picker replicas, all serving at once (each rebuilds the same prefix index from "
            "the engines' KV events). Two by default, so a rollout or a node loss never stops routing."
        ),
    )
    flow_control: FlowControlSpec | None = Field(
        default=None,
        description=(
            "The endpoint picker's flow control: queue bounds, the held-request TTL and when an engine "
            "has room. Unset: the picker's defaults (flow control on)."
        ),
    )

    def needs_tokenizer(self) -> bool:
        """Whether the picker tokenizes prompts (the precise scorers key blocks by tokens)."""
        if self.config is not None:
            return any(name in self.config for name in TOKEN_SCORERS)
        return any(s.type in TOKEN_SCORERS for s in self.scorers)

    @field_validator("config")
    @classmethod
    def _config_is_an_endpoint_picker_config(cls, text: str | None) -> str | None:
        if text is None:
            return None
        try:
            doc = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ValueError(f"not YAML: {exc}") from None
        if not isinstance(doc, dict) or doc.get("kind") != "EndpointPickerConfig":
            raise ValueError("must be a YAML EndpointPickerConfig (kind: EndpointPickerConfig)")
        if not doc.get("schedulingProfiles"):
            raise ValueError("an EndpointPickerConfig needs at least one schedulingProfile")
        return text


class AutoscalingSpec(K8sModel):
    backend: Literal["keda", "hpa", "off"] = Field(
        default="off",
        description="keda: a KEDA ScaledObject (falls back to an HPA when KEDA is absent); hpa: an autoscaling/v2 HPA.",
    )
    min_replicas: int = Field(default=1, ge=0, le=1000)
    max_replicas: int = Field(default=4, ge=1, le=1000)
    metric: Literal["queue-size", "kv-cache-utilization", "saturation"] = Field(
        default="queue-size",
        description="The pool signal from the endpoint picker that drives scaling.",
    )
    target: str = Field(
        default="5",
        pattern=r"^[0-9]+(\.[0-9]+)?$",
        description="Target value of the metric (per pool average): e.g. 5 waiting requests, 0.8 KV use, 1 saturation.",
    )
    prometheus_address: str | None = Field(
        default=None, description="Prometheus the ScaledObject queries; the operator's default when unset."
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description="How long the HPA waits on a lower recommendation before scaling down (its behavior.scaleDown.stabilizationWindowSeconds).",
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.minReplicas <= self.maxReplicas",
                    "message": "minReplicas must not exceed maxReplicas",
                }
            ]
        }
    )

    @model_validator(mode="after")
    def _min_le_max(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError("minReplicas must not exceed maxReplicas")
        return self


class RouteParentRef(K8sModel):
    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = Field(default=None, min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)
    section_name: str | None = Field(default=None, min_length=1, max_length=253)
    group: str = Field(default="gateway.networking.k8s.io", max_length=253, pattern=GROUP_PATTERN)
    kind: str = Field(default="Gateway", min_length=1, max_length=63, pattern=KIND_PATTERN)


class HTTPRouteSpec(K8sModel):
    parent_refs: list[RouteParentRef] = Field(min_length=1, max_length=32)
    hostnames: list[str] | None = Field(default=None, max_length=16)
    path_prefix: str = Field(default="/", pattern=r"^/")
    request_timeout: str | None = Field(
        default="300s", pattern=DURATION_PATTERN, description="Gateway API duration."
    )
    match_model_name: bool = Field(
        default=False,
        description=(
            "Match only requests whose X-Gateway-Model-Name header names this model or one of its "
            "adapters (GIE's body-based routing: a model router in front of the gateway sets the "
            "header from the body's model), so several ModelDeployments share one Gateway and path."
        ),
    )


class LabelSelectorRequirement(K8sModel):
    key: str = Field(min_length=1, max_length=317)
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] | None = None


class KubeLabelSelector(K8sModel):
    """A core Kubernetes LabelSelector (`{}` selects everything)."""

    match_labels: dict[str, str] | None = None
    match_expressions: list[LabelSelectorRequirement] | None = None


class NetworkPeer(K8sModel):
    """Pods allowed in: a NetworkPolicy peer. A namespaceSelector alone admits every pod of
    those namespaces; a podSelector alone, only pods of the ModelDeployment's namespace."""

    namespace_selector: KubeLabelSelector | None = None
    pod_selector: KubeLabelSelector | None = None

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.namespaceSelector) || has(self.podSelector)",
                    "message": "a peer needs a namespaceSelector, a podSelector or both",
                }
            ]
        }
    )

    @model_validator(mode="after")
    def _selects_something(self) -> NetworkPeer:
        if self.namespace_selector is None and self.pod_selector is None:
            raise ValueError("a peer needs a namespaceSelector, a podSelector or both")
        return self


# The chart's own Envoy gateway pods (charts/kvgate/templates/envoy-gateway.yaml), in any namespace.
DEFAULT_GATEWAY_LABELS = {"app.kubernetes.io/name": "kvgate-envoy", "app.kubernetes.io/component": "gateway"}
# Prometheus as kube-prometheus-stack / prometheus-operator runs it, in namespace `monitoring`.
DEFAULT_PROMETHEUS_NAMESPACE = "monitoring"
DEFAULT_PROMETHEUS_LABELS = {"app.kubernetes.io/name": "prometheus"}


def _default_gateway_peers() -> list[NetworkPeer]:
    return [
        NetworkPeer(
            namespace_selector=KubeLabelSelector(match_labels={}),
            pod_selector=KubeLabelSelector(match_labels=dict(DEFAULT_GATEWAY_LABELS)),
        )
    ]


def _default_metrics_peers() -> list[NetworkPeer]:
    return [
        NetworkPeer(
            namespace_selector=KubeLabelSelector(
                match_labels={"kubernetes.io/metadata.name": DEFAULT_PROMETHEUS_NAMESPACE}
            ),
            pod_selector=KubeLabelSelector(match_labels=dict(DEFAULT_PROMETHEUS_LABELS)),
        )
    ]


class NetworkPolicySpec(K8sModel):
    enabled: bool = Field(
        default=True,
        description=(
            "Ingress NetworkPolicies for the endpoint picker and the engines (egress stays open). "
            "Needs a CNI that enforces NetworkPolicy; false creates none and removes ours."
        ),
    )
    gateway_from: list[NetworkPeer] = Field(
        default_factory=_default_gateway_peers,
        min_length=1,
        max_length=16,
        description=(
            "The gateway's pods: they alone reach the picker's ext_proc and health ports and, with "
            "the picker, the engines' serving port. Default: the kvgate chart's Envoy in any namespace; "
            "with another Gateway API implementation, select its data-plane pods here."
        ),
    )
    metrics_from: list[NetworkPeer] = Field(
        default_factory=_default_metrics_peers,
        max_length=16,
        description=(
            "Scrapers allowed to the picker's metrics port and the engines' serving port (/metrics "
            "shares it). Default: pods labelled app.kubernetes.io/name=prometheus in namespace monitoring."
        ),
    )


# An adapter's name is a model name clients send (OpenAI `model`).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9]([-A-Za-z0-9_.:/]*[A-Za-z0-9])?$"
# Where the engine pods see adapters: hf:// ones are fetched into an emptyDir by a sidecar,
# pvc:// ones on spec.lora.claims are mounted read-only under ADAPTER_CLAIMS_DIR.
ADAPTER_DIR = "/adapters"
ADAPTER_HF_DIR = f"{ADAPTER_DIR}/hf"
ADAPTER_CLAIMS_DIR = f"{ADAPTER_DIR}/pvc"


class AdapterSpec(K8sModel, SourceKind):
    name: str = Field(
        min_length=1,
        max_length=253,
        pattern=ADAPTER_NAME_PATTERN,
        description="The model name clients send to run this adapter; unique, not the base model's name.",
    )
    source: str = Field(
        pattern=MODEL_SOURCE_PATTERN,
        description=(
            "A PEFT adapter folder: `hf://org/name[@revision]` (fetched into each engine pod by its "
            "adapter sidecar), `pvc://claim/path` (the model's claim or one in spec.lora.claims, "
            "mounted read-only), or an absolute path inside the engine image."
        ),
    )
    rank: int | None = Field(
        default=None,
        ge=1,
        description="The adapter's rank, if known: checked against spec.lora.maxLoraRank before any load.",
    )


class LoRASpec(K8sModel):
    max_loras: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Distinct adapters the engine runs in one step (`--max-loras`, device slots).",
    )
    max_lora_rank: int = Field(
        default=16, ge=1, le=512, description="Largest adapter rank an engine accepts (`--max-lora-rank`)."
    )
    max_cpu_loras: int | None = Field(
        default=None,
        ge=1,
        description="Parsed adapters kept in CPU memory (`--max-cpu-loras`); maxLoras when unset.",
    )
    unload_grace_seconds: int | None = Field(
        default=None,
        ge=0,
        le=3600,
        description=(
            "After an unload (an adapter removed from spec.adapters) each engine still serves it "
            "this long, unlisted, so requests routed before the pickers noticed succeed; 0 refuses "
            "them at once (`--lora-unload-grace`; the engine's default, 2 s, when unset)."
        ),
    )
    load_timeout_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description=(
            "An engine pod turns Ready (readiness gate kvgate.dev/lora-adapters) once the operator "
            "has loaded every adapter into it, or this long after its engine came up, whichever is "
            "first: a new pod gets no traffic before its adapters, and a broken adapter cannot keep "
            "pods out of service forever."
        ),
    )
    claims: list[Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_LABEL_PATTERN)]] = Field(
        default_factory=list,
        max_length=8,
        description=(
            "PersistentVolumeClaims mounted read-only in the engine pods for pvc:// adapters (the "
            "model's own claim is always reachable). Changing this list restarts the engines; "
            "adding or removing adapters does not."
        ),
    )


# Prefill/decode disaggregation: `kvgate up --pd-threshold`'s default, in uncached prompt tokens.
DEFAULT_PD_THRESHOLD = 512


class DisaggregationRoleSpec(K8sModel):
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description=(
            "Engines of this role. Autoscaling off: the count (default 1, at least 1). Autoscaling on: "
            "unset leaves the count to this role's autoscaler (started at its minReplicas)."
        ),
    )
    min_replicas: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="This role's autoscaler floor; spec.autoscaling's when unset.",
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        le=1000,
        description="This role's autoscaler ceiling; spec.autoscaling's when unset.",
    )
    resources: ResourceRequirements | None = Field(
        default=None, description="This role's engine resources; spec.engine.resources when unset."
    )
    args: list[str] = Field(
        default_factory=list,
        description="`kvgate engine serve` arguments after spec.engine.args, for this role's engines only.",
    )


class DisaggregationSpec(K8sModel):
    prefill: DisaggregationRoleSpec = Field(
        default_factory=DisaggregationRoleSpec,
        description="Prefill engines (`--kv-role producer`, pod label kvgate.dev/role=prefill): never a destination.",
    )
    decode: DisaggregationRoleSpec = Field(
        default_factory=DisaggregationRoleSpec,
        description=(
            "Decode engines (`--kv-role consumer`, kvgate.dev/role=decode): every request's destination; "
            "they pull a long prompt's KV from the prefill engine the picker names."
        ),
    )
    threshold: int = Field(
        default=DEFAULT_PD_THRESHOLD,
        ge=0,
        description=(
            "The picker's --pd-threshold: a prompt with more uncached tokens than this at the chosen decode "
            "engine is prefilled on a prefill engine; shorter ones are served by the decode engine alone."
        ),
    )


# spec.kvOffload.size: a positive memory size with a unit, binary (Ki ... Ei) or decimal (k ... E).
# A bare number is a byte count to Kubernetes but GiB to `--kv-offloading-size`: refused, as is
# zero (no tier is an absent kvOffload) and a milli-byte size. No backslashes: the pattern sits
# in a CEL string literal too.
KV_OFFLOAD_SIZE_PATTERN = (
    "^([0-9]*[1-9][0-9]*([.][0-9]*)?|[0-9]*[.][0-9]*[1-9][0-9]*)(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E)$"
)
_KV_OFFLOAD_SIZE_RE = re.compile(KV_OFFLOAD_SIZE_PATTERN)
KV_OFFLOAD_SIZE_MESSAGE = "size must be a memory size above 0 with a unit, e.g. 16Gi, 512Mi or 20G"


class KVOffloadSpec(K8sModel):
    size: str = Field(
        min_length=1,
        max_length=32,
        description=(
            "Host memory for the tier, a Kubernetes quantity with a unit (e.g. 16Gi; the engine's "
            "`--kv-offloading-size` in GiB). The operator adds it to the engine container's memory "
            "request and limit (spec.engine.resources or the role's): where a request is set, "
            "request + size; where only a limit is set, no request (Kubernetes defaults it to the "
            "new limit); where neither is, a request of size alone and no limit (the engine's own "
            "memory is not known here, so a limit of the tier alone could OOM-kill it)."
        ),
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": f"self.matches('{KV_OFFLOAD_SIZE_PATTERN}')", "message": KV_OFFLOAD_SIZE_MESSAGE}
            ]
        },
    )
    backend: Literal["native"] = Field(
        default="native",
        description="How blocks reach the tier (`--kv-offloading-backend`): native, the engine's own copies.",
    )
    offload_on: Literal["evict", "compute"] = Field(
        default="evict",
        description=(
            "When a block is copied to the tier (`--kv-offload-on`): evict, when the device pool evicts "
            "it (the tiers hold different blocks); compute, as soon as a step computes it (vLLM's "
            "native offloading)."
        ),
    )

    @field_validator("size")
    @classmethod
    def _size_is_a_positive_memory_size(cls, size: str) -> str:
        # The CRD's CEL rule says the same; this says why when the API server did not check it.
        if _KV_OFFLOAD_SIZE_RE.match(size):
            return size
        try:
            value = parse_quantity(size)
        except ValueError:
            raise ValueError(f"{size!r} is not a Kubernetes quantity: {KV_OFFLOAD_SIZE_MESSAGE}") from None
        if value <= 0:
            raise ValueError(f"{size!r}: {KV_OFFLOAD_SIZE_MESSAGE} (leave kvOffload out for no tier)")
        raise ValueError(
            f"{size!r} has no byte unit (Kubernetes reads a bare number or an exponent as bytes and m "
            f"as thousandths of one; the engine's flag is in GiB): {KV_OFFLOAD_SIZE_MESSAGE}"
        )

    def size_bytes(self) -> int:
        return memory_bytes(self.size)

    def size_gib(self) -> float:
        return self.size_bytes() / GIB


TENANTS_FAIL_OPEN_MESSAGE = (
    "spec.tenants with spec.routing.failureMode FailOpen: a request the endpoint picker does not "
    "answer would reach the engines without its key checked; use FailClose (the default)"
)


class ModelDeploymentSpec(K8sModel):
    # The API server refuses it (`kvgate up --tenants --failure-mode FailOpen` does too).
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.tenants) || !has(self.routing) || !has(self.routing.failureMode)"
                    " || self.routing.failureMode != 'FailOpen'",
                    "message": TENANTS_FAIL_OPEN_MESSAGE,
                }
            ]
        }
    )

    model: ModelSource
    engine: EngineSpec = Field(default_factory=EngineSpec)
    replicas: int | None = Field(
        default=None,
        ge=0,
        le=1000,
        description="Engine replicas; unset with autoscaling on leaves the count to the autoscaler.",
    )
    routing: RoutingSpec = Field(default_factory=RoutingSpec)
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec)
    http_route: HTTPRouteSpec | None = Field(
        default=None, description="Attach the pool to these Gateways with an HTTPRoute."
    )
    network_policy: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)
    lora: LoRASpec | None = Field(
        default=None,
        description=(
            "Engine LoRA settings; LoRA is on when this is set or adapters is not empty. Set it (even "
            "`{}`) before the first adapter, so adding that adapter does not restart the engines."
        ),
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=64,
        description=(
            "LoRA adapters served as models next to the base model. Loaded into every ready engine at "
            "run time (POST /v1/load_lora_adapter) by the operator: adding or removing one never "
            "restarts engines. status.adapters says which pods have each one loaded."
        ),
    )

    disaggregation: DisaggregationSpec | None = Field(
        default=None,
        description=(
            "Prefill/decode disaggregation: two engine Deployments, <name>-prefill and <name>-decode, in "
            "one InferencePool; replaces replicas (each role has its own count and autoscaler)."
        ),
    )
    kv_offload: KVOffloadSpec | None = Field(
        default=None,
        description=(
            "A second KV tier in each engine's host memory, under the prefix cache (vLLM's native CPU "
            "offloading): blocks leaving the device pool are kept there and loaded back on a hit "
            "instead of computed again. Unset: no tier. Changing it restarts the engines."
        ),
    )
    tenants: TenantsSpec | None = Field(
        default=None,
        description=(
            "Tenants of the pool: a Secret holding the endpoint picker's tenants file. Clients then "
            "present a tenant's key (Authorization: Bearer <key>) and the tenant becomes the request's "
            "fairness id. The Secret must exist in this namespace (a Degraded condition says so when "
            "it does not). Unset: no keys are asked for."
        ),
    )

    def lora_enabled(self) -> bool:
        return self.lora is not None or bool(self.adapters)

    def lora_settings(self) -> LoRASpec:
        return self.lora or LoRASpec()

    @model_validator(mode="after")
    def _tenants_fail_closed(self) -> ModelDeploymentSpec:
        # The CRD's CEL rule says the same; this says it where the API server did not check.
        if self.tenants is not None and self.routing.failure_mode == "FailOpen":
            raise ValueError(TENANTS_FAIL_OPEN_MESSAGE)
        return self

    @model_validator(mode="after")
    def _tenants_engine_key_is_the_pickers(self) -> ModelDeploymentSpec:
        # With tenants the picker puts the engines' key on every request it forwards: a key given
        # only as an engine argument is one it cannot know, and every request would get a 401.
        if self.tenants is None:
            return self
        engines = [("engine.args", self.engine.args)]
        if self.disaggregation is not None:
            engines += [
                ("disaggregation.prefill.args", self.disaggregation.prefill.args),
                ("disaggregation.decode.args", self.disaggregation.decode.args),
            ]
        for where, args in engines:
            if any(a == "--api-key" or a.startswith("--api-key=") for a in args):
                raise ValueError(
                    f"{where}: --api-key with spec.tenants: the endpoint picker sends the engines' key in "
                    "place of the tenant's, so give it as engine.env KVGATE_API_KEY (a secretKeyRef) or "
                    "leave it out (the operator then makes one, Secret <name>-engine-key)"
                )
        return self

    @model_validator(mode="after")
    def _adapters_are_servable(self) -> ModelDeploymentSpec:
        # Kept out of the CRD schema like the checks below: a condition says which adapter and why.
        errors: list[str] = []
        seen: set[str] = set()
        base = self.model.effective_served_name()
        lora = self.lora_settings()
        model_claim = self.model.pvc()[0] if self.model.kind() == "pvc" else None
        for i, adapter in enumerate(self.adapters):
            where = f"adapters[{i}]"
            if adapter.name in seen:
                errors.append(f"{where}.name: {adapter.name!r} is used by another adapter")
            seen.add(adapter.name)
            if adapter.name == base:
                errors.append(f"{where}.name: {adapter.name!r} is the base model's served name")
            if adapter.rank is not None and adapter.rank > lora.max_lora_rank:
                errors.append(
                    f"{where}.rank: {adapter.rank} is above lora.maxLoraRank {lora.max_lora_rank} "
                    "(the engine would refuse it)"
                )
            if adapter.kind() == "pvc":
                claim, _ = adapter.pvc()
                if claim != model_claim and claim not in lora.claims:
                    errors.append(
                        f"{where}.source: claim {claim!r} is not mounted in the engine pods: add it to "
                        "lora.claims (that restarts the engines once) or use the model's claim"
                    )
            elif adapter.kind() == "path" and adapter.source.endswith(".gguf"):
                errors.append(f"{where}.source: a PEFT adapter is a folder, not a .gguf file")
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @model_validator(mode="after")
    def _picker_can_read_the_tokenizer(self) -> ModelDeploymentSpec:
        # Kept out of the CRD schema for the same reason as tensorParallelSize: a condition on the
        # object says why, where an API-server refusal would leave no trace.
        if self.model.kind() == "path" and self.routing.tokenizer is None and self.routing.needs_tokenizer():
            raise ValueError(
                "routing.tokenizer: required when model.source is a path inside the engine image and "
                f"routing uses {' or '.join(TOKEN_SCORERS)} (the endpoint picker cannot read the engine's "
                "image): name the tokenizer as a Hub id (org/name[@revision]) or a pvc:// source"
            )
        return self

    @model_validator(mode="after")
    def _tier_memory_adds_up(self) -> ModelDeploymentSpec:
        # The operator adds kvOffload.size to the engines' memory request and limit: they must be
        # quantities it can add to (a condition says which one, where a sum would fail later).
        if self.kv_offload is None:
            return self
        where = [("engine.resources", self.engine.resources)]
        if self.disaggregation is not None:
            where += [
                ("disaggregation.prefill.resources", self.disaggregation.prefill.resources),
                ("disaggregation.decode.resources", self.disaggregation.decode.resources),
            ]
        errors: list[str] = []
        for path, resources in where:
            for kind in ("requests", "limits"):
                value = (getattr(resources, kind) or {}).get("memory") if resources else None
                if value is None:
                    continue
                try:
                    parse_quantity(value)
                except ValueError:
                    errors.append(
                        f"{path}.{kind}.memory: {value!r} is not a Kubernetes quantity (the operator adds "
                        "kvOffload.size to it)"
                    )
        if errors:
            raise ValueError("; ".join(errors))
        return self

    @model_validator(mode="after")
    def _disaggregation_is_servable(self) -> ModelDeploymentSpec:
        # Kept out of the CRD schema like the checks above: a condition says what to change.
        pd = self.disaggregation
        if pd is None:
            return self
        errors: list[str] = []
        if self.replicas is not None:
            errors.append(
                "replicas: not used with disaggregation (set disaggregation.prefill.replicas and "
                "disaggregation.decode.replicas)"
            )
        scaling = self.autoscaling
        for role, rs in (("prefill", pd.prefill), ("decode", pd.decode)):
            where = f"disaggregation.{role}"
            if scaling.backend == "off" and rs.replicas is not None and rs.replicas < 1:
                errors.append(
                    f"{where}.replicas: must be at least 1 with autoscaling off (got {rs.replicas})"
                )
            low = scaling.min_replicas if rs.min_replicas is None else rs.min_replicas
            high = scaling.max_replicas if rs.max_replicas is None else rs.max_replicas
            if low > high:
                errors.append(f"{where}: minReplicas {low} exceeds maxReplicas {high}")
            if scaling.backend != "off" and low < 1:
                errors.append(
                    f"{where}: minReplicas must be at least 1 (this role's autoscaler reads its own engines' "
                    "queue, which has no samples at zero engines, so it could never scale back up)"
                )
        if scaling.backend != "off" and scaling.metric != "queue-size":
            errors.append(
                f"autoscaling.metric: {scaling.metric} is pool-wide; with disaggregation each role scales on "
                "its own engines' queue, so use queue-size"
            )
        if self.lora_enabled():
            errors.append("lora/adapters: not supported with disaggregation yet")
        if self.model.kind() == "path" and self.routing.tokenizer is None:
            errors.append(
                "routing.tokenizer: required with disaggregation when model.source is a path inside the "
                "engine image (the picker counts a prompt's uncached tokens, so it needs the tokenizer)"
            )
        if errors:
            raise ValueError("; ".join(errors))
        return self


class AutoscalerStatus(K8sModel):
    kind: str | None = Field(default=None, description="ScaledObject, HorizontalPodAutoscaler or none.")
    query: str | None = None
    has_data: bool | None = None


class PoolSignals(K8sModel):
    queue_size: str | None = Field(default=None, description="Average waiting requests per endpoint (EPP).")
    kv_cache_utilization: str | None = None
    saturation: str | None = None
    observed_at: str | None = None


class AdapterStatus(K8sModel):
    name: str
    source: str | None = None
    state: Literal["Loaded", "Loading", "Failed", "Unloading"] = Field(
        description=(
            "Loaded: on every ready engine; Loading: not yet on all of them; Failed: an engine refused "
            "it (message); Unloading: removed from the spec, still on some engine."
        )
    )
    pods: list[str] = Field(default_factory=list, description="Ready engine pods with it loaded.")
    message: str | None = Field(default=None, max_length=4096)


class ModelDeploymentStatus(K8sModel):
    observed_generation: int | None = None
    replicas: int | None = None
    ready_replicas: int | None = None
    endpoints: int | None = Field(default=None, description="Ready engine endpoints in the pool.")
    pool: str | None = None
    selector: str | None = Field(
        default=None, description="Label selector of the engine pods (scale subresource)."
    )
    gateway_accepted: str | None = Field(
        default=None, description="The pool's Accepted condition from its gateway(s): True, False or Unknown."
    )
    autoscaler: AutoscalerStatus | None = None
    signals: PoolSignals | None = None
    adapters: list[AdapterStatus] | None = Field(
        default=None,
        max_length=128,
        description="Each adapter and the ready engine pods that have it loaded (read from their /v1/models).",
    )
    conditions: list[Condition] | None = conditions_field(
        "Ready, Progressing, Degraded, Autoscaling, Routed, GatewayAccepted, Metrics, Adapters, Disaggregation (never with Adapters)."
    )


class ModelDeployment(K8sModel):
    """One served model: engine replicas, their InferencePool, an endpoint picker and an autoscaler."""

    model_config = ConfigDict(
        extra="ignore",
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    # The endpoint picker's Service is `<name>-epp`, a 63-character DNS label.
                    "rule": "size(self.metadata.name) <= 59",
                    "message": "metadata.name must be at most 59 characters (the EPP Service adds '-epp')",
                }
            ]
        },
    )
    spec: ModelDeploymentSpec
    status: ModelDeploymentStatus | None = None
