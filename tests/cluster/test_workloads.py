"""The user's path on a real control plane with a node whose pods run (scripts/cluster.sh, the
node agent in kvgate/testing/node_agent.py): the chart's operator pod, logged in with the token
the API server issued for its ServiceAccount, turns a ModelDeployment (simulated engines, the
model on a PersistentVolumeClaim) into engine and EPP pods that run as processes on loopback
addresses of their own; the EPP pods find the engines through real watches with their own
tokens, and a real Envoy sends OpenAI requests through them. Then edits roll under traffic
without a failed request, the operator is SIGKILLed mid-edit, the API server is SIGKILLed under
every watch, and deleting the ModelDeployment stops every process.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvgate.epp.k8s import pod_ready
from kvgate.testing import pods as pod_process
from kvgate.testing import processes as harness
from kvgate.testing.fake_hub import default_tokenizer_files
from kvgate.testing.polling import eventually

from .conftest import Cluster

pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    pytest.mark.skipif(not pod_process.namespaces_work(), reason="the node needs private mount namespaces"),
]

ROOT = Path(__file__).resolve().parents[2]
OPS, NS, SCALED, KEYED, MD = "kvgate-ops", "serve", "scaled", "keyed", "tiny"
ENGINES = f"kvgate.dev/model-deployment={MD},kvgate.dev/role=engine"
EPPS = f"kvgate.dev/model-deployment={MD},kvgate.dev/role=epp"


def restricted_namespace(cluster: Cluster, name: str) -> None:
    cluster.kubectl("create", "namespace", name)
    cluster.kubectl("label", "namespace", name, "pod-security.kubernetes.io/enforce=restricted")


@pytest.fixture(scope="module")
def operator(crds: Cluster) -> Iterator[Cluster]:
    """The chart, its operator running as a pod on the node (not on the host), serving the
    External Metrics API (registered by test_an_hpa_scales..., not by the chart: the chart's
    APIService would send the API server to the Service's ClusterIP, which is not on loopback)."""
    restricted_namespace(crds, OPS)
    crds.helm("install", "kvgate-ops", "charts/kvgate", "--namespace", OPS, "--set", "operator.resyncSeconds=5",
              "--set", f"operator.watchNamespaces={{{NS},{SCALED},{KEYED},default}}", "--set", "metricsApi.enabled=true",
              "--set", "metricsApi.apiService=false", "--wait", "--timeout", "120s")  # fmt: skip
    yield crds
    # the operator removes its finalizers, so what is left goes before it does
    for md in crds.get("modeldeployments", "-A")["items"]:
        meta = md["metadata"]
        crds.delete("modeldeployment", meta["name"], meta["namespace"], within=120)
    crds.helm("uninstall", "kvgate-ops", "--namespace", OPS, "--wait", check=False)
    # the next files on this worker (e2e/test_operator_pods.py) bind port 8000 on every address:
    # every engine this module made must be gone first, its draining included
    eventually(
        lambda: not crds.get("pods", "-A", "-l", "kvgate.dev/model-deployment")["items"],
        180,
        "every pod of the module's ModelDeployments gone",
    )


def model_claim(namespace: str, folder: Path) -> list[dict[str, Any]]:
    """A PersistentVolume (hostPath: the default model's tokenizer, all a simulated engine
    needs) and the claim the ModelDeployment mounts as pvc://models/tiny."""
    (folder / "tiny").mkdir()
    for name, data in default_tokenizer_files().items():
        if name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            (folder / "tiny" / name).write_bytes(data)
    folder.chmod(0o755)
    return [
        {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{namespace}-models"},
         "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                  "hostPath": {"path": str(folder)}}},
        {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": namespace},
         "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": f"{namespace}-models",
                  "resources": {"requests": {"storage": "1Gi"}}}},
    ]  # fmt: skip


def apply(cluster: Cluster, docs: list[dict[str, Any]]) -> None:
    cluster.kubectl("apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": docs}))


def start_envoy(served: Served, log_dir: Path) -> harness.Envoy:
    epp_ips = [p["status"]["podIP"] for p in served.pods(EPPS)]
    envoy = harness.start_envoy(
        log_dir, 9002, None, epp_addresses=[f"{ip}:9002" for ip in epp_ips], epp_health_ports=[9003] * len(epp_ips),
        epp_tls=True,
    )  # fmt: skip
    envoy.wait_ready()
    envoy.wait_epp_healthy()
    return envoy


@dataclass
class Traffic:
    """Requests through Envoy, one after another from a thread, every answer kept."""

    url: str
    statuses: Counter[int] = field(default_factory=Counter)
    upstreams: Counter[str] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def one(self, client: httpx.Client, i: int) -> httpx.Response:
        body = {"model": MD, "prompt": f"request {i}: tell me a story", "max_tokens": 8}
        return client.post(f"{self.url}/v1/completions", json=body, timeout=60)

    def _run(self) -> None:
        with httpx.Client() as client:
            i = 0
            while not self._stop.is_set():
                i += 1
                try:
                    resp = self.one(client, i)
                except httpx.HTTPError as exc:
                    self.errors.append(repr(exc))
                    continue
                self.statuses[resp.status_code] += 1
                self.upstreams[resp.headers.get("x-kvgate-upstream", "?")] += 1
                if resp.status_code != 200:
                    self.errors.append(f"{resp.status_code} {resp.text[:300]}")

    def __enter__(self) -> Traffic:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        assert self._thread is not None
        self._thread.join(90)


