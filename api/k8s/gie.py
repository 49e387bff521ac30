"""The Gateway API Inference Extension (GIE) kinds kvgate serves and reads, field for field, so
GIE's own examples and gateways work with them:

- `InferencePool` (`inference.networking.k8s.io/v1`): model server pods behind one endpoint picker;
- `InferenceObjective` (`inference.networking.x-k8s.io/v1alpha2`): one use case's priority in a pool.

Their CRD declarations (and kvgate's own `ModelDeployment`) are in `crds.py`.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, field_validator

from kvgate.api.k8s.base import (
    CONTROLLER_NAME_PATTERN,
    DNS_LABEL_PATTERN,
    GROUP_PATTERN,
    KIND_PATTERN,
    LABEL_VALUE_PATTERN,
    Condition,
    GIEModel,
    PortNumber,
    conditions_field,
)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
OBJECTIVE_GROUP = "inference.networking.x-k8s.io"
OBJECTIVE_VERSION = "v1alpha2"


class Port(GIEModel):
    number: PortNumber = Field(description="The port number on the selected model server pods.")


# ---------------------------------------------------------------------------------------------
# InferencePool (GIE v1)
# ---------------------------------------------------------------------------------------------


class LabelSelector(GIEModel):
    match_labels: dict[str, Annotated[str, Field(max_length=63, pattern=LABEL_VALUE_PATTERN)]] = Field(
        min_length=1,
        max_length=64,
        description="Labels a pod must carry (all of them) to be a member of the pool.",
    )


class EndpointPickerRef(GIEModel):
    group: str = Field(default="", max_length=253, pattern=GROUP_PATTERN)
    kind: str = Field(default="Service", min_length=1, max_length=63, pattern=KIND_PATTERN)
    name: str = Field(min_length=1, max_length=253, description="Name of the endpoint picker's Service.")
    port: Port | None = Field(
        default=None, description="The endpoint picker's ext_proc port (9002 by convention)."
    )
    failure_mode: Literal["FailOpen", "FailClose"] = Field(
        default="FailClose",
        description="What the gateway does when the endpoint picker does not answer.",
    )

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.kind != 'Service' || has(self.port)",
                    "message": "port is required when kind is 'Service' or unspecified (defaults to 'Service')",
                }
            ]
        }
    )


class InferencePoolSpec(GIEModel):
    selector: LabelSelector = Field(
        description="Selects the model server pods of this pool (same namespace)."
    )
    target_ports: list[Port] = Field(
        min_length=1,
        max_length=8,
        description="Ports of the model servers; each pod IP and port pair is one endpoint.",
        json_schema_extra={
            "x-kubernetes-list-type": "atomic",
            "x-kubernetes-validations": [
                {
                    "rule": "self.all(p1, self.exists_one(p2, p1.number==p2.number))",
                    "message": "port number must be unique",
                }
            ],
        },
    )
    app_protocol: Literal["http", "kubernetes.io/h2c"] = Field(
        default="http", description="Protocol of the target ports: HTTP/1.1 or HTTP/2 cleartext."
    )
    endpoint_picker_ref: EndpointPickerRef | None = Field(
        default=None, description="The endpoint picker (EPP) that chooses an endpoint for each request."
    )

    @field_validator("target_ports")
    @classmethod
    def _unique_ports(cls, ports: list[Port]) -> list[Port]:
        numbers = [p.number for p in ports]
        if len(set(numbers)) != len(numbers):
            raise ValueError("port number must be unique")
        return ports


class ParentReference(GIEModel):
    group: str = Field(default="gateway.networking.k8s.io", max_length=253, pattern=GROUP_PATTERN)
    kind: str = Field(default="Gateway", min_length=1, max_length=63, pattern=KIND_PATTERN)
    name: str = Field(min_length=1, max_length=253)
    namespace: str | None = Field(default=None, min_length=1, max_length=63, pattern=DNS_LABEL_PATTERN)


class ParentStatus(GIEModel):
    conditions: list[Condition] | None = conditions_field("Accepted, ResolvedRefs ... as set by the gateway.")
    controller_name: str | None = Field(
        default=None, min_length=1, max_length=253, pattern=CONTROLLER_NAME_PATTERN
    )
    parent_ref: ParentReference


class InferencePoolStatus(GIEModel):
    parents: list[ParentStatus] | None = Field(
        default=None,
        max_length=32,
        description="Written by the gateways this pool is attached to; never by kvgate.",
        json_schema_extra={"x-kubernetes-list-type": "atomic"},
    )


class InferencePool(GIEModel):
    """A pool of model server pods behind one endpoint picker (GIE v1)."""

    model_config = ConfigDict(extra="ignore")  # apiVersion, kind, metadata live outside the spec models
    spec: InferencePoolSpec
    status: InferencePoolStatus | None = None


# ---------------------------------------------------------------------------------------------
# InferenceObjective (GIE v1alpha2)
# ---------------------------------------------------------------------------------------------


class PoolObjectReference(GIEModel):
    group: str = Field(default=POOL_GROUP, max_length=253, pattern=GROUP_PATTERN)
    kind: str = Field(default="InferencePool", min_length=1, max_length=63, pattern=KIND_PATTERN)
    name: str = Field(min_length=1, max_length=253)


class InferenceObjectiveSpec(GIEModel):
    priority: int | None = Field(
        default=None,
        description="Higher is more important; unset means 0; negative means sheddable when saturated.",
    )
    pool_ref: PoolObjectReference = Field(
        description="The InferencePool (same namespace) this objective applies to."
    )


class InferenceObjectiveStatus(GIEModel):
    conditions: list[Condition] | None = conditions_field("Conditions of the objective.")


class InferenceObjective(GIEModel):
    """How important one use case's requests are within a pool (GIE v1alpha2)."""

    model_config = ConfigDict(extra="ignore")
    spec: InferenceObjectiveSpec
    status: InferenceObjectiveStatus | None = None
