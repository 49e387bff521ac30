"""Kubernetes types: the custom resources kvgate serves and reads.

- `crds`: the CRD declarations (kind → model, printer columns, scale subresource), the source of
  the CRD YAML under `crds/` and the chart, and the one module callers import the models from;
- `gie`: `InferencePool` and `InferenceObjective` (GIE's API) as pydantic models;
- `model_deployment`: `ModelDeployment` (kvgate's own) as pydantic models;
- `base`: what both API groups' models share (camelCase base models, patterns, `Condition`).
- `crd_schema`: pydantic model → structural OpenAPI v3 schema and CRD manifest.
- `quantity`: Kubernetes resource quantities (`16Gi`) as exact byte counts, and back.

They may import the wire contracts (`kvgate.api.contracts`), never the shared library code.
"""