@dataclass
class Served:
    cluster: Cluster
    namespace: str = NS
    envoy: harness.Envoy = field(init=False)

    def pods(self, selector: str, ready_only: bool = True) -> list[dict[str, Any]]:
        items = self.cluster.get("pods", "-n", self.namespace, "-l", selector)["items"]
        live = [p for p in items if not p["metadata"].get("deletionTimestamp")]
        return [p for p in live if pod_ready(p)] if ready_only else live

    def patch(self, spec: dict[str, Any]) -> None:
        self.cluster.kubectl("patch", "modeldeployment", MD, "-n", self.namespace, "--type", "merge", "-p",
                             json.dumps({"spec": spec}))  # fmt: skip

    def rolled_out(self, replicas: int) -> bool:
        dep = self.cluster.get("deployment", MD, "-n", self.namespace)
        status = dep.get("status") or {}
        return (
            dep["spec"].get("replicas") == replicas
            and status.get("observedGeneration") == dep["metadata"]["generation"]
            and status.get("updatedReplicas") == replicas
            and status.get("readyReplicas") == replicas
            and status.get("replicas") == replicas  # old pods gone
            and len(self.pods(ENGINES)) == replicas
        )

    def epp_sees(self) -> list[set[str]]:
        """The engine pods each EPP replica routes to, from its own metrics."""
        seen = []
        for epp in self.pods(EPPS):
            text = httpx.get(f"http://{epp['status']['podIP']}:9090/metrics", timeout=5).text
            seen.append(
                set(re.findall(r'inference_pool_per_pod_queue_size\{[^}]*model_server_pod="([^"]+)"', text))
            )
        return seen


@pytest.fixture(scope="module")
def served(operator: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    cluster = operator
    restricted_namespace(cluster, NS)
    md = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": MD, "namespace": NS},
          "spec": {"model": {"source": "pvc://models/tiny", "servedName": MD},
                   "engine": {"accelerator": "none", "drainSeconds": 2, "args": ["--simulate"]},
                   "replicas": 2, "httpRoute": {"parentRefs": [{"name": "kvgate", "namespace": "default"}]}}}  # fmt: skip
    apply(cluster, [*model_claim(NS, tmp_path_factory.mktemp("models")), md])
    served = Served(cluster)
    eventually(lambda: len(served.pods(ENGINES)) == 2 and len(served.pods(EPPS)) == 2, 180,
               "two engine and two EPP pods Ready")  # fmt: skip
    served.envoy = start_envoy(served, tmp_path_factory.mktemp("envoy"))
    try:
        yield served
    finally:
        served.envoy.proc.stop()


def test_the_operator_pod_turns_a_model_deployment_into_ready_pods_on_the_node(served: Served) -> None:
    cluster = served.cluster
    engines, epps = served.pods(ENGINES), served.pods(EPPS)
    ips = [p["status"]["podIP"] for p in engines + epps]
    assert len(set(ips)) == 4 and all(ip.startswith("127.10.") for ip in ips), ips
    assert {p["spec"]["nodeName"] for p in engines + epps} == {"kvgate-node"}

    def md_ready() -> dict[str, str]:
        status = cluster.get("modeldeployment", MD, "-n", NS).get("status") or {}
        conditions = {c["type"]: c["status"] for c in status.get("conditions", [])}
        return conditions if conditions.get("Ready") == "True" else {}

    eventually(md_ready, 60, "the ModelDeployment's Ready condition")
    table = cluster.kubectl("get", "modeldeployments", "-n", NS).stdout.splitlines()
    row = dict(zip(table[0].split(), table[1].split(), strict=False))
    assert row["READY"] == "2" and row["POOL"] == MD and row["ENDPOINTS"] == "2", table
    pools = cluster.kubectl("get", "inferencepools", "-n", NS).stdout.splitlines()
    assert pools[1].split()[0] == MD and "8000" in pools[1] and f"{MD}-epp" in pools[1], pools
    # the operator is the chart's pod, not a process of this test
    operator_pod = cluster.get("pods", "-n", OPS)["items"][0]
    assert pod_ready(operator_pod) and operator_pod["status"]["podIP"].startswith("127.10.")


def _processes_of(pod_name: str) -> list[int]:
    """The processes of a pod's containers, by the HOSTNAME its runtime gives them."""
    marker = f"HOSTNAME={pod_name}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker in (entry / "environ").read_bytes().split(b"\0"):
                    pids.append(int(entry.name))
            except OSError:
                continue  # gone, or a kernel thread
    return pids


def test_kvgates_pods_run_from_the_images_with_the_charts_security_context(served: Served) -> None:
    """Engine, EPP and operator pods run from the OCI archives `make images` built: the
    archive's digest as imageID, each process chrooted into its image's root, that root
    read-only, as uid 65532 with no capabilities and no_new_privs (the restricted profile the
    chart and the operator write)."""
    from kvgate.testing.oci_images import ImageStore

    if not served.cluster.images:
        pytest.skip("no OCI archives in dist/images: `make images` builds them (CI always does)")
    store = ImageStore(ROOT / "dist" / "images")
    operator_pods = served.cluster.get("pods", "-n", OPS)["items"]
    for pod in [*served.pods(ENGINES), *served.pods(EPPS), *operator_pods]:
        name = pod["metadata"]["name"]
        for status in pod["status"]["containerStatuses"]:
            archive = store.find(status["image"])
            assert archive is not None, status["image"]
            assert status["imageID"] == f"{archive.ref.rsplit(':', 1)[0]}@{archive.manifest_digest}", status
        pids = _processes_of(name)
        assert pids, f"no process of pod {name}"
        for pid in pids:
            assert os.readlink(f"/proc/{pid}/root") != "/", (
                f"pod {name}: pid {pid} is not in its image's root"
            )
            fields = dict(
                line.split(":\t", 1)
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line
            )
            assert fields["Uid"].split()[:2] == ["65532", "65532"], (name, fields["Uid"])
            assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0, (name, fields)
            assert fields["NoNewPrivs"].strip() == "1", name
            mounts = [line.split() for line in Path(f"/proc/{pid}/mountinfo").read_text().splitlines()]
            (root_mount,) = [m for m in mounts if m[4] == "/"][-1:]
            assert "ro" in root_mount[5].split(","), (name, root_mount)


