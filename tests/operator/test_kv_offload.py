"""spec.kvOffload: the engines' host KV tier (`--kv-offloading-size`), its memory, its checks."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.api.k8s.quantity import format_bytes, memory_bytes, parse_quantity
from kvgate.operator import children as ch
from kvgate.operator.config import OperatorConfig
from kvgate.operator.reconcile import SpecError, parse_spec

BASE = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": "m"}}
MODEL = {"source": "hf://Qwen/Qwen3-8B"}
GIB = 1 << 30


def _engine(spec: dict[str, Any], name: str = "m") -> dict[str, Any]:
    dep = ch.engine_deployment(
        name,
        ch.model_deployment_owner(name, "ns", "uid"),
        ModelDeploymentSpec.model_validate(spec),
        OperatorConfig(),
        replicas=1,
    )
    container: dict[str, Any] = dep["spec"]["template"]["spec"]["containers"][0]
    return container


def _flag(args: list[str], flag: str) -> str | None:
    return args[args.index(flag) + 1] if flag in args else None


def test_quantities_parse_exactly_and_format_back() -> None:
    assert parse_quantity("16Gi") == 16 * GIB
    assert parse_quantity("1.5Gi") == Decimal(3 * GIB // 2)
    assert parse_quantity("20G") == 20 * 10**9
    assert parse_quantity("1e3") == 1000 and parse_quantity(4096) == 4096
    assert parse_quantity("500m") == Decimal("0.5")
    assert memory_bytes("500m") == 1  # a fraction of a byte rounds up
    for bad in ("16GB", "lots", "", "1.2.3Gi"):
        with pytest.raises(ValueError):
            parse_quantity(bad)
    assert format_bytes(80 * GIB) == "80Gi"
    assert format_bytes(GIB // 2) == "512Mi"
    assert format_bytes(20 * 10**9 + 1024) == "19531251Ki"
    assert format_bytes(3 * 10**9) == "3G"  # no binary suffix divides it
    assert format_bytes(1001) == "1001"


def test_no_tier_no_flags_and_resources_untouched() -> None:
    resources = {"requests": {"cpu": "8", "memory": "48Gi"}, "limits": {"memory": "64Gi"}}
    engine = _engine({"model": MODEL, "engine": {"resources": resources}})
    assert not any(a.startswith("--kv-offload") for a in engine["args"])
    assert engine["resources"] == {
        "requests": {"cpu": "8", "memory": "48Gi"},
        "limits": {"memory": "64Gi", "nvidia.com/gpu": 1},
    }


def test_the_tier_is_the_engines_flags_and_is_added_to_request_and_limit() -> None:
    from kvgate.cli import build_parser

    resources = {"requests": {"cpu": "8", "memory": "48Gi"}, "limits": {"memory": "64Gi"}}
    engine = _engine({"model": MODEL, "engine": {"resources": resources}, "kvOffload": {"size": "32Gi"}})
    args = engine["args"]
    assert _flag(args, "--kv-offloading-size") == "32"
    assert _flag(args, "--kv-offloading-backend") == "native"
    assert "--kv-offload-on" not in args  # evict: the engine's default
    assert engine["resources"] == {
        "requests": {"cpu": "8", "memory": "80Gi"},
        "limits": {"memory": "96Gi", "nvidia.com/gpu": 1},
    }
    # The real engine CLI reads what the operator wrote.
    parsed = build_parser().parse_args([*engine["command"][1:], *args])
    assert (parsed.kv_offloading_size, parsed.kv_offloading_backend, parsed.kv_offload_on) == (
        32.0,
        "native",
        "evict",
    )

    compute = _engine({"model": MODEL, "kvOffload": {"size": "1536Mi", "offloadOn": "compute"}})
    assert _flag(compute["args"], "--kv-offloading-size") == "1.5"
    assert _flag(compute["args"], "--kv-offload-on") == "compute"
    # A decimal size: the exact GiB, and the same bytes in the memory request.
    decimal = _engine({"model": MODEL, "kvOffload": {"size": "20G"}})
    gib = float(_flag(decimal["args"], "--kv-offloading-size") or "")
    assert int(gib * GIB) in (20 * 10**9, 20 * 10**9 - 1)
    assert memory_bytes(decimal["resources"]["requests"]["memory"]) == 20 * 10**9


def test_tier_memory_without_a_user_request_or_limit() -> None:
    # Neither: a request of the tier alone (the pod lands where it fits), no memory limit.
    alone = _engine({"model": MODEL, "kvOffload": {"size": "16Gi"}})
    assert alone["resources"] == {"requests": {"memory": "16Gi"}, "limits": {"nvidia.com/gpu": 1}}
    cpu = _engine({"model": MODEL, "engine": {"accelerator": "none"}, "kvOffload": {"size": "2Gi"}})
    assert cpu["resources"] == {"requests": {"memory": "2Gi"}}
    # A limit only: the limit grows; the request stays unset (Kubernetes defaults it to the limit).
    limit = _engine(
        {"model": MODEL, "engine": {"resources": {"limits": {"memory": "64G"}}}, "kvOffload": {"size": "8Gi"}}
    )
    assert "requests" not in limit["resources"]
    assert memory_bytes(limit["resources"]["limits"]["memory"]) == 64 * 10**9 + 8 * GIB
    # A request only (in bytes, an int): the request grows, no limit appears.
    request = _engine(
        {
            "model": MODEL,
            "engine": {"resources": {"requests": {"memory": 4 * GIB}}},
            "kvOffload": {"size": "4Gi"},
        }
    )
    assert request["resources"] == {"requests": {"memory": "8Gi"}, "limits": {"nvidia.com/gpu": 1}}


def test_disaggregated_engines_each_get_the_tier_with_their_roles_resources() -> None:
    spec = ModelDeploymentSpec.model_validate(
        {
            "model": MODEL,
            "engine": {"resources": {"requests": {"memory": "32Gi"}}},
            "kvOffload": {"size": "16Gi"},
            "disaggregation": {"prefill": {"resources": {"limits": {"memory": "80Gi"}}}},
        }
    )
    owner = ch.model_deployment_owner("pd", "ns", "uid")
    kids = ch.model_deployment_children("pd", owner, spec, OperatorConfig(), ch.Capabilities())
    engines = {
        k["metadata"]["name"]: k["spec"]["template"]["spec"]["containers"][0]
        for k in kids
        if k["kind"] == "Deployment" and k["spec"]["template"]["spec"]["containers"][0]["name"] == "engine"
    }
    assert set(engines) == {"pd-prefill", "pd-decode"}
    for engine in engines.values():
        assert _flag(engine["args"], "--kv-offloading-size") == "16"
    assert engines["pd-prefill"]["resources"]["limits"]["memory"] == "96Gi"
    assert "requests" not in engines["pd-prefill"]["resources"]
    assert engines["pd-decode"]["resources"]["requests"]["memory"] == "48Gi"


def test_the_crd_and_the_operator_refuse_a_bad_size_alike(validator: Any) -> None:
    for good in ("16Gi", "0.5Gi", ".5Gi", "20G", "1536Mi", "1Ti", "16.Gi"):
        spec = {"model": MODEL, "kvOffload": {"size": good}}
        validator.check({**BASE, "spec": spec})
        ModelDeploymentSpec.model_validate(spec)
    validator.check({**BASE, "spec": {"model": MODEL, "kvOffload": {"size": "8Gi", "offloadOn": "compute"}}})
    for bad, message in (
        ("0Gi", "above 0"),
        ("0", "above 0"),
        ("-1Gi", "above 0"),
        ("16", "no byte unit"),  # 16 bytes to Kubernetes, 16 GiB to the engine: refused
        ("1e9", "no byte unit"),
        ("500m", "no byte unit"),
        ("16GB", "not a Kubernetes quantity"),
        ("lots", "not a Kubernetes quantity"),
    ):
        spec = {"model": MODEL, "kvOffload": {"size": bad}}
        assert validator.errors({**BASE, "spec": spec}), bad
        with pytest.raises(SpecError, match=rf"spec\.kvOffload\.size: .*{message}"):
            parse_spec("m", spec)
    for bad_spec in (
        {"kvOffload": {}},
        {"kvOffload": {"size": 16}},
        {"kvOffload": {"size": "16Gi", "backend": "lmcache"}},
        {"kvOffload": {"size": "16Gi", "offloadOn": "always"}},
        {"kvOffload": {"size": "16Gi", "on": "evict"}},  # unknown field
    ):
        spec = {"model": MODEL, **bad_spec}
        assert validator.errors({**BASE, "spec": spec}), bad_spec
        with pytest.raises(SpecError):
            parse_spec("m", spec)


def test_a_memory_the_tier_cannot_be_added_to_is_an_invalid_spec() -> None:
    spec = {
        "model": MODEL,
        "engine": {"resources": {"requests": {"memory": "lots"}}},
        "kvOffload": {"size": "16Gi"},
    }
    with pytest.raises(
        SpecError, match=r"engine\.resources\.requests\.memory: 'lots' is not a Kubernetes quantity"
    ):
        parse_spec("m", spec)
    # Without a tier the operator never reads the quantity (the API server judges it).
    ModelDeploymentSpec.model_validate({**spec, "kvOffload": None})
