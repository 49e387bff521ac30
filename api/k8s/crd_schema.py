"""Turns pydantic models into Kubernetes structural OpenAPI v3 schemas and CRD manifests.

The pydantic models declared in `kvgate.api.k8s.crds` are the single source of truth: the operator parses
custom resources with them, and the CRD YAML under `crds/` (and the Helm chart) is generated
from them, so the two cannot drift. Kubernetes only accepts *structural* schemas: no `$ref`,
no `anyOf` for nullable fields, every node typed, `additionalProperties: false` forbidden.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inlines `$ref`s (CRD schemas cannot reference) and recurses."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        target.update(extra)  # a field's own description/default wins over the model's
        return _resolve(target, defs)
    return {k: _resolve(v, defs) for k, v in node.items()}


def _structural(node: Any) -> Any:
    if isinstance(node, list):
        return [_structural(item) for item in node]
    if not isinstance(node, dict):
        return node
    node = dict(node)
    any_of = node.pop("anyOf", None)
    if any_of is not None:
        variants = [v for v in any_of if v.get("type") != "null"]
        types = sorted(v.get("type", "") for v in variants)
        if types == ["integer", "string"]:
            node["x-kubernetes-int-or-string"] = True
        elif len(variants) == 1:
            merged = dict(variants[0])
            merged.update(node)  # description/default from the field itself
            node = merged
        else:
            raise ValueError(f"cannot express a union of {types} in a structural schema")
        if node.get("default", 0) is None:
            del node["default"]
    if "const" in node:
        node["enum"] = [node.pop("const")]
    for key in ("title",):
        node.pop(key, None)
    if node.get("additionalProperties") is False:
        del node["additionalProperties"]
    if node.get("additionalProperties") is True:
        del node["additionalProperties"]
        node["x-kubernetes-preserve-unknown-fields"] = True
    if "properties" in node:
        node["type"] = "object"
        node["properties"] = {k: _structural(v) for k, v in node["properties"].items()}
        if node.get("required") == []:
            del node["required"]
    if isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _structural(node["additionalProperties"])
    if "items" in node:
        node["items"] = _structural(node["items"])
    if node.get("type") == "object" and "properties" not in node and "additionalProperties" not in node:
        node["x-kubernetes-preserve-unknown-fields"] = True
    if not node.get("type") and not node.get("x-kubernetes-int-or-string"):
        if node.get("x-kubernetes-preserve-unknown-fields") or node == {}:
            node["type"] = "object"
            node["x-kubernetes-preserve-unknown-fields"] = True
        elif "enum" in node and all(isinstance(v, str) for v in node["enum"]):
            node["type"] = "string"
    return node


def structural_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema in the structural form a CRD version's `openAPIV3Schema` needs."""
    raw = model.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    return _structural(_resolve(raw, defs))


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    json_path: str
    type: str = "string"
    priority: int = 0
    description: str = ""

    def manifest(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "type": self.type, "jsonPath": self.json_path}
        if self.priority:
            out["priority"] = self.priority
        if self.description:
            out["description"] = self.description
        return out


@dataclass(frozen=True)
class CRDSpec:
    """Everything beyond the schema that a CustomResourceDefinition declares."""

    group: str
    version: str
    kind: str
    plural: str
    model: type[BaseModel]
    short_names: tuple[str, ...] = ()
    categories: tuple[str, ...] = ()
    columns: tuple[PrinterColumn, ...] = ()
    scale: dict[str, str] | None = None  # the scale subresource's paths, when the kind scales
    annotations: dict[str, str] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def manifest(self) -> dict[str, Any]:
        schema = structural_schema(self.model)
        # The API server owns these: a CRD schema describes them only as plain types.
        schema.setdefault("properties", {})
        schema["properties"]["apiVersion"] = {"type": "string"}
        schema["properties"]["kind"] = {"type": "string"}
        schema["properties"]["metadata"] = {"type": "object"}
        subresources: dict[str, Any] = {"status": {}}
        if self.scale:
            subresources["scale"] = dict(self.scale)
        names: dict[str, Any] = {
            "kind": self.kind,
            "listKind": f"{self.kind}List",
            "plural": self.plural,
            "singular": self.kind.lower(),
        }
        if self.short_names:
            names["shortNames"] = list(self.short_names)
        if self.categories:
            names["categories"] = list(self.categories)
        version: dict[str, Any] = {
            "name": self.version,
            "served": True,
            "storage": True,
            "schema": {"openAPIV3Schema": schema},
            "subresources": subresources,
        }
        if self.columns:
            version["additionalPrinterColumns"] = [c.manifest() for c in self.columns]
        metadata: dict[str, Any] = {"name": self.name}
        if self.annotations:
            metadata["annotations"] = dict(self.annotations)
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": metadata,
            "spec": {"group": self.group, "names": names, "scope": "Namespaced", "versions": [version]},
        }