def test_the_http_route_is_accepted_by_gateway_apis_own_crd(served: Served) -> None:
    """Gateway API's real CRDs (with their CEL rules), not our schema of them."""
    route = served.cluster.get("httproute", MD, "-n", NS)
    (rule,) = route["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        MD,
    )
    assert route["spec"]["parentRefs"][0] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "name": "kvgate",
        "namespace": "default",
    }
    assert route["metadata"]["ownerReferences"][0]["kind"] == "ModelDeployment"


def test_the_gateway_accepts_the_route_and_the_pool_and_serves_through_the_epp(served: Served) -> None:
    """The user's path: Envoy Gateway (scripts/cluster.sh's Gateway default/kvgate) reads the
    operator's HTTPRoute, kvgate's extension server turns the InferencePool backend into the
    EPP's ext_proc and an ORIGINAL_DST cluster, the pool's status says ACCEPTED True, and the
    `openai` client at the Gateway's address is answered by engines the EPP picked."""
    import openai

    cluster = served.cluster

    def route_accepted() -> bool:
        parents = (cluster.get("httproute", MD, "-n", NS).get("status") or {}).get("parents") or []
        return any(
            c["type"] == "Accepted" and c["status"] == "True"
            for p in parents
            for c in p.get("conditions", [])
        )

    eventually(route_accepted, 60, "Envoy Gateway accepting the HTTPRoute")

    def pool_accepted() -> list[str]:
        table = cluster.kubectl("get", "inferencepools", MD, "-n", NS).stdout.splitlines()
        row = dict(zip(table[0].split(), table[1].split(), strict=False))
        return [row["ACCEPTED"]] if row.get("ACCEPTED") == "True" else []

    eventually(pool_accepted, 60, "kubectl get inferencepools saying ACCEPTED True")
    (parent,) = cluster.get("inferencepool", MD, "-n", NS)["status"]["parents"]
    assert parent["parentRef"]["name"] == "kvgate" and parent["parentRef"]["namespace"] == "default"
    assert {c["type"]: c["status"] for c in parent["conditions"]} == {
        "Accepted": "True",
        "ResolvedRefs": "True",
    }

    gateway = cluster.get("gateway", "kvgate", "-n", "default")
    address = gateway["status"]["addresses"][0]["value"]
    assert address.startswith("127.11."), address  # the node's load balancer, on loopback
    client = openai.OpenAI(base_url=f"http://{address}/v1", api_key="unused", max_retries=0, timeout=30)

    def served_by_engines() -> float:
        total = 0.0
        for engine in served.pods(ENGINES):
            text = httpx.get(f"http://{engine['status']['podIP']}:8000/metrics", timeout=5).text
            total += sum(
                float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)
            )
        return total

    def picked_by_epps() -> float:
        total = 0.0
        for epp in served.pods(EPPS):
            text = httpx.get(f"http://{epp['status']['podIP']}:9090/metrics", timeout=5).text
            total += sum(
                float(v)
                for v in re.findall(r"^inference_objective_request_total\{[^}]*\} (\S+)$", text, re.M)
            )
        return total

    def answered() -> bool:
        try:
            return bool(client.completions.create(model=MD, prompt="warm up", max_tokens=2).choices)
        except openai.APIError:
            return False

    eventually(answered, 60, "a completion through the Gateway")  # the proxy's xDS settling
    engines_before, epps_before = served_by_engines(), picked_by_epps()
    for i in range(8):
        assert (
            client.completions.create(model=MD, prompt=f"through the gateway {i}", max_tokens=4)
            .choices[0]
            .text
        )
    chunks = list(
        client.chat.completions.create(
            model=MD, messages=[{"role": "user", "content": "stream please"}], max_tokens=6, stream=True
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    # every request was picked by the pool's EPP and answered by one of the pool's engines
    assert picked_by_epps() - epps_before >= 9
    assert served_by_engines() - engines_before >= 9


def test_a_pool_whose_epp_is_gone_follows_its_failure_mode_and_a_forged_endpoint_goes_nowhere(
    served: Served,
) -> None:
    """Two InferencePools over the module's engines whose EPP does not exist, behind the
    Gateway: the FailClose one answers 503; the FailOpen one is served by the pool's engines
    (round robin through the shadow Service the extension keeps, owned by the pool and gone
    with it). A client's own x-gateway-destination-endpoint, which an ORIGINAL_DST cluster would
    follow to any address, reaches nothing on either (stripped before the EPP; and a FailOpen
    pool's cluster holds only its own endpoints)."""
    import http.server

    cluster = served.cluster
    hits: list[str] = []

    class Canary(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            hits.append(self.path)
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    canary = http.server.ThreadingHTTPServer(("127.0.0.7", 0), Canary)  # not 127.0.0.1: the proxy's own
    threading.Thread(target=canary.serve_forever, daemon=True).start()

    def orphan(name: str, mode: str) -> list[dict[str, Any]]:
        pool = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": name, "namespace": NS},
            "spec": {
                "selector": {"matchLabels": {"kvgate.dev/model-deployment": MD, "kvgate.dev/role": "engine"}},
                "targetPorts": [{"number": 8000}],
                "endpointPickerRef": {"name": "no-such-epp", "port": {"number": 9002}, "failureMode": mode},
            },
        }
        route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": name, "namespace": NS},
                 "spec": {"parentRefs": [{"name": "kvgate", "namespace": "default"}],
                          "rules": [{"matches": [{"headers": [{"name": "x-test-pool", "value": name}]}],
                                     "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                      "name": name}]}]}}  # fmt: skip
        return [pool, route]

    apply(cluster, orphan("orphan-closed", "FailClose") + orphan("orphan-open", "FailOpen"))
    try:
        address = cluster.get("gateway", "kvgate", "-n", "default")["status"]["addresses"][0]["value"]
        body = {"model": MD, "prompt": "where does this go", "max_tokens": 2}

        def status(pool: str, forged: bool = False) -> int:
            headers = {"x-test-pool": pool}
            if forged:
                headers["x-gateway-destination-endpoint"] = f"127.0.0.7:{canary.server_port}"
            return httpx.post(
                f"http://{address}/v1/completions", json=body, headers=headers, timeout=30
            ).status_code

        eventually(lambda: status("orphan-closed") == 503, 90, "the FailClose orphan's route answering 503")
        assert [status("orphan-closed", forged=True) for _ in range(5)] == [503] * 5
        eventually(
            lambda: status("orphan-open") == 200, 90, "the FailOpen orphan served by the pool's engines"
        )
        assert [status("orphan-open", forged=i % 2 == 0) for i in range(6)] == [200] * 6
        assert hits == [], f"a forged endpoint was followed: {hits}"
        uid = cluster.get("inferencepool", "orphan-open", "-n", NS)["metadata"]["uid"]
        (shadow,) = [
            svc
            for svc in cluster.get("services", "-n", NS)["items"]
            if (svc["metadata"].get("labels") or {}).get("kvgate.dev/inference-pool") == "orphan-open"
        ]
        assert shadow["spec"]["clusterIP"] == "None"
        assert [(o["kind"], o["uid"]) for o in shadow["metadata"]["ownerReferences"]] == [
            ("InferencePool", uid)
        ]
        # the module's own pool is untouched by the orphans' routes
        assert httpx.post(f"http://{address}/v1/completions", json=body, timeout=30).status_code == 200
        cluster.delete("inferencepool", "orphan-open", NS, within=60)
        eventually(
            lambda: (
                not cluster.kubectl(
                    "get", "service", shadow["metadata"]["name"], "-n", NS, check=False
                ).stdout
            ),
            60,
            "the shadow Service garbage-collected with its pool",
        )
    finally:
        canary.shutdown()
        for name in ("orphan-closed", "orphan-open"):
            cluster.kubectl("delete", "httproute", name, "-n", NS, "--wait=false", check=False)
            cluster.kubectl("delete", "inferencepool", name, "-n", NS, "--wait=false", check=False)


def _wildcard_listeners() -> set[int]:
    """Ports listened on at every address (0.0.0.0 or ::) in this network namespace."""
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            address, _, port = fields[1].partition(":")
            if fields[3] == "0A" and set(address) == {"0"}:  # LISTEN
                ports.add(int(port, 16))
    return ports


def test_a_gateway_a_user_writes_in_another_namespace_serves_the_pool_too(served: Served) -> None:
    """A second Gateway (its own namespace, listener port 80, as a user writes it) gets a proxy
    pod of its own beside the first (both shutdown-managers on port 19002), a loopback address
    of its own, and serves an HTTPRoute to the same InferencePool through its EPP."""
    cluster = served.cluster
    cluster.kubectl("create", "namespace", "team-a")
    gateway = {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "Gateway",
        "metadata": {"name": "edge", "namespace": "team-a"},
        "spec": {
            "gatewayClassName": "kvgate",
            "listeners": [
                {
                    "name": "http",
                    "protocol": "HTTP",
                    "port": 80,
                    "allowedRoutes": {"namespaces": {"from": "All"}},
                }
            ],
        },
    }
    route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
             "metadata": {"name": "via-edge", "namespace": NS},
             "spec": {"parentRefs": [{"name": "edge", "namespace": "team-a"}],
                      "rules": [{"backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                  "name": MD}]}]}}  # fmt: skip
    apply(cluster, [gateway, route])
    try:

        def programmed() -> str:
            status = cluster.get("gateway", "edge", "-n", "team-a").get("status") or {}
            ok = any(
                c["type"] == "Programmed" and c["status"] == "True" for c in status.get("conditions", [])
            )
            return str(status["addresses"][0]["value"]) if ok and status.get("addresses") else ""

        address = eventually(programmed, 120, "the second Gateway Programmed")
        first = cluster.get("gateway", "kvgate", "-n", "default")["status"]["addresses"][0]["value"]
        assert address.startswith("127.11.") and address != first, (address, first)
        body = {"model": MD, "prompt": "through the second gateway", "max_tokens": 4}

        def answered() -> bool:
            return httpx.post(f"http://{address}/v1/completions", json=body, timeout=30).status_code == 200

        eventually(answered, 90, "a completion through the second Gateway")
        proxies = cluster.get("pods", "-n", "envoy-gateway-system")["items"]
        assert len(proxies) == 2 and all(pod_ready(p) for p in proxies), [
            (p["metadata"]["name"], p["status"].get("containerStatuses")) for p in proxies
        ]
        # each shutdown-manager serves its own pod's 19002: none holds the port on every address
        # of the node (where the other pod's probes and preStop hook would reach it instead);
        # nor does the operator pod its liveness (8080) and metrics API (6443) ports
        assert not {19002, 8080, 6443} & _wildcard_listeners()
        # the first Gateway still serves
        assert httpx.post(f"http://{first}/v1/completions", json=body, timeout=30).status_code == 200
    finally:
        cluster.kubectl("delete", "httproute", "via-edge", "-n", NS, "--wait=false", check=False)
        cluster.kubectl("delete", "namespace", "team-a", "--wait=false", check=False)


def test_an_http_route_split_by_weight_between_two_pools_moves_traffic_in_proportion(
    served: Served, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A canary as a user writes it: a second ModelDeployment serving the same model name, one
    HTTPRoute rule with both InferencePools as weighted backendRefs (each pool's own EPP picks
    within it), then the weights edited. Counted at the engines (vllm:request_success_total of
    each pool's pods), the share follows the weights within binomial noise (200 requests a phase:
    3.5 standard deviations)."""
    cluster = served.cluster
    canary = "tiny-canary"
    canary_engines = f"kvgate.dev/model-deployment={canary},kvgate.dev/role=engine"
    canary_epps = f"kvgate.dev/model-deployment={canary},kvgate.dev/role=epp"
    md = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": canary, "namespace": NS},
          "spec": {"model": {"source": "pvc://models/tiny", "servedName": MD},
                   "engine": {"accelerator": "none", "drainSeconds": 2, "args": ["--simulate"]},
                   "replicas": 1, "routing": {"eppReplicas": 1}}}  # fmt: skip

    def route(stable: int, new: int) -> dict[str, Any]:
        refs = [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": name, "weight": w}
                for name, w in ((MD, stable), (canary, new))]  # fmt: skip
        return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
                "metadata": {"name": "split", "namespace": NS},
                "spec": {"parentRefs": [{"name": "kvgate", "namespace": "default"}],
                         "rules": [{"matches": [{"headers": [{"name": "x-test-pool", "value": "split"}]}],
                                    "backendRefs": refs}]}}  # fmt: skip

    def successes(selector: str) -> float:
        total = 0.0
        for engine in served.pods(selector):
            text = httpx.get(f"http://{engine['status']['podIP']}:8000/metrics", timeout=5).text
            total += sum(
                float(v) for v in re.findall(r"^vllm:request_success_total\{[^}]*\} (\S+)$", text, re.M)
            )
        return total

    address = cluster.get("gateway", "kvgate", "-n", "default")["status"]["addresses"][0]["value"]
    body = {"model": MD, "prompt": "which pool", "max_tokens": 2}

    def canary_share(n: int) -> float:
        before = successes(canary_engines)
        with httpx.Client(timeout=30) as client:
            for i in range(n):
                resp = client.post(
                    f"http://{address}/v1/completions",
                    json={**body, "prompt": f"which pool {i}"},
                    headers={"x-test-pool": "split"},
                )
                assert resp.status_code == 200, resp.text
        return (successes(canary_engines) - before) / n

    apply(cluster, [md, route(4, 1)])
    try:
        eventually(
            lambda: len(served.pods(canary_engines)) == 1 and len(served.pods(canary_epps)) == 1,
            180,
            "the canary's engine and EPP Ready",
        )

        def both_pools_serve() -> bool:
            share = canary_share(20)  # a failure is shown if time runs out
            assert 0 < share < 1, f"canary share {share}"
            return True

        eventually(both_pools_serve, 120, "the split route serving from both pools")
        share = canary_share(200)
        assert abs(share - 0.2) < 0.1, share
        apply(cluster, [route(1, 3)])  # the canary goes to 75%
        eventually(lambda: canary_share(40) > 0.5, 60, "the edited weights in force")
        share = canary_share(200)
        assert abs(share - 0.75) < 0.11, share
        # the pools' own EPPs picked: the stable pool's engines served the rest
        assert successes(ENGINES) > 0
    finally:
        cluster.kubectl("delete", "httproute", "split", "-n", NS, "--wait=false", check=False)
        cluster.delete("modeldeployment", canary, NS, within=120)


def test_a_request_goes_through_envoy_and_an_epp_that_found_the_engines_by_watch(served: Served) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{served.envoy.url}/v1", api_key="unused", max_retries=0)
    engines = {f"{p['status']['podIP']}:8000" for p in served.pods(ENGINES)}
    seen = set()
    for i in range(8):
        raw = client.completions.with_raw_response.create(model=MD, prompt=f"hello {i}", max_tokens=4)
        assert raw.parse().choices[0].text
        seen.add(raw.headers["x-kvgate-upstream"])
    assert seen <= engines, (seen, engines)
    names = {p["metadata"]["name"] for p in served.pods(ENGINES)}
    assert all(view == names for view in served.epp_sees()), (served.epp_sees(), names)


def test_edits_roll_without_a_failed_request(served: Served) -> None:
    before = {p["metadata"]["name"] for p in served.pods(ENGINES)}
    with Traffic(served.envoy.url) as traffic:
        served.patch({"engine": {"args": ["--simulate", "--max-num-seqs", "64"]}})
        eventually(lambda: served.rolled_out(2) and not before & {p["metadata"]["name"] for p in served.pods(ENGINES)},
                   240, "the engines replaced with the new args")  # fmt: skip
        new = {f"{p['status']['podIP']}:8000" for p in served.pods(ENGINES)}
        eventually(lambda: set(traffic.upstreams) & new, 60, "traffic on the new engines")
        served.patch({"replicas": 3})
        eventually(lambda: served.rolled_out(3), 120, "scaled to 3")
        served.patch({"replicas": 1})
        eventually(lambda: served.rolled_out(1), 120, "scaled to 1")
    assert traffic.statuses[200] >= 20 and not traffic.errors, (traffic.statuses, traffic.errors[:5])
    dep = served.cluster.get("deployment", MD, "-n", NS)
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[-3:] == ["--simulate", "--max-num-seqs", "64"], args


def _pids(pattern: str) -> list[int]:
    done = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(p) for p in done.stdout.split()]


def test_the_operator_sigkilled_mid_edit_is_restarted_and_converges(served: Served) -> None:
    (pid,) = _pids("kvgate operator run .*--resync-seconds=5")
    os.kill(pid, signal.SIGKILL)
    served.patch({"replicas": 3})  # written while no operator runs

    def restarted() -> bool:
        pod = served.cluster.get("pods", "-n", OPS)["items"][0]
        status = pod["status"]["containerStatuses"][0]
        return status["restartCount"] >= 1 and status["ready"]

    eventually(restarted, 60, "the node restarted the operator's container")
    eventually(lambda: served.rolled_out(3), 120, "the restarted operator applied the edit")
    served.patch({"replicas": 2})
    eventually(lambda: served.rolled_out(2), 120, "back to 2")


def test_a_concurrent_writer_of_the_engine_deployment_is_overruled(served: Served) -> None:
    """Another writer (`kubectl scale`, a hand edit) changes what the operator owns: the operator
    sees it through its Deployment watch and puts its spec back; its merge patches carry no
    resourceVersion, so they never fail with 409 against the other writer's."""
    cluster = served.cluster
    wanted = cluster.get("deployment", MD, "-n", NS)["spec"]["template"]["spec"]["containers"][0]["args"]
    cluster.kubectl("scale", "deployment", MD, "-n", NS, "--replicas=4")
    cluster.kubectl("patch", "deployment", MD, "-n", NS, "--type", "json", "-p",
                    json.dumps([{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--seed=7"}]))  # fmt: skip

    def restored() -> bool:
        dep = cluster.get("deployment", MD, "-n", NS)
        return dep["spec"]["template"]["spec"]["containers"][0]["args"] == wanted and served.rolled_out(2)

    eventually(restored, 120, "the operator restored the replicas and args it wants")


def test_an_adapter_added_and_removed_under_traffic(served: Served) -> None:
    """spec.adapters: the engines roll to --enable-lora, the operator loads the adapter into each
    Ready engine pod (its readiness gate, patched into the pod status the node reports), the EPP
    routes the adapter's name to them; removed, it is unloaded and its name is refused. Requests
    for the base model never fail meanwhile."""
    with Traffic(served.envoy.url) as traffic:
        served.patch({"lora": {"maxLoras": 2, "maxLoraRank": 8},
                      "adapters": [{"name": "sql", "source": "/adapters/sql"}]})  # fmt: skip

        def adapter_served() -> bool:
            body = {"model": "sql", "prompt": "select", "max_tokens": 2}
            return served.rolled_out(2) and httpx.post(f"{served.envoy.url}/v1/completions", json=body,
                                                       timeout=30).status_code == 200  # fmt: skip

        eventually(adapter_served, 240, "the adapter served on the rolled engines")
        gates = {
            g["conditionType"] for p in served.pods(ENGINES) for g in p["spec"].get("readinessGates", [])
        }
        assert gates == {"kvgate.dev/lora-adapters"}, gates
        served.patch({"adapters": None})

        def adapter_refused() -> bool:
            body = {"model": "sql", "prompt": "select", "max_tokens": 2}
            return httpx.post(f"{served.envoy.url}/v1/completions", json=body, timeout=30).status_code == 404

        eventually(adapter_refused, 120, "the adapter's name refused once it is removed")
    assert traffic.statuses[200] >= 10 and not traffic.errors, (traffic.statuses, traffic.errors[:5])


def test_the_api_server_sigkilled_under_every_watch_is_ridden_out(served: Served) -> None:
    cluster = served.cluster
    pid = int((cluster.kubeconfig.parent / "kube-apiserver.pid").read_text())
    os.kill(pid, signal.SIGKILL)
    # scripts/cluster.sh restarts it; meanwhile the watches of the operator, both EPPs, the
    # controllers and the node are cut
    eventually(lambda: int((cluster.kubeconfig.parent / "kube-apiserver.pid").read_text()) != pid, 30,
               "the API server restarted")  # fmt: skip
    eventually(lambda: cluster.kubectl("get", "--raw", "/readyz", check=False).returncode == 0, 120,
               "the API server ready again")  # fmt: skip
    with Traffic(served.envoy.url) as traffic:
        served.patch({"replicas": 3})  # the operator must see it: its watch resumed
        eventually(lambda: served.rolled_out(3), 180, "the operator acted on an edit made after the restart")
        names = {p["metadata"]["name"] for p in served.pods(ENGINES)}
        # both EPPs must see the new pod: their pod watches resumed too
        eventually(lambda: all(view == names for view in served.epp_sees()), 60, "every EPP sees the new pod")
        served.patch({"replicas": 2})
        eventually(lambda: served.rolled_out(2), 120, "back to 2")
        names = {p["metadata"]["name"] for p in served.pods(ENGINES)}
        eventually(
            lambda: all(view == names for view in served.epp_sees()), 60, "every EPP forgot the old pod"
        )
    assert traffic.statuses[200] >= 5 and not traffic.errors, (traffic.statuses, traffic.errors[:5])


def test_deleting_the_model_deployment_stops_every_process(served: Served) -> None:
    cluster = served.cluster
    roots = [Path(p) for p in _pids_with_pod_folders()]
    assert roots, "no pod process found"
    cluster.delete("modeldeployment", MD, NS, 120)
    eventually(lambda: not cluster.get("pods", "-n", NS)["items"], 120, "every pod gone")
    left = cluster.get("deployments,services,inferencepools,configmaps,serviceaccounts", "-n", NS,
                       "-l", f"kvgate.dev/model-deployment={MD}")["items"]  # fmt: skip
    assert not left, [i["metadata"]["name"] for i in left]
    eventually(
        lambda: not [p for p in _pids_with_pod_folders() if f"/{NS}_" in p], 30, "no process of the pods left"
    )


def _pids_with_pod_folders() -> list[str]:
    """The log file of every live container process the node started (its stdout)."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            target = os.readlink(proc / "fd" / "1")
        except OSError:
            continue
        if "/node/pods/" in target:
            out.append(target)
    return out


def register_metrics_api(cluster: Cluster) -> None:
    """The APIService for the operator's External Metrics API, through an ExternalName Service
    naming the operator pod's loopback address (a ClusterIP is never dialled here)."""
    (pod,) = cluster.get("pods", "-n", OPS)["items"]
    port = next(
        p["containerPort"] for p in pod["spec"]["containers"][0]["ports"] if p["name"] == "metrics-api"
    )
    apply(cluster, [
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "kvgate-metrics-api", "namespace": OPS},
         "spec": {"type": "ExternalName", "externalName": pod["status"]["podIP"], "ports": [{"port": port}]}},
        {"apiVersion": "apiregistration.k8s.io/v1", "kind": "APIService",
         "metadata": {"name": "v1beta1.external.metrics.k8s.io"},
         "spec": {"group": "external.metrics.k8s.io", "version": "v1beta1", "insecureSkipTLSVerify": True,
                  "groupPriorityMinimum": 100, "versionPriority": 100,
                  "service": {"name": "kvgate-metrics-api", "namespace": OPS, "port": port}}},
    ])  # fmt: skip

    def available() -> bool:
        status = cluster.get("apiservice", "v1beta1.external.metrics.k8s.io").get("status") or {}
        return any(c["type"] == "Available" and c["status"] == "True" for c in status.get("conditions", []))

    eventually(available, 60, "the External Metrics APIService Available")


def test_an_hpa_scales_the_engines_on_the_pools_queue_and_the_drain_loses_nothing(
    operator: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """kube-controller-manager's HPA controller, through the aggregation layer, on the
    operator's External Metrics API, which reads the pool's queue from its EPP replicas."""
    cluster = operator
    register_metrics_api(cluster)
    restricted_namespace(cluster, SCALED)
    md = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": MD, "namespace": SCALED},
          "spec": {"model": {"source": "pvc://models/tiny", "servedName": MD},
                   "engine": {"accelerator": "none", "drainSeconds": 2,
                              "args": ["--simulate", "--max-num-seqs", "1", "--sim-itl", "0.05"]},
                   "autoscaling": {"backend": "hpa", "minReplicas": 1, "maxReplicas": 3, "metric": "queue-size",
                                   "target": "2", "scaleDownStabilizationSeconds": 10}}}  # fmt: skip
    apply(cluster, [*model_claim(SCALED, tmp_path_factory.mktemp("models")), md])
    scaled = Served(cluster, SCALED)
    eventually(
        lambda: len(scaled.pods(ENGINES)) == 1 and len(scaled.pods(EPPS)) == 2, 180, "one engine, two EPPs"
    )
    metric = f"/apis/external.metrics.k8s.io/v1beta1/namespaces/{SCALED}/inference_pool_average_queue_size"

    def value() -> list[dict[str, Any]]:
        got = json.loads(cluster.kubectl("get", "--raw", f"{metric}?labelSelector=name%3D{MD}").stdout)
        return list(got["items"])

    (item,) = eventually(value, 60, "the pool's queue through the aggregation layer")
    assert item["metricLabels"] == {"name": MD} and item["value"] == "0", item
    scaled.envoy = start_envoy(scaled, tmp_path_factory.mktemp("envoy"))
    try:
        burst = [Traffic(scaled.envoy.url) for _ in range(12)]
        for t in burst:
            t.__enter__()
        try:
            eventually(lambda: scaled.rolled_out(3), 180, "the HPA scaled the engines up to 3")
        finally:
            for t in burst:
                t.__exit__()
        hpa = cluster.get("hpa", MD, "-n", SCALED)
        assert hpa["status"]["desiredReplicas"] >= 2, hpa["status"]
        # the load gone, the HPA scales down; requests go on meanwhile and none may fail
        with Traffic(scaled.envoy.url) as light:
            eventually(lambda: scaled.rolled_out(1), 180, "the HPA scaled back down to 1")
        every = [*burst, light]
        failed = [e for t in every for e in t.errors]
        assert sum(t.statuses[200] for t in every) >= 30 and not failed, failed[:5]
    finally:
        scaled.envoy.proc.stop()
        cluster.delete("modeldeployment", MD, SCALED, within=120)  # while the operator can finalize it


def test_with_tenants_only_a_request_the_epp_picked_reaches_an_engine(
    operator: Cluster, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """spec.tenants: the operator makes the engines' own key (Secret <name>-engine-key, owned by
    the ModelDeployment) and gives it to the engine and EPP pods; a process that reaches an
    engine pod's port directly gets 401 with no key or with a tenant's, while a tenant's key
    through Envoy and the EPP is served (the EPP swaps in the engines' key)."""
    import base64

    cluster = operator
    restricted_namespace(cluster, KEYED)
    alice = "sk-alice-cluster-0123456789abcdef"
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tenants", "namespace": KEYED},
        "stringData": {"tenants.yaml": f"- {{name: alice, key: {alice}}}\n"},
    }
    md = {"apiVersion": "kvgate.dev/v1alpha1", "kind": "ModelDeployment", "metadata": {"name": MD, "namespace": KEYED},
          "spec": {"model": {"source": "pvc://models/tiny", "servedName": MD},
                   "engine": {"accelerator": "none", "drainSeconds": 2, "args": ["--simulate"]},
                   "replicas": 1, "tenants": {"secretName": "tenants"}}}  # fmt: skip
    apply(cluster, [*model_claim(KEYED, tmp_path_factory.mktemp("models")), secret, md])
    keyed = Served(cluster, KEYED)
    try:
        eventually(
            lambda: len(keyed.pods(ENGINES)) == 1 and len(keyed.pods(EPPS)) == 2, 180, "one engine, two EPPs"
        )
        made = cluster.get("secret", f"{MD}-engine-key", "-n", KEYED)
        (owner,) = made["metadata"]["ownerReferences"]
        assert owner["kind"] == "ModelDeployment" and owner["name"] == MD
        engine_key = base64.b64decode(made["data"]["api-key"]).decode()
        (engine,) = keyed.pods(ENGINES)
        direct = f"http://{engine['status']['podIP']}:8000/v1/completions"
        body = {"model": MD, "prompt": "hello", "max_tokens": 2}
        for headers in ({}, {"authorization": f"Bearer {alice}"}):
            resp = httpx.post(direct, json=body, headers=headers, timeout=30)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", resp.text
        assert (
            httpx.post(
                direct, json=body, headers={"authorization": f"Bearer {engine_key}"}, timeout=30
            ).status_code
            == 200
        )
        keyed.envoy = start_envoy(keyed, tmp_path_factory.mktemp("envoy"))
        try:
            through = f"{keyed.envoy.url}/v1/completions"
            assert httpx.post(through, json=body, timeout=30).status_code == 401
            resp = httpx.post(through, json=body, headers={"authorization": f"Bearer {alice}"}, timeout=30)
            assert resp.status_code == 200 and resp.json()["choices"][0]["text"], resp.text

            # Key rotation: the Secret changes, no pod restarts; the node brings the volume up
            # to date and both EPPs reload the file. Several requests in a row each way, so
            # both replicas are seen to hold the new keys.
            def codes(key: str) -> set[int]:
                auth = {"authorization": f"Bearer {key}"}
                return {
                    httpx.post(through, json=body, headers=auth, timeout=30).status_code for _ in range(6)
                }

            rotated = "sk-alice-rotated-fedcba9876543210"
            restarts = {
                p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
                for p in keyed.pods(EPPS)
            }
            patch = {"stringData": {"tenants.yaml": f"- {{name: alice, key: {rotated}}}\n"}}
            cluster.kubectl(
                "patch", "secret", "tenants", "-n", KEYED, "--type", "merge", "-p", json.dumps(patch)
            )
            eventually(
                lambda: codes(rotated) == {200} and codes(alice) == {401}, 60, "the rotated key in force"
            )
            assert {
                p["metadata"]["name"]: p["status"]["containerStatuses"][0]["restartCount"]
                for p in keyed.pods(EPPS)
            } == restarts
        finally:
            keyed.envoy.proc.stop()

        # The same through Envoy Gateway: an HTTPRoute of the tenants' namespace on the cluster's
        # Gateway; the EPP's 401 comes back through it, a tenant's key is served.
        route = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute", "metadata": {"name": "keyed", "namespace": KEYED},
                 "spec": {"parentRefs": [{"name": "kvgate", "namespace": "default"}],
                          "rules": [{"matches": [{"headers": [{"name": "x-test-pool", "value": "keyed"}]}],
                                     "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                                                      "name": MD}]}]}}  # fmt: skip
        apply(cluster, [route])
        address = cluster.get("gateway", "kvgate", "-n", "default")["status"]["addresses"][0]["value"]

        def through_gateway(key: str | None) -> httpx.Response:
            headers = {"x-test-pool": "keyed", **({"authorization": f"Bearer {key}"} if key else {})}
            return httpx.post(f"http://{address}/v1/completions", json=body, headers=headers, timeout=30)

        eventually(
            lambda: through_gateway(rotated).status_code == 200, 90, "a tenant served through the Gateway"
        )
        for key in (None, alice, engine_key):  # no key, a retired one, the engines' own: not a tenant's
            resp = through_gateway(key)
            assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key", resp.text
        assert through_gateway(rotated).json()["choices"][0]["text"]
    finally:
        cluster.kubectl("delete", "httproute", "keyed", "-n", KEYED, "--wait=false", check=False)
        cluster.delete("modeldeployment", MD, KEYED, within=120)


def test_the_readmes_example_model_deployment_answers_through_the_gateway(operator: Cluster) -> None:
    """README's path, as written: manifests/examples/modeldeployment-cluster.yaml (the default
    model from the PersistentVolume scripts/cluster.sh made, a real engine on the CPU) in the
    default namespace, then one completion through the Gateway's address. It runs after the
    module's own ModelDeployment is gone: both HTTPRoutes match every path on the Gateway's one
    listener, and Gateway API gives such a tie to the older route (several ModelDeployments
    share a listener by spec.httpRoute.matchModelName and a body-based router, not tested here)."""
    cluster = operator
    example = ROOT / "manifests" / "examples" / "modeldeployment-cluster.yaml"
    cluster.kubectl("apply", "-f", str(example))
    try:
        address = cluster.get("gateway", "kvgate", "-n", "default")["status"]["addresses"][0]["value"]
        body = {"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}

        def answer() -> dict[str, Any] | None:
            resp = httpx.post(f"http://{address}/v1/completions", json=body, timeout=60)
            return dict(resp.json()) if resp.status_code == 200 else None

        reply = eventually(answer, 300, "the example ModelDeployment answering through the Gateway")
        assert reply["model"] == "smollm2" and reply["choices"][0]["text"].strip(), reply
        assert reply["usage"]["completion_tokens"] == 8
        table = cluster.kubectl("get", "inferencepools", "smollm2", "-n", "default").stdout.splitlines()
        assert dict(zip(table[0].split(), table[1].split(), strict=False))["ACCEPTED"] == "True", table
        if cluster.images:
            (engine,) = [
                p
                for p in cluster.get("pods", "-n", "default", "-l", "kvgate.dev/role=engine")["items"]
                if pod_ready(p)
            ]
            assert engine["status"]["containerStatuses"][0]["imageID"].startswith(
                "ghcr.io/kvgate/engine@sha256:"
            )
    finally:
        cluster.delete("modeldeployment", "smollm2", "default", within=120)
        eventually(
            lambda: (
                not cluster.get("pods", "-n", "default", "-l", "kvgate.dev/model-deployment=smollm2")["items"]
            ),
            180,
            "the example's pods gone",
        )
        cluster.kubectl("delete", "-f", str(example), "--ignore-not-found", "--wait=false", check=False)
