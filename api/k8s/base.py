"""What the CRD models share: the camelCase base models and the Kubernetes / Gateway API
patterns and pieces (metav1.Condition) that both API groups use.

`K8sModel` is strict (unknown fields are errors: kvgate's own kinds); `GIEModel` ignores fields a
newer Gateway API Inference Extension adds, so reading GIE's objects keeps working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel

# Patterns from the Kubernetes / Gateway API conventions GIE reuses.
GROUP_PATTERN = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
KIND_PATTERN = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"
DNS_LABEL_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
CONDITION_REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"
CONDITION_TYPE_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])$"
CONTROLLER_NAME_PATTERN = (
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*\/[A-Za-z0-9\/\-._~%!$&'()*+,;=:]+$"
)

PortNumber = Annotated[int, Field(ge=1, le=65535, json_schema_extra={"format": "int32"})]


class K8sModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors for our own kinds."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def wire(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")


class GIEModel(K8sModel):
    """GIE's kinds: fields a newer GIE adds are ignored rather than rejected when reading."""

    model_config = ConfigDict(extra="ignore")


class Condition(GIEModel):
    """metav1.Condition."""

    type: str = Field(max_length=316, pattern=CONDITION_TYPE_PATTERN)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(min_length=1, max_length=1024, pattern=CONDITION_REASON_PATTERN)
    message: str = Field(max_length=32768)
    last_transition_time: str = Field(json_schema_extra={"format": "date-time"})
    observed_generation: int | None = Field(default=None, ge=0, json_schema_extra={"format": "int64"})


def conditions_field(description: str) -> Any:
    return Field(
        default=None,
        max_length=8,
        description=description,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
