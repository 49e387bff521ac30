"""The operator's own settings: defaults it fills into children and how it runs."""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_ENGINE_IMAGE = "ghcr.io/kvgate/engine:0.1.0"
DEFAULT_EPP_IMAGE = "ghcr.io/kvgate/epp:0.1.0"
DEFAULT_PROMETHEUS_ADDRESS = "http://prometheus-operated.monitoring.svc:9090"


@dataclass(frozen=True)
class OperatorConfig:
    engine_image: str = DEFAULT_ENGINE_IMAGE
    epp_image: str = DEFAULT_EPP_IMAGE
    # Where KEDA's ScaledObjects query (in-cluster address) unless a ModelDeployment says otherwise.
    keda_prometheus_address: str = DEFAULT_PROMETHEUS_ADDRESS
    # Where the operator itself reads pool signals; None turns signal reading off.
    prometheus_url: str | None = None
    # How often every object is re-checked (drift repair, status refresh).
    resync_seconds: float = 30.0
    namespaces: tuple[str, ...] = ()
    all_namespaces: bool = False
    standalone: bool = True
    # Watch for namespaces and CRDs appearing at run time (needs list/watch on both).
    scanning: bool = True
    liveness_endpoint: str | None = None
    # Non-root uid/gid the images run as (docker/*.Dockerfile create this user).
    run_as_user: int = 65532
    extra_labels: dict[str, str] = field(default_factory=dict)
    # Serve external.metrics.k8s.io for the HPAs it writes on this port (0: off).
    metrics_api_port: int = 0
