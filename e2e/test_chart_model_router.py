"""Several pools behind the chart's one gateway (envoyGateway.pools): the Envoy config is
files/envoy-pools.yaml, generated from build_bootstrap(GatewaySpec(pools=...)) and rendered by Helm into exactly
what the builder gives for those pools; the model router runs as its own Deployment; and in a real
run (simulated engines, one EPP per pool, the router with the command line the chart writes, Envoy
with the config the chart renders) each model's requests reach its own pool's engine, the
gateway lists both pools' models, and an unknown model is a 404 that reaches no engine."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from kvgate.gateway.envoy_config import GatewayLimits, GatewaySpec, PoolSpec, build_bootstrap
from kvgate.local.stack import grpc_serving, kvgate_argv
from kvgate.testing import eventually
from kvgate.testing import processes as harness

ROOT = Path(__file__).resolve().parents[1]
HELM = ROOT / ".tools" / "bin" / "helm"
pytestmark = pytest.mark.timeout(180)


def helm_docs(*sets: str) -> list[dict]:
    out = subprocess.run(
        [str(HELM), "template", "t", str(ROOT / "charts" / "kvgate"), "--namespace", "ns",
         "--set", "envoyGateway.enabled=true", *(a for s in sets for a in ("--set", s))],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def envoy_config(docs: list[dict]) -> dict:
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and "envoy.yaml" in d.get("data", {})]
    return yaml.safe_load(cm["data"]["envoy.yaml"])


def router_container(docs: list[dict]) -> dict:
    (dep,) = [
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "t-kvgate-model-router"
    ]
    (container,) = dep["spec"]["template"]["spec"]["containers"]
    return container


def test_pools_config_is_generated_and_fresh() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "gen_envoy_config", ROOT / "scripts" / "gen_envoy_config.py"
    )
    assert spec and spec.loader
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    assert gen.POOLS_TARGET.read_text() == gen.rendered_pools(), "run scripts/gen_envoy_config.py"


@pytest.mark.parametrize("tls", [True, False])
def test_chart_renders_what_the_builder_builds_for_those_pools(tls: bool, tmp_path: Path) -> None:
    docs = helm_docs(
        "envoyGateway.pools[0].name=chat",
        "envoyGateway.pools[1].name=code",
        "envoyGateway.pools[1].eppAddress=epp.code.example",
        "envoyGateway.pools[1].eppPort=9102",
        "envoyGateway.pools[1].eppHealthPort=9103",
        "envoyGateway.pools[1].engineAddress=engines.code.example",
        "envoyGateway.pools[1].enginePort=9000",
        "envoyGateway.pools[2].name=docs",
        "envoyGateway.pools[2].eppService=docs-picker",
        f"envoyGateway.eppTLS={str(tls).lower()}",
        "envoyGateway.maxRequestBodyBytes=1048576",
    )
    cfg = envoy_config(docs)
    want = build_bootstrap(
        GatewaySpec(
            pools=[
                PoolSpec(
                    "chat",
                    ["chat-epp-replicas.ns.svc:9002"],
                    ["chat-engines.ns.svc:8000"],
                    epp_health_ports=[9003],
                ),
                PoolSpec(
                    "code", ["epp.code.example:9102"], ["engines.code.example:9000"], epp_health_ports=[9103]
                ),
                PoolSpec(
                    "docs", ["docs-picker.ns.svc:9002"], ["docs-engines.ns.svc:8000"], epp_health_ports=[9003]
                ),
            ],
            listen_port=8081,
            failure_mode="FailClose",
            admin_port=19000,
            epp_tls=tls,
            listen_host="0.0.0.0",
            limits=GatewayLimits(max_request_body_bytes=1048576),
            model_router_addresses=["t-kvgate-model-router.ns.svc:9004"],
        )
    )
    # The builder leaves failure_mode_allow out for FailClose; the chart writes it as false.
    filters = cfg["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    epp_filter = next(f for f in filters["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    assert epp_filter["typed_config"].pop("failure_mode_allow") is False
    assert cfg == json.loads(json.dumps(want))  # the builder's output, field for field
    path = tmp_path / "envoy.json"
    path.write_text(json.dumps(cfg))
    result = subprocess.run(
        [harness.envoy_bin(), "--mode", "validate", "-c", str(path), "--use-dynamic-base-id"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]

    # The router's pools point at each pool's engines; headless Services for the defaults only.
    args = router_container(docs)["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--pool"] == [
        "chat=chat-engines.ns.svc:8000",
        "code=engines.code.example:9000",
        "docs=docs-engines.ns.svc:8000",
    ]
    services = {d["metadata"]["name"] for d in docs if d["kind"] == "Service"}
    assert services == {
        "t-kvgate-envoy",
        "t-kvgate-model-router",
        "chat-engines",
        "chat-epp-replicas",
        "docs-engines",
    }


def test_router_command_line_parses_and_pool_with_pools_is_refused() -> None:
    from kvgate.cli import build_parser

    docs = helm_docs("envoyGateway.pools[0].name=a", "envoyGateway.modelRouter.apiKeySecret.name=k",
                     "envoyGateway.modelRouter.apiKeySecret.key=key")  # fmt: skip
    container = router_container(docs)
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.pool == [("a", ("a-engines.ns.svc:8000",))] and args.grpc_port == 9004
    assert container["env"][0]["valueFrom"]["secretKeyRef"] == {"name": "k", "key": "key"}
    assert "--tenants" not in container["args"]
    assert [m["name"] for m in container["volumeMounts"]] == ["tmp", "engine-keys"]
    assert args.engine_keys == "/etc/kvgate/engine-keys"
    pod = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("model-router")
    )
    # each pool's file from the Secret the operator makes for a ModelDeployment with tenants;
    # optional: a pool without one is asked with the key above, or none
    keys = next(v for v in pod["spec"]["template"]["spec"]["volumes"] if v["name"] == "engine-keys")
    assert keys["projected"]["sources"] == [
        {"secret": {"name": "a-engine-key", "optional": True, "items": [{"key": "api-key", "path": "a"}]}}
    ]

    docs = helm_docs("envoyGateway.pools[0].name=a", "envoyGateway.modelRouter.tenantsSecret.name=keys")
    container = router_container(docs)
    args = build_parser().parse_args([*container["command"][1:], *container["args"]])
    assert args.tenants == "/etc/kvgate/tenants/tenants.yaml"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "tenants")
    assert mount == {"name": "tenants", "mountPath": "/etc/kvgate/tenants", "readOnly": True}
    pod = next(
        d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("model-router")
    )
    volume = next(v for v in pod["spec"]["template"]["spec"]["volumes"] if v["name"] == "tenants")
    assert volume["secret"] == {
        "secretName": "keys",
        "items": [{"key": "tenants.yaml", "path": "tenants.yaml"}],
    }
    both = subprocess.run(
        [str(HELM), "template", "t", str(ROOT / "charts" / "kvgate"), "--set", "envoyGateway.enabled=true",
         "--set", "envoyGateway.pool=p", "--set", "envoyGateway.pools[0].name=a"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert both.returncode != 0 and "set one" in both.stderr


def test_two_pools_behind_the_charts_gateway_serve_their_models(tmp_path: Path) -> None:
    procs: list[harness.Process] = []
    try:
        engines = {
            name: harness.start_engine(tmp_path, "--served-model-name", name, "--enable-lora")
            for name in ("chat", "code")
        }
        procs += [e.proc for e in engines.values()]
        for e in engines.values():
            e.wait_ready()
        epps = {name: harness.start_epp(tmp_path, [e]) for name, e in engines.items()}
        procs += [e.proc for e in epps.values()]
        port, admin, router_grpc, router_health = harness.free_ports(4)
        sets = [
            "envoyGateway.eppTLS=false",
            f"envoyGateway.port={port}",
            "envoyGateway.modelRouter.address=127.0.0.1",
            f"envoyGateway.modelRouter.grpcPort={router_grpc}",
            f"envoyGateway.modelRouter.healthPort={router_health}",
        ]
        for i, (name, e) in enumerate(engines.items()):
            sets += [
                f"envoyGateway.pools[{i}].name={name}",
                f"envoyGateway.pools[{i}].eppAddress=127.0.0.1",
                f"envoyGateway.pools[{i}].eppPort={epps[name].grpc_port}",
                f"envoyGateway.pools[{i}].eppHealthPort={epps[name].health_port}",
                f"envoyGateway.pools[{i}].engineAddress=127.0.0.1",
                f"envoyGateway.pools[{i}].enginePort={e.port}",
            ]
        docs = helm_docs(*sets)
        # The router exactly as the chart runs it (only its image is this checkout's venv).
        container = router_container(docs)
        argv = [*kvgate_argv(*container["command"][1:]), *container["args"]]
        router = harness.Process("router", argv, tmp_path / "router.log").start()
        procs.append(router)
        eventually(lambda: grpc_serving(f"127.0.0.1:{router_health}"), 30, "router ready", watch=[router])
        cfg = envoy_config(docs)
        cfg["static_resources"]["listeners"][0]["address"]["socket_address"]["address"] = "127.0.0.1"
        cfg["admin"]["address"]["socket_address"]["port_value"] = admin
        path = tmp_path / "chart-envoy.json"
        path.write_text(json.dumps(cfg))
        envoy = harness.Envoy(
            harness.Process("chart-envoy", harness.envoy_argv(path), tmp_path / "envoy.log").start(),
            port,
            admin,
        )
        procs.append(envoy.proc)
        for epp in epps.values():
            epp.wait_ready()
        envoy.wait_ready()

        # An adapter loaded at run time on the code pool's engine is routed there too.
        loaded = httpx.post(
            f"http://127.0.0.1:{engines['code'].port}/v1/load_lora_adapter",
            json={"lora_name": "sql", "lora_path": "/adapters/sql"},
            timeout=10,
        )
        assert loaded.status_code == 200, loaded.text

        def listed() -> set[str]:
            resp = httpx.get(f"{envoy.url}/v1/models", timeout=10)
            return {m["id"] for m in resp.json()["data"]} if resp.status_code == 200 else set()

        eventually(lambda: listed() == {"chat", "code", "sql"}, 30, "gateway lists both pools' models")

        def served(engine: harness.Engine) -> float:
            return engine.metric("vllm:request_success_total")

        for model, pool in (("chat", "chat"), ("code", "code"), ("sql", "code"), ("chat", "chat")):
            before = {n: served(e) for n, e in engines.items()}
            resp = httpx.post(
                f"{envoy.url}/v1/completions",
                json={"model": model, "prompt": "hi", "max_tokens": 2},
                timeout=30,
            )
            assert resp.status_code == 200, resp.text
            after = {n: served(e) for n, e in engines.items()}
            assert {n: after[n] - before[n] for n in engines} == {
                n: (1.0 if n == pool else 0.0) for n in engines
            }, (model, shlex.join(argv))
        before = {n: served(e) for n, e in engines.items()}
        missing = httpx.post(f"{envoy.url}/v1/completions", json={"model": "nope", "prompt": "x"}, timeout=10)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError", missing.text
        assert {n: served(e) for n, e in engines.items()} == before
    finally:
        harness.stop_all(*procs)
