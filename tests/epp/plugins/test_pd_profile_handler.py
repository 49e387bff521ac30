"""Prefill/decode disaggregation in the EPP: endpoint roles (static suffix, pod label), the
director's P/D decision (issue 15), and the x-prefiller-host-port header on Envoy's answer."""

from __future__ import annotations

import json
import time

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

from kvgate.api.contracts.disaggregation import PREFILLER_HEADER, ROLE_LABEL
from kvgate.api.contracts.kv_events import BlockStored
from kvgate.epp.datastore import Datastore, Endpoint, EndpointMetrics
from kvgate.epp.director import Director
from kvgate.epp.discovery import EndpointListError, static_endpoints
from kvgate.epp.extproc import EndpointPickerHandler, _Exchange
from kvgate.epp.k8s import endpoints_for, pool_spec
from kvgate.epp.metrics import EppMetrics
from kvgate.epp.scheduling.config import (
    ConfigError,
    build_profiles,
    load_config,
    parse_config,
    saturation_detector,
)
from kvgate.epp.scheduling.plugins.pd_profile_handler import PrefillDecodeHandler
from kvgate.testing.processes import run_kvgate

P1, P2, D1, D2, B1 = "10.0.1.1:8000", "10.0.1.2:8000", "10.0.2.1:8000", "10.0.2.2:8000", "10.0.3.1:8000"
LONG = "".join(chr(0x4E00 + i) for i in range(2000))  # 2,000 distinct tokens with the char tokenizer
SHORT = "What is the capital of France?"


def pool(*entries: tuple[str, str]) -> Datastore:
    ds = Datastore()
    ds.set_endpoints([Endpoint(a, role=r, kv_events="tcp://x:1") for a, r in entries])
    for st in ds.all():
        ds.update_metrics(st.address, EndpointMetrics(updated_at=time.monotonic()))
        st.kv_events_live = True  # the precise index answers for every endpoint
    return ds


def director(ds: Datastore, threshold: int | None, profile: str = "precise-prefix") -> Director:
    cfg = load_config(None, profile)
    pd = PrefillDecodeHandler(threshold) if threshold is not None else None
    return Director(ds, build_profiles(cfg)[0], saturation_detector(cfg), pd=pd)


