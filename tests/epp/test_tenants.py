"""Tenants: the tenants file, API keys checked on the request's headers (401 before the body),
the tenant as the request's fairness id and priority, and the flags that turn it on."""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, fields
from pathlib import Path

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvgate.api.contracts.queue_order import (
    OVER_SHARE_HEADER,
    PRIORITY_HEADER,
    QueueOrder,
    order_from_headers,
)
from kvgate.cli import build_parser
from kvgate.epp.cli import FLOW_DEFAULTS, flow_control_config
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.extproc import FAIRNESS_HEADER, EndpointPickerHandler, _Exchange
from kvgate.epp.flow_control import FlowControlConfig
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.scheduling.config import build_profiles, load_config, saturation_detector
from kvgate.epp.tenants import (
    MAX_FILE_BYTES,
    Tenant,
    TenantsFileError,
    first_key,
    load_tenants,
    parse_tenants,
    valid_fairness_id,
)
from kvgate.testing.processes import run_kvgate

ALICE_KEY = "sk-alice-0123456789abcdef"
BOB_KEY = "sk-bob-0123456789abcdef00"
TENANTS_YAML = f"""
- name: alice
  key: {ALICE_KEY}
  weight: 2
  priority: 5
- name: bob
  key: {BOB_KEY}
"""
ADDRS = ["10.0.0.1:8000", "10.0.0.2:8000"]


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS_YAML)
    return path


# -- the tenants file ------------------------------------------------------------------------


def test_a_good_file_maps_keys_to_tenants(tenants_file: Path) -> None:
    reg = load_tenants(tenants_file)
    assert len(reg) == 2
    assert reg.authenticate(f"Bearer {ALICE_KEY}") == Tenant("alice", 2.0, 5)
    assert reg.authenticate(f"bearer  {BOB_KEY} ") == Tenant("bob", 1.0, 0)
    for header in (None, "", "Bearer", "Bearer ", ALICE_KEY, f"Basic {ALICE_KEY}", f"Bearer {ALICE_KEY}x"):
        assert reg.authenticate(header) is None, header
    assert reg.weight("alice") == 2.0 and reg.weight("nobody") == 1.0
    assert first_key(tenants_file) == ALICE_KEY
    assert ALICE_KEY not in repr(reg.tenants) and ALICE_KEY not in repr(reg.__dict__)


def test_the_list_may_sit_under_a_tenants_key(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(f"tenants:\n  - name: a\n    key: {ALICE_KEY}\n")
    assert load_tenants(path).authenticate(f"Bearer {ALICE_KEY}") == Tenant("a")
    assert first_key(path) == ALICE_KEY


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("- name: a\n  key: [unclosed\n", "not valid YAML at line 3, column 1"),
        (f"- name: a\n  key: {ALICE_KEY}\n\tweight: 1\n", "not valid YAML at line 3"),
        ("", "expected a non-empty YAML list"),
        ("# nothing but a comment\n", "expected a non-empty YAML list"),
        ("[]", "expected a non-empty YAML list"),
        ("just a string", "expected a non-empty YAML list"),
        (f"- name: a\n  key: {ALICE_KEY}\n- name: a\n  key: {BOB_KEY}\n", "'a' is listed twice"),
        (
            f"- name: a\n  key: {ALICE_KEY}\n- name: b\n  key: {ALICE_KEY}\n",
            "'b' reuses another tenant's key",
        ),
        ("- name: a\n  key: short\n", "tenant #1: key: Value error, must be 16-4096 characters"),
        (
            f"- name: a\n  key: {ALICE_KEY}\n  colour: blue\n",
            "tenant #1: colour: Extra inputs are not permitted",
        ),
        (f"- name: a b\n  key: {ALICE_KEY}\n", "tenant #1: name: Value error, must be 1-63 letters"),
        (
            f"- name: a\n  key: {ALICE_KEY}\n  weight: 0\n",
            "tenant #1: weight: Input should be greater than 0",
        ),
        ("- name: a\n", "tenant #1: key: Field required"),
        (f"- name: a\n  key: {ALICE_KEY}\n- 7\n", "tenant #2"),
    ],
)
def test_bad_files_are_a_clear_error(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    with pytest.raises(TenantsFileError) as caught:
        load_tenants(path)
    message = str(caught.value)
    assert problem in message and str(path) in message
    assert "\n" not in message  # one line, for the CLI's one-line error
    assert ALICE_KEY not in message and BOB_KEY not in message  # a key never lands in a log


def test_a_huge_file_is_refused_unread(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text("#" * (MAX_FILE_BYTES + 1))
    with pytest.raises(TenantsFileError, match=f"a tenants file is at most {MAX_FILE_BYTES}"):
        load_tenants(path)


def test_missing_and_binary_files(tmp_path: Path) -> None:
    with pytest.raises(TenantsFileError, match="cannot read tenants file"):
        load_tenants(tmp_path / "absent.yaml")
    path = tmp_path / "bin.yaml"
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(TenantsFileError, match="not UTF-8"):
        load_tenants(path)


def test_a_name_with_a_trailing_newline_is_refused() -> None:
    # YAML's block scalars end in a newline; a header value and a metric label must not.
    with pytest.raises(TenantsFileError, match="name: Value error"):
        parse_tenants([{"name": "alice\n", "key": ALICE_KEY}])


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("team-a", "team-a"),
        ("A.b_c-9", "A.b_c-9"),
        (None, None),
        ("", None),
        ("-leading-dash", None),
        ("has space", None),
        ("x" * 64, None),
        ("ok\n", None),
        ("é", None),
    ],
)
def test_valid_fairness_id(value: str | None, expected: str | None) -> None:
    assert valid_fairness_id(value) == expected


