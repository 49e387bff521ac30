"""Several ModelDeployments behind one Gateway (GIE's body-based routing): with
httpRoute.matchModelName each ModelDeployment's HTTPRoute matches the X-Gateway-Model-Name header
(set from the body's model by a model router ahead of the gateway) for its served name and its
adapters, and sends those requests to its own InferencePool. The real kopf operator on kmock."""

from __future__ import annotations

import asyncio
from typing import Any

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.conditions import find
from kvgate.operator.config import OperatorConfig
from kvgate.operator.resources import DEPLOYMENTS, HTTP_ROUTES, MODEL_DEPLOYMENTS

NS = "models"
GATEWAY = {"name": "inference-gateway", "namespace": "infra"}


def md(name: str, uid: str, served: str, adapters: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "kvgate.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": name, "namespace": NS, "uid": uid},
        "spec": {
            "model": {"source": f"/models/{served}", "servedName": served},
            "engine": {"image": "ghcr.io/kvgate/engine:test"},
            "lora": {},
            "adapters": adapters,
            "httpRoute": {"parentRefs": [GATEWAY], "matchModelName": True},
        },
    }


def header_values(route: dict[str, Any]) -> list[str]:
    return [m["headers"][0]["value"] for rule in route["spec"]["rules"] for m in rule["matches"]]


async def test_two_model_deployments_share_a_gateway_by_model_name(
    cluster: Any, operator: Any, validator: Any
) -> None:
    chat = md(
        "chat", "6f1c2a9e-0000-4000-8000-0000000000c1", "qwen-chat", [{"name": "sql", "source": "/a/sql"}]
    )
    code = md("code", "6f1c2a9e-0000-4000-8000-0000000000c2", "qwen-coder", [])
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, chat)
    await cluster.client.create(MODEL_DEPLOYMENTS, NS, code)
    routes = await cluster.eventually(
        lambda: {"chat", "code"} <= set(cluster.objects(HTTP_ROUTES)) and cluster.objects(HTTP_ROUTES),
        what="two HTTPRoutes",
    )
    for name, served in (("chat", ["qwen-chat", "sql"]), ("code", ["qwen-coder"])):
        route = routes[name]
        validator.check(route)
        assert route["spec"]["parentRefs"][0]["name"] == "inference-gateway"
        assert header_values(route) == served
        for rule in route["spec"]["rules"]:
            assert rule["backendRefs"] == [
                {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name}
            ]
            for match in rule["matches"]:
                assert match["path"] == {"type": "PathPrefix", "value": "/"}
                assert match["headers"][0]["type"] == "Exact"
                assert match["headers"][0]["name"].lower() == "x-gateway-model-name"
    routed = await cluster.eventually(
        lambda: find(
            (cluster.objects(MODEL_DEPLOYMENTS)["chat"].get("status") or {}).get("conditions"), "Routed"
        )
    )
    assert routed["status"] == "True" and "qwen-chat, sql" in routed["message"]

    # A new adapter is routed to its pool; the engines are not touched.
    template = cluster.objects(DEPLOYMENTS)["chat"]["spec"]["template"]
    adapters = [{"name": "sql", "source": "/a/sql"}, {"name": "legal", "source": "/a/legal"}]
    await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "chat", {"spec": {"adapters": adapters}})
    await cluster.eventually(
        lambda: header_values(cluster.objects(HTTP_ROUTES)["chat"]) == ["qwen-chat", "sql", "legal"],
        what="route gains the adapter",
    )
    assert cluster.objects(DEPLOYMENTS)["chat"]["spec"]["template"] == template
    assert header_values(cluster.objects(HTTP_ROUTES)["code"]) == ["qwen-coder"]


def test_many_adapters_split_into_rules_within_gateway_api_limits(validator: Any) -> None:
    spec = ModelDeploymentSpec.model_validate(
        {
            "model": {"source": "/models/base", "servedName": "base"},
            "adapters": [{"name": f"a{i}", "source": f"/a/{i}"} for i in range(64)],
            "httpRoute": {"parentRefs": [GATEWAY], "matchModelName": True},
        }
    )
    owner = ch.model_deployment_owner("big", NS, "uid-1")
    route = ch.http_route("big", owner, spec, OperatorConfig())
    validator.check(route)
    assert [len(r["matches"]) for r in route["spec"]["rules"]] == [64, 1]
    assert header_values(route) == ["base", *(f"a{i}" for i in range(64))]
    # Without matchModelName: one rule on the path, as before.
    plain = spec.model_copy(
        update={"http_route": spec.http_route.model_copy(update={"match_model_name": False})}
    )  # type: ignore[union-attr]
    assert ch.http_route("big", owner, plain, OperatorConfig())["spec"]["rules"][0]["matches"] == [
        {"path": {"type": "PathPrefix", "value": "/"}}
    ]


async def test_a_child_event_reconciles_the_spec_current_when_its_pass_runs(cluster: Any) -> None:
    """A child's event queues a pass behind the one already running for its owner; that pass must
    read the owner when it runs, not when the event came: one read before the wait re-applied
    the spec from before an edit that the pass ahead of it had just applied (the HTTPRoute lost
    a new adapter until the next resync, 30 s by default). The handlers are driven directly,
    in this loop, so the order is certain; the operator fixture's kopf thread would race."""
    import kopf

    from kvgate.operator.children import LABEL_MD
    from kvgate.operator.handlers import Operator

    op = Operator(OperatorConfig(namespaces=(NS,)))
    await op._connect(kopf.ConnectionInfo(server=cluster.url))
    try:
        chat = md(
            "chat", "6f1c2a9e-0000-4000-8000-0000000000c3", "qwen-chat", [{"name": "sql", "source": "/a/sql"}]
        )
        await cluster.client.create(MODEL_DEPLOYMENTS, NS, chat)
        await op.reconciler.reconcile_model_deployment(cluster.objects(MODEL_DEPLOYMENTS)["chat"])
        assert header_values(cluster.objects(HTTP_ROUTES)["chat"]) == ["qwen-chat", "sql"]
        (child_changed,) = {
            h.fn for h in op.registry._watching.get_all_handlers() if h.id == "child-deployments"
        }
        event = {"type": "MODIFIED", "object": cluster.objects(DEPLOYMENTS)["chat"]}
        assert event["object"]["metadata"]["labels"][LABEL_MD] == "chat"

        lock = op._lock("md", NS, "chat")
        await lock.acquire()  # a pass for chat is running
        pending = asyncio.create_task(child_changed(event=event))
        await asyncio.sleep(0.3)  # the child's event arrives and waits for that pass
        adapters = [{"name": "sql", "source": "/a/sql"}, {"name": "legal", "source": "/a/legal"}]
        await cluster.client.patch(MODEL_DEPLOYMENTS, NS, "chat", {"spec": {"adapters": adapters}})
        # The running pass is the edit's: it applies the new spec, then lets the child's pass run.
        await op.reconciler.reconcile_model_deployment(cluster.objects(MODEL_DEPLOYMENTS)["chat"])
        assert header_values(cluster.objects(HTTP_ROUTES)["chat"]) == ["qwen-chat", "sql", "legal"]
        lock.release()
        await asyncio.wait_for(pending, 10)
        assert header_values(cluster.objects(HTTP_ROUTES)["chat"]) == ["qwen-chat", "sql", "legal"]
        status = cluster.objects(MODEL_DEPLOYMENTS)["chat"]["status"]
        assert (
            status["observedGeneration"]
            == cluster.objects(MODEL_DEPLOYMENTS)["chat"]["metadata"]["generation"]
        )
    finally:
        await op.close()
