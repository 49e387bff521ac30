"""Kubernetes types: the custom resources kvgate serves and reads.

- `crds`: `InferencePool`, `InferenceObjective` (GIE's API) and `ModelDeployment` (kvgate's own)
  as pydantic models, the source of the CRD YAML under `crds/` and the chart.
- `crd_schema`: pydantic model → structural OpenAPI v3 schema and CRD manifest.
- `quantity`: Kubernetes resource quantities (`16Gi`) as exact byte counts, and back.

They may import the wire contracts (`kvgate.api.contracts`), never the shared library code.
"""
