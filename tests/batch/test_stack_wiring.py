"""How `kvgate up` wires the batch service in: its port, Envoy's routes to it, the EPPs' batch
objective (sheddable) and the service's command line; and `--no-batch` leaves all of it out."""

from __future__ import annotations

from pathlib import Path

from kvgate.gateway.envoy_config import BATCH_CLUSTER
from kvgate.local.cli import configure_parser
from kvgate.local.ports import plan_ports
from kvgate.local.stack import BATCH_PRIORITY, StackConfig, batch_spec, envoy_bootstrap, epp_spec


def routes(boot: dict) -> list[dict]:
    hcm = boot["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm["route_config"]["virtual_hosts"][0]["routes"]


def test_the_batch_service_has_a_port_routes_and_a_sheddable_objective(tmp_path: Path) -> None:
    ports = plan_ports(0, 0, 2, 2, batch=True)
    assert ports.batch is not None and ports.batch not in [p for _, p in ports.named()[:-1]]
    cfg = StackConfig(ports=ports, engines=2, epp_replicas=2, log_dir=tmp_path, simulate=True)
    assert cfg.batch
    boot = envoy_bootstrap(cfg)
    names = [r["name"] for r in routes(boot)]
    # before the body limit: an input file may be larger than a chat request
    assert names.index("batch /v1/files") < names.index("body_too_large")
    assert names.index("batch /v1/batches") < names.index("body_too_large")
    by_name = {r["name"]: r for r in routes(boot)}
    assert by_name["batch /v1/files"]["match"] == {"path_separated_prefix": "/v1/files"}
    assert by_name["batch /v1/batches"]["route"]["cluster"] == BATCH_CLUSTER
    # the EPP never sees the batch API's own requests (it sees each line the service sends)
    assert "envoy.filters.http.ext_proc" in by_name["batch /v1/files"]["typed_per_filter_config"]
    (cluster,) = [c for c in boot["static_resources"]["clusters"] if c["name"] == BATCH_CLUSTER]
    endpoint = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]
    assert endpoint["address"]["socket_address"]["port_value"] == ports.batch
    argv = list(epp_spec(cfg, 1).argv)
    assert argv[argv.index("--objective") + 1] == f"batch={BATCH_PRIORITY}" and BATCH_PRIORITY < 0
    spec = batch_spec(cfg)
    argv = list(spec.argv)
    assert argv[argv.index("--gateway-url") + 1] == f"http://127.0.0.1:{ports.gateway}"
    assert argv[argv.index("--port") + 1] == str(ports.batch)
    assert argv[argv.index("--batch-dir") + 1] == str(tmp_path / "batch")
    assert spec.name == "batch" and spec.env is None
    assert "--tenants" not in argv
    with_tenants = batch_spec(StackConfig(ports=ports, engines=2, tenants_file="/t.yaml", log_dir=tmp_path))
    assert list(with_tenants.argv)[list(with_tenants.argv).index("--tenants") + 1] == "/t.yaml"


def test_a_database_url_goes_in_the_environment_never_argv(tmp_path: Path) -> None:
    url = "postgresql://kv:secret@127.0.0.1:5432/kv"
    cfg = StackConfig(ports=plan_ports(0, 0, 1, 1, batch=True), engines=1, batch_database_url=url)
    spec = batch_spec(cfg)
    assert "secret" not in " ".join(spec.argv)
    assert spec.env == {"KVGATE_BATCH_DATABASE_URL": url}


def test_no_batch_leaves_it_all_out(tmp_path: Path) -> None:
    import argparse

    p = argparse.ArgumentParser()
    configure_parser(p)
    assert p.parse_args([]).batch is True and p.parse_args(["--no-batch"]).batch is False
    cfg = StackConfig(ports=plan_ports(0, 0, 1, 1), engines=1, log_dir=tmp_path)
    assert not cfg.batch
    assert not any(r["name"].startswith("batch") for r in routes(envoy_bootstrap(cfg)))
    assert "--objective" not in epp_spec(cfg).argv