def store_prefix(ds: Datastore, address: str, text: str, tokenizer) -> None:
    """The engine at `address` announces it holds `text`'s full 16-token blocks."""
    tokens = tokenizer.encode(text)
    full = len(tokens) - len(tokens) % 16
    ds.index.apply(address, [BlockStored(list(range(full // 16)), None, tokens[:full], 16)])


# -- roles ---------------------------------------------------------------------------------------
def test_static_endpoints_take_a_role_suffix_and_keep_the_kv_event_order() -> None:
    eps = static_endpoints(
        "127.0.0.1:1@prefill,127.0.0.1:2@decode,127.0.0.1:3",
        "tcp://127.0.0.1:11,tcp://127.0.0.1:12,tcp://127.0.0.1:13",
    )
    assert [(e.address, e.role, e.kv_events) for e in eps] == [
        ("127.0.0.1:1", "prefill", "tcp://127.0.0.1:11"),
        ("127.0.0.1:2", "decode", "tcp://127.0.0.1:12"),
        ("127.0.0.1:3", "both", "tcp://127.0.0.1:13"),
    ]
    with pytest.raises(EndpointListError, match="role 'prefil'"):
        static_endpoints("127.0.0.1:1@prefil")
    with pytest.raises(EndpointListError, match="same address twice"):
        static_endpoints("127.0.0.1:1@prefill,127.0.0.1:1@decode")


def test_pod_role_label_becomes_the_endpoint_role() -> None:
    spec = pool_spec(
        {"spec": {"selector": {"matchLabels": {"app": "llm"}}, "targetPorts": [{"number": 8000}]}}
    )

    def pod(ip: str, role: str | None) -> dict:
        labels = {"app": "llm"} | ({ROLE_LABEL: role} if role else {})
        return {
            "metadata": {"name": ip, "labels": labels},
            "status": {"phase": "Running", "podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }

    pods = {"a": pod("10.0.0.1", "prefill"), "b": pod("10.0.0.2", "decode"), "c": pod("10.0.0.3", None)}
    pods["d"] = pod("10.0.0.4", "gpu-7")  # a typo serves both rather than vanishing from the pool
    roles = [e.role for e in endpoints_for(pods, spec, 5557, 0)]
    assert roles == ["prefill", "decode", "both", "both"]


def test_a_role_change_replaces_the_endpoint(char_tokenizer) -> None:
    ds = pool((D1, "both"))
    ds.set_endpoints([Endpoint(D1, role="prefill", kv_events="tcp://x:1")])
    assert ds.get(D1).endpoint.role == "prefill"


# -- the director's decision ---------------------------------------------------------------------
@pytest.mark.parametrize("threshold", [None, 0])
def test_a_prefill_only_endpoint_is_never_the_destination(req, threshold) -> None:
    ds = pool((P1, "prefill"), (D1, "decode"))
    d = director(ds, threshold)
    for i in range(20):
        decision = d.pick(req(f"{i} " + LONG[: 50 * i + 1]))
        assert decision.targets == [D1]
    only_prefill = director(pool((P1, "prefill")), threshold)
    refused = only_prefill.pick(req(LONG))
    assert refused.status == 503 and "decode" in refused.reason


def test_long_uncached_prompt_is_disaggregated_short_one_aggregated(req) -> None:
    ds = pool((P1, "prefill"), (P2, "prefill"), (D1, "decode"), (D2, "decode"))
    d = director(ds, threshold=256)
    long = d.pick(req(LONG))
    assert long.routed and long.targets[0] in (D1, D2)
    assert long.prefill in (P1, P2)
    assert long.pd_decision == "disaggregated" and long.pd_reason == "above-threshold"
    assert f"prefill={long.prefill}" in long.reason and "pd=disaggregated" in long.reason
    # the prefill engine carries the prompt's work until a scrape shows it; the decode engine none
    assert ds.get(long.prefill).pending_prefill_tokens() == 2000
    assert ds.get(long.targets[0]).pending_prefill_tokens() == 0
    short = d.pick(req(SHORT))
    assert short.targets[0] in (D1, D2) and short.prefill is None
    assert (short.pd_decision, short.pd_reason) == ("aggregated", "below-threshold")


def test_no_decision_without_a_threshold(req) -> None:
    decision = director(pool((P1, "prefill"), (D1, "decode")), None).pick(req(LONG))
    assert decision.prefill is None and decision.pd_decision == "" and "pd=" not in decision.reason


def test_prompt_cached_at_the_decode_engine_is_not_split(req, char_tokenizer) -> None:
    ds = pool((P1, "prefill"), (D1, "decode"))
    store_prefix(ds, D1, LONG, char_tokenizer)
    decision = director(ds, threshold=256).pick(req(LONG + " and one more question"))
    assert decision.targets == [D1] and decision.prefill is None
    assert decision.pd_reason == "below-threshold"


def test_the_decode_engine_holds_the_prompt_after_a_split_so_the_next_turn_stays_there(req) -> None:
    """Before its BlockStored arrives, this replica's own pick says the decode engine will hold the
    prompt (computed or pulled): the follow-up sharing it is not split again."""
    ds = pool((P1, "prefill"), (D1, "decode"))
    d = director(ds, threshold=256)
    assert d.pick(req(LONG)).prefill == P1
    follow = d.pick(req(LONG + " follow-up"))
    assert follow.targets == [D1] and follow.prefill is None


def test_no_prefill_endpoint_means_aggregated(req) -> None:
    ds = pool((D1, "decode"), (D2, "decode"))
    decision = director(ds, threshold=0).pick(req(LONG))
    assert decision.routed and decision.prefill is None
    assert (decision.pd_decision, decision.pd_reason) == ("aggregated", "no-prefill-endpoint")
    # a draining prefill engine is no candidate either
    ds2 = pool((P1, "prefill"), (D1, "decode"))
    ds2.get(P1).metrics.draining = True
    assert director(ds2, threshold=0).pick(req(LONG)).pd_reason == "no-prefill-endpoint"


def test_a_both_endpoint_prefills_for_another_but_never_for_itself(req) -> None:
    ds = pool((B1, "both"), (D1, "decode"))
    d = director(ds, threshold=0)
    for i in range(12):
        decision = d.pick(req(f"{i}:" + LONG[i * 100 :]))
        if decision.targets[0] == B1:
            assert decision.prefill is None and decision.pd_reason == "no-prefill-endpoint"
        else:
            assert decision.prefill == B1


def test_the_prefill_engine_is_the_one_holding_the_prefix(req, char_tokenizer) -> None:
    ds = pool((P1, "prefill"), (P2, "prefill"), (D1, "decode"))
    store_prefix(ds, P2, LONG[:1600], char_tokenizer)
    for i in range(5):
        assert (
            director(ds, threshold=256).pick(req(LONG[:1600] + f" question {i}" + LONG[1600:])).prefill == P2
        )


def test_the_prefill_engine_with_the_shorter_queue_wins_when_neither_holds_the_prefix(req) -> None:
    ds = pool((P1, "prefill"), (P2, "prefill"), (D1, "decode"))
    ds.update_metrics(P1, EndpointMetrics(updated_at=time.monotonic(), waiting=6))
    d = director(ds, threshold=256)
    assert {d.pick(req(f"{i}" + LONG)).prefill for i in range(6)} == {P2}


def test_threshold_in_config_and_bad_values() -> None:
    cfg = parse_config({"pdThreshold": 512, "schedulingProfiles": [{"name": "p", "plugins": []}]})
    assert cfg.pd_threshold == 512
    with pytest.raises(ConfigError, match="pdThreshold"):
        parse_config({"pdThreshold": -1, "schedulingProfiles": [{"name": "p", "plugins": []}]})
    with pytest.raises(ValueError):
        PrefillDecodeHandler(-5)
    r = run_kvgate("epp", "serve", "--endpoints", "127.0.0.1:1", "--pd-threshold", "-1")
    assert r.returncode == 2 and "--pd-threshold" in r.stderr and "Traceback" not in r.stderr
    r = run_kvgate("epp", "serve", "--endpoints", "127.0.0.1:1@prefil")
    assert r.returncode == 2 and "role 'prefil'" in r.stderr and "Traceback" not in r.stderr


# -- Envoy's answer ------------------------------------------------------------------------------
def _handler(ds: Datastore, tokenizer, threshold: int) -> EndpointPickerHandler:
    return EndpointPickerHandler(director(ds, threshold), EppMetrics(ds), tokenizer)


def _exchange(handler: EndpointPickerHandler, prompt: str, headers: dict[str, str] | None = None):
    hm = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode())
            for k, v in ({":path": "/v1/completions"} | (headers or {})).items()
        ]
    )
    x = _Exchange()
    out = handler.handle(x, ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=hm)))
    body = json.dumps({"model": "m", "prompt": prompt}).encode()
    out += handler.handle(x, ep.ProcessingRequest(request_body=ep.HttpBody(body=body, end_of_stream=True)))
    mutation = out[0].request_headers.response.header_mutation
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}, list(
        mutation.remove_headers
    )


def test_envoy_answer_names_the_prefill_engine_and_drops_a_forged_one(char_tokenizer) -> None:
    ds = pool((P1, "prefill"), (D1, "decode"))
    handler = _handler(ds, char_tokenizer, 256)
    headers, removed = _exchange(handler, LONG)
    assert headers["x-gateway-destination-endpoint"] == D1
    assert headers[PREFILLER_HEADER] == P1 and removed == []
    # a client naming a prefiller of its own: replaced when disaggregated, removed when not
    headers, _ = _exchange(handler, LONG[::-1], {PREFILLER_HEADER: "169.254.169.254:80"})
    assert headers[PREFILLER_HEADER] == P1
    headers, removed = _exchange(handler, SHORT, {PREFILLER_HEADER: "169.254.169.254:80"})
    assert PREFILLER_HEADER not in headers and removed == [PREFILLER_HEADER]
    text = handler.metrics.registry.get_sample_value
    assert (
        text("kvgate_epp_pd_decisions_total", {"decision": "disaggregated", "reason": "above-threshold"}) == 2
    )
    assert text("kvgate_epp_pd_decisions_total", {"decision": "aggregated", "reason": "below-threshold"}) == 1


def test_without_pd_a_forged_prefiller_header_is_removed_too(char_tokenizer) -> None:
    ds = pool((D1, "both"))
    cfg = load_config(None, "precise-prefix")
    handler = EndpointPickerHandler(
        Director(ds, build_profiles(cfg)[0], saturation_detector(cfg)), EppMetrics(ds), char_tokenizer
    )
    headers, removed = _exchange(handler, LONG, {PREFILLER_HEADER: "10.9.9.9:1"})
    assert PREFILLER_HEADER not in headers and removed == [PREFILLER_HEADER]
