"""Pure builders: a ModelDeployment (or a hand-made InferencePool) in, child manifests out.

Nothing here talks to an API server, so every object the operator writes can be built and
validated in a test. Names: the engine Deployment, InferencePool, PDB, autoscaler and
HTTPRoute share the ModelDeployment's name; the endpoint picker's objects add `-epp`.

One module per child: `engine` (Deployment, PDB), `pool` (InferencePool), `epp` (the
endpoint picker's seven objects), `network` (NetworkPolicies), `autoscaling` (ScaledObject or
HPA, and who owns the replica count), `route` (HTTPRoute), `adapters` (LoRA flags, volumes,
the hf:// adapter sidecar and its ConfigMap `<name>-adapters`); `common` holds what they share and
`model_deployment` puts the whole set together. Everything is re-exported here, so callers
write `from kvgate.operator import children as ch` and `ch.engine_deployment(...)`.
"""

from kvgate.operator.children.adapters import (
    ADAPTERS_GATE,
    adapter_fetcher,
    adapter_path,
    adapters_config_map,
    adapters_config_map_name,
    hf_adapter_list,
    lora_args,
    readiness_gates,
)
from kvgate.operator.children.autoscaling import (
    autoscaler_kind,
    autoscaler_query,
    desired_replicas,
    external_metric_name,
    horizontal_pod_autoscaler,
    pool_gauge,
    scaled_object,
)
from kvgate.operator.children.common import (
    ANNOTATION_EPP,
    ANNOTATION_TOKENIZER,
    API_KEY_ENV,
    EPP_CONFIG_KEY,
    EPP_GRPC_PORT,
    EPP_HEALTH_PORT,
    EPP_MANAGED,
    EPP_METRICS_PORT,
    LABEL_MD,
    LABEL_POOL,
    LABEL_ROLE,
    MANAGED_BY,
    MAX_MD_NAME,
    MODEL_DIR,
    Capabilities,
    Owner,
    command_line,
    container_security,
    engine_selector,
    epp_name,
    hf_token_env,
    model_deployment_owner,
    object_meta,
    pod_security,
    pool_owner,
    standard_labels,
)
from kvgate.operator.children.engine import engine_args, engine_deployment, engine_model_path, engine_pdb
from kvgate.operator.children.epp import (
    EPPTarget,
    TokenizerSource,
    epp_args,
    epp_config_yaml,
    epp_objects,
    epp_target_for_md,
    flow_control_args,
    tenants_volume,
    tokenizer_source,
)
from kvgate.operator.children.model_deployment import OPTIONAL_CHILDREN, model_deployment_children
from kvgate.operator.children.network import network_policies
from kvgate.operator.children.pool import inference_pool
from kvgate.operator.children.route import http_route

__all__ = [
    "ADAPTERS_GATE",
    "ANNOTATION_EPP",
    "ANNOTATION_TOKENIZER",
    "API_KEY_ENV",
    "EPP_CONFIG_KEY",
    "EPP_GRPC_PORT",
    "EPP_HEALTH_PORT",
    "EPP_MANAGED",
    "EPP_METRICS_PORT",
    "LABEL_MD",
    "LABEL_POOL",
    "LABEL_ROLE",
    "MANAGED_BY",
    "MAX_MD_NAME",
    "MODEL_DIR",
    "OPTIONAL_CHILDREN",
    "Capabilities",
    "EPPTarget",
    "Owner",
    "TokenizerSource",
    "adapter_fetcher",
    "adapter_path",
    "adapters_config_map",
    "adapters_config_map_name",
    "autoscaler_kind",
    "autoscaler_query",
    "command_line",
    "container_security",
    "desired_replicas",
    "engine_args",
    "engine_deployment",
    "engine_model_path",
    "engine_pdb",
    "engine_selector",
    "epp_args",
    "epp_config_yaml",
    "epp_name",
    "epp_objects",
    "epp_target_for_md",
    "external_metric_name",
    "flow_control_args",
    "hf_adapter_list",
    "hf_token_env",
    "horizontal_pod_autoscaler",
    "http_route",
    "inference_pool",
    "lora_args",
    "model_deployment_children",
    "model_deployment_owner",
    "network_policies",
    "object_meta",
    "pod_security",
    "pool_gauge",
    "pool_owner",
    "readiness_gates",
    "scaled_object",
    "standard_labels",
    "tenants_volume",
    "tokenizer_source",
]