# -- the handler, message by message ---------------------------------------------------------


def make_handler(char_tokenizer, tenants=None, engine_api_key=None) -> EndpointPickerHandler:
    ds = Datastore()
    ds.set_endpoints([Endpoint(a) for a in ADDRS])
    for a in ADDRS:
        ds.update_metrics(a, EndpointMetrics(updated_at=time.monotonic()))
    cfg = load_config(None, "precise-prefix")
    director = Director(ds, build_profiles(cfg)[0], saturation_detector(cfg))
    return EndpointPickerHandler(
        director,
        EppMetrics(ds),
        char_tokenizer,
        {"batch": -1},
        tenants=tenants,
        engine_api_key=engine_api_key,
    )


@pytest.fixture
def handler(char_tokenizer, tenants_file: Path) -> EndpointPickerHandler:
    return make_handler(char_tokenizer, load_tenants(tenants_file))


def headers_msg(headers: dict[str, str], eos: bool = False) -> ep.ProcessingRequest:
    hm = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in headers.items()]
    )
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm, end_of_stream=eos))


BODY = ep.ProcessingRequest(
    request_body=ep.HttpBody(body=b'{"model": "m", "prompt": "hi"}', end_of_stream=True)
)


def sent_headers(resp: ep.ProcessingResponse) -> dict[str, str]:
    muts = resp.request_headers.response.header_mutation.set_headers
    return {h.header.key: h.header.raw_value.decode() for h in muts}


def errors_counted(handler: EndpointPickerHandler, code: str) -> float:
    return sum(
        s.value
        for metric in handler.metrics.registry.collect()
        for s in metric.samples
        if s.name == "inference_objective_request_error_total" and s.labels["error_code"] == code
    )


@pytest.mark.parametrize(
    ("authorization", "message"),
    [
        (None, "You didn't provide an API key"),
        ("Bearer", "You didn't provide an API key"),
        (ALICE_KEY, "You didn't provide an API key"),  # no scheme
        ("Bearer sk-not-a-known-key-000000", "Incorrect API key provided"),
        (f"Basic {ALICE_KEY}", "Incorrect API key provided"),
        (f"Bearer {ALICE_KEY[:-1]}", "Incorrect API key provided"),
    ],
)
def test_no_or_wrong_key_is_a_401_before_the_body(handler, authorization, message) -> None:
    headers = {":path": "/v1/completions", "x-request-id": "r-401"}
    if authorization is not None:
        headers["authorization"] = authorization
    x = _Exchange()
    (resp,) = handler.handle(x, headers_msg(headers))  # answered on the headers: no body read
    imm = resp.immediate_response
    assert imm.status.code == 401
    err = json.loads(imm.body)["error"]  # OpenAI's error shape
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert err["message"].startswith(message)
    assert ALICE_KEY not in imm.body.decode()
    sent = {h.header.key: h.header.raw_value.decode() for h in imm.headers.set_headers}
    assert sent["www-authenticate"] == "Bearer"
    assert sent["content-type"] == "application/json" and sent["x-request-id"] == "r-401"
    assert x.tenant is None and x.request is None and not x.body
    assert errors_counted(handler, "401") == 1


