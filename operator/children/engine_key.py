"""The engines' own API key when a ModelDeployment has tenants (spec.tenants).

Tenants' keys are checked by the endpoint picker, which then sends the engines' key in their
place (kvgate.epp.extproc). The engines require that key (`kvgate engine serve` reads
KVGATE_API_KEY), so a pod that reaches an engine's port directly, past the gateway, is refused
whatever NetworkPolicy allows. The user may bring the key (engine.env KVGATE_API_KEY); else the
operator keeps a random one in the Secret `<name>-engine-key`, made once and never rewritten
(operator/reconcile.py), and both the engine and the picker pods read it from there.
"""

from __future__ import annotations

from kvgate.api.k8s.crds import EnvVar, ModelDeploymentSpec
from kvgate.operator.children.common import API_KEY_ENV

ENGINE_KEY_SECRET_KEY = "api-key"


def engine_key_secret_name(name: str) -> str:
    return f"{name}-engine-key"


def engine_key_wanted(spec: ModelDeploymentSpec) -> bool:
    """Whether the operator keeps the engines' key: with tenants, unless the spec brings one."""
    return spec.tenants is not None and not any(e.name == API_KEY_ENV for e in spec.engine.env)


def with_engine_key(name: str, spec: ModelDeploymentSpec) -> ModelDeploymentSpec:
    """The spec as the operator runs it: the kept key in the engines' env, where the engine and
    picker builders and the adapter sync all read it."""
    if not engine_key_wanted(spec):
        return spec
    ref = {"secretKeyRef": {"name": engine_key_secret_name(name), "key": ENGINE_KEY_SECRET_KEY}}
    engine = spec.engine.model_copy(
        update={"env": [*spec.engine.env, EnvVar(name=API_KEY_ENV, value_from=ref)]}
    )
    return spec.model_copy(update={"engine": engine})