def test_a_bodyless_request_needs_a_key_too(handler) -> None:
    (resp,) = handler.handle(_Exchange(), headers_msg({":method": "GET", ":path": "/v1/models"}, eos=True))
    assert resp.immediate_response.status.code == 401


def test_the_tenant_is_the_fairness_id_and_a_forged_one_is_replaced(handler) -> None:
    x = _Exchange()
    forged = {"authorization": f"Bearer {BOB_KEY}", FAIRNESS_HEADER: "alice"}
    assert handler.handle(x, headers_msg(forged)) == []
    out = handler.handle(x, BODY)
    assert x.tenant == Tenant("bob") and x.request is not None
    assert x.request.fairness_id == "bob" and x.request.priority == 0
    assert sent_headers(out[0])[FAIRNESS_HEADER] == "bob"  # what the engine sees


def test_the_tenant_priority_applies_unless_an_objective_names_one(handler) -> None:
    def priority(extra: dict[str, str]) -> int:
        x = _Exchange()
        handler.handle(x, headers_msg({"authorization": f"Bearer {ALICE_KEY}", **extra}))
        handler.handle(x, BODY)
        assert x.request is not None and x.request.fairness_id == "alice"
        return x.request.priority

    assert priority({}) == 5
    assert priority({"x-gateway-inference-objective": "batch"}) == -1
    assert priority({"x-gateway-inference-objective": "unknown"}) == 5


def test_the_engine_is_told_the_priority_and_a_clients_own_value_is_replaced(handler) -> None:
    """The engine orders its queue by it (kvgate.api.contracts.queue_order)."""
    x = _Exchange()
    forged = {"authorization": f"Bearer {ALICE_KEY}", PRIORITY_HEADER: "1000", OVER_SHARE_HEADER: "1"}
    handler.handle(x, headers_msg({**forged, "x-gateway-inference-objective": "batch"}))
    out = handler.handle(x, BODY)
    sent = sent_headers(out[0])
    assert sent[PRIORITY_HEADER] == "-1" and sent[FAIRNESS_HEADER] == "alice"
    removed = set(out[0].request_headers.response.header_mutation.remove_headers)
    assert {OVER_SHARE_HEADER, "authorization"} <= removed and OVER_SHARE_HEADER not in sent
    assert order_from_headers(sent) == QueueOrder(1, "alice")  # what the engine makes of it


def test_the_engines_key_replaces_the_tenants_key(char_tokenizer, tenants_file: Path) -> None:
    """With the engines' key known (KVGATE_API_KEY), it is what the engine gets: engines that
    require it serve only what the EPP picked, and the tenant's key never leaves the gateway."""
    handler = make_handler(char_tokenizer, load_tenants(tenants_file), engine_api_key="engine-key-0123456789")
    x = _Exchange()
    handler.handle(x, headers_msg({"authorization": f"Bearer {ALICE_KEY}"}))
    out = handler.handle(x, BODY)
    assert sent_headers(out[0])["authorization"] == "Bearer engine-key-0123456789"
    assert "authorization" not in out[0].request_headers.response.header_mutation.remove_headers
    # without tenants the client's header is the engines' business: passed through untouched
    plain = make_handler(char_tokenizer, engine_api_key="engine-key-0123456789")
    x = _Exchange()
    plain.handle(x, headers_msg({"authorization": "Bearer client-key"}))
    out = plain.handle(x, BODY)
    assert "authorization" not in sent_headers(out[0])
    assert "authorization" not in out[0].request_headers.response.header_mutation.remove_headers


def test_up_with_tenants_gives_every_process_one_random_engine_key(
    tenants_file: Path, tmp_path: Path
) -> None:
    """The key goes in the environment (argv is world-readable in `ps`), the same to engines,
    EPPs and the router; without tenants the engines ask for no key."""
    from kvgate.local.ports import plan_ports
    from kvgate.local.stack import LocalStack, PoolConfig, StackConfig, engine_spec, epp_spec, router_spec

    plan = plan_ports(0, 0, 2, 2, model_router=True)
    pools = (PoolConfig("a", engines=1), PoolConfig("b", engines=1))
    cfg = StackConfig(ports=plan, engines=2, epp_replicas=2, pools=pools, tenants_file=str(tenants_file))
    stacks = [LocalStack(cfg, progress=None), LocalStack(cfg, progress=None)]
    keys = [s.cfg.engine_api_key for s in stacks]
    assert keys[0] and keys[1] and keys[0] != keys[1] and len(keys[0]) >= 32
    c = stacks[0].cfg
    specs = [engine_spec(c, 0), engine_spec(c, 1), epp_spec(c, 0), epp_spec(c, 1), router_spec(c)]
    assert all(spec.env == {"KVGATE_API_KEY": keys[0]} for spec in specs)
    assert not any(keys[0] in arg for spec in specs for arg in spec.argv)
    plain = LocalStack(StackConfig(ports=plan, engines=2, epp_replicas=2, pools=pools)).cfg
    assert plain.engine_api_key is None and engine_spec(plain, 0).env is None


def test_without_tenants_no_key_is_asked_and_a_plain_fairness_header_is_kept(char_tokenizer) -> None:
    handler = make_handler(char_tokenizer)

    def fairness(extra: dict[str, str]) -> tuple[str | None, str]:
        x = _Exchange()
        handler.handle(x, headers_msg(extra))
        out = handler.handle(x, BODY)
        assert x.request is not None and x.request.priority == 0
        return x.request.fairness_id, sent_headers(out[0])[FAIRNESS_HEADER]

    assert fairness({}) == (None, "default")
    assert fairness({FAIRNESS_HEADER: "team-a"}) == ("team-a", "team-a")
    assert fairness({FAIRNESS_HEADER: "x" * 500}) == (None, "default")
    assert fairness({FAIRNESS_HEADER: "a b"}) == (None, "default")


# -- flags -----------------------------------------------------------------------------------


def test_the_help_defaults_are_flow_controls_own() -> None:
    assert asdict(FLOW_DEFAULTS) == {
        f.name: getattr(FlowControlConfig(), f.name) for f in fields(FLOW_DEFAULTS)
    }


def parse_serve(*extra: str) -> argparse.Namespace:
    return build_parser().parse_args(["epp", "serve", "--endpoints", "127.0.0.1:1", *extra])


def test_flow_control_flags() -> None:
    default = flow_control_config(parse_serve())
    assert default == FlowControlConfig()
    args = parse_serve(
        "--no-flow-control",
        "--flow-max-queued",
        "10",
        "--flow-max-queued-per-flow",
        "3",
        "--flow-max-queued-bytes",
        "1000",
        "--flow-ttl",
        "500ms",
        "--flow-dispatch-queue-depth",
        "2",
        "--flow-dispatch-prefill-tokens",
        "0",
        "--tenants",
        "t.yaml",
    )
    assert args.tenants == "t.yaml"
    assert flow_control_config(args) == FlowControlConfig(
        enabled=False,
        max_queued=10,
        max_queued_per_flow=3,
        max_queued_bytes=1000,
        ttl_s=0.5,
        dispatch_queue_depth=2.0,
        dispatch_prefill_tokens=0,
    )


@pytest.mark.parametrize(
    "flag",
    [
        ("--flow-max-queued", "0"),
        ("--flow-max-queued-per-flow", "-1"),
        ("--flow-max-queued-bytes", "lots"),
        ("--flow-ttl", "0"),
        ("--flow-ttl", "soon"),
        ("--flow-ttl", "9" * 400),
        ("--flow-dispatch-queue-depth", "0"),
        ("--flow-dispatch-prefill-tokens", "-5"),
    ],
)
def test_bad_flow_flags_are_argparse_errors(flag, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        parse_serve(*flag)
    assert caught.value.code == 2
    assert f"argument {flag[0]}" in capsys.readouterr().err


def test_up_with_several_pools_gives_the_model_router_the_tenants_too() -> None:
    """The router answers GET /v1/models itself: with tenants it must ask for a key as well."""
    from kvgate.local.ports import plan_ports
    from kvgate.local.stack import PoolConfig, StackConfig, router_spec

    pools = (PoolConfig("a", engines=1), PoolConfig("b", engines=1))
    plan = plan_ports(0, 0, 2, 2, model_router=True)
    assert "--tenants" not in router_spec(StackConfig(ports=plan, engines=2, pools=pools)).argv
    argv = router_spec(StackConfig(ports=plan, engines=2, pools=pools, tenants_file="/t.yaml")).argv
    assert argv[argv.index("--tenants") + 1] == "/t.yaml"


def test_up_passes_tenants_and_no_flow_control_to_its_epps(tmp_path: Path) -> None:
    from kvgate.local.ports import EppPorts, PortPlan
    from kvgate.local.stack import StackConfig, epp_spec

    plan = PortPlan(
        gateway=1, envoy_admin=2, engines=(3,), kv_events=(4,), kv_replay=(5,), epps=(EppPorts(6, 7, 8),)
    )
    plain = epp_spec(StackConfig(ports=plan, engines=1)).argv
    assert "--tenants" not in plain and "--no-flow-control" not in plain
    argv = epp_spec(StackConfig(ports=plan, engines=1, tenants_file="/t.yaml", flow_control=False)).argv
    assert argv[argv.index("--tenants") + 1] == "/t.yaml" and "--no-flow-control" in argv
    args = build_parser().parse_args(["up", "--tenants", "t.yaml", "--no-flow-control"])
    assert args.tenants == "t.yaml" and args.flow_control is False and args.failure_mode is None


def test_a_bad_tenants_file_stops_the_cli_before_anything_starts(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.yaml"
    bad.write_text("- name: a\n  key: short\n")
    out = run_kvgate(
        "epp", "serve", "--endpoints", "127.0.0.1:1", "--profile", "random", "--tenants", str(bad)
    )
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "kvgate epp serve: --tenants:" in out.stderr and "must be 16-4096 characters" in out.stderr
    out = run_kvgate(
        "up", "--simulate", "--tenants", str(tmp_path / "absent.yaml"), "--log-dir", str(tmp_path)
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "kvgate up: --tenants: cannot read tenants file" in out.stderr


def test_up_refuses_tenants_with_fail_open(tenants_file: Path, tmp_path: Path) -> None:
    out = run_kvgate(
        "up",
        "--simulate",
        "--tenants",
        str(tenants_file),
        "--failure-mode",
        "FailOpen",
        "--log-dir",
        str(tmp_path),
    )
    assert out.returncode == 2 and "would skip the key check" in out.stderr


def test_up_probes_its_gateway_with_a_tenants_key(tenants_file: Path, tmp_path: Path) -> None:
    """`kvgate up --tenants` is ready once its gateway answers a request with a key: without
    one the EPP's 401 would hold the stack "not ready" forever."""
    import httpx

    from kvgate.local.ports import EppPorts, PortPlan
    from kvgate.local.stack import LocalStack, StackConfig

    plan = PortPlan(
        gateway=1, envoy_admin=2, engines=(3,), kv_events=(4,), kv_replay=(5,), epps=(EppPorts(6, 7, 8),)
    )
    seen: list[str | None] = []

    def gateway(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        if request.headers.get("authorization") != f"Bearer {ALICE_KEY}":
            return httpx.Response(401, json={"error": {"code": "invalid_api_key"}})
        return httpx.Response(200, json={"data": [{"id": "default"}]})

    stack = LocalStack(StackConfig(ports=plan, engines=1, tenants_file=str(tenants_file), log_dir=tmp_path))
    with httpx.Client(transport=httpx.MockTransport(gateway)) as client:
        stack._wait_gateway(client, time.monotonic() + 5, None)
    assert seen == [f"Bearer {ALICE_KEY}"]


def test_the_reloader_rotates_keys_and_keeps_them_through_a_bad_edit(tmp_path) -> None:
    from kvgate.epp.tenants import TenantsReloader, load_tenants

    path = tmp_path / "tenants.yaml"
    path.write_text(f"- {{name: alice, key: {ALICE_KEY}}}\n")
    registry = load_tenants(path)
    seen: list[int] = []
    reloader = TenantsReloader(path, registry, interval=0.01, on_reload=lambda reg: seen.append(len(reg)))
    assert not reloader.check()  # unchanged
    rotated = "sk-alice-rotated-0123456789"
    path.write_text(f"- {{name: alice, key: {rotated}, weight: 3}}\n- {{name: bob, key: {BOB_KEY}}}\n")
    assert reloader.check() and seen == [2]
    assert registry.authenticate(f"Bearer {ALICE_KEY}") is None  # the old key: 401 from now on
    assert registry.authenticate(f"Bearer {rotated}") == Tenant("alice", 3.0)
    assert registry.weight("alice") == 3.0 and registry.authenticate(f"Bearer {BOB_KEY}") == Tenant("bob")
    path.write_text("- {name: x, key: short}\n")  # refused: the keys in force stay
    assert not reloader.check() and reloader.failures == 1
    assert registry.authenticate(f"Bearer {rotated}") is not None
    path.unlink()  # gone: the same
    assert not reloader.check() and registry.authenticate(f"Bearer {BOB_KEY}") is not None
