"""The pod network of make cluster's node: the LD_PRELOAD view (kvgate/testing/podnet.c), the
cluster DNS and Services' endpoints (kvgate.testing.cluster_net), the TCP relay across a network
namespace (kvgate.testing.netns_relay), and the kubelet's $(VAR) expansion and secret volumes."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import dns.rdatatype
import pytest

from kvgate.testing import cluster_net, netns_relay
from kvgate.testing import pods as pod_process

ROOT = Path(__file__).resolve().parents[2]
PODNET = ROOT / ".tools" / "lib" / "kvgate-podnet.so"

PROBE = r"""
import socket, sys
a = socket.socket(); a.bind(("0.0.0.0", 0)); a.listen()
b = socket.socket(); b.bind(("127.0.0.1", 0)); b.listen()
c = socket.socket(); c.bind(("127.0.0.3", 0))
u = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); u.bind("\0kvgate-probe")
client = socket.create_connection(("127.0.0.1", b.getsockname()[1]))
print(a.getsockname()[0], b.getsockname()[0], c.getsockname()[0], client.getpeername()[0], repr(u.getsockname()))
"""


@pytest.mark.skipif(not PODNET.exists(), reason="scripts/setup.sh builds .tools/lib/kvgate-podnet.so")
def test_podnet_gives_a_process_its_pods_address() -> None:
    env = {"LD_PRELOAD": str(PODNET), "KVGATE_POD_IP": "127.10.9.9", "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    every, loopback, other, peer, unix = done.stdout.split(maxsplit=4)
    assert (every, loopback, peer) == ("127.10.9.9",) * 3
    assert other == "127.0.0.3"  # any other address is left alone
    assert "kvgate-probe@127.10.9.9" in unix  # abstract sockets are the pod's own
    # without a pod address it does nothing
    plain = subprocess.run(
        [sys.executable, "-c", PROBE],
        env={**env, "KVGATE_POD_IP": ""},
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert plain.stdout.split()[:2] == ["0.0.0.0", "127.0.0.1"], plain.stderr


BINDS_ONLY_PROBE = r"""
import socket, sys
a = socket.socket(); a.bind(("0.0.0.0", 0)); a.listen()
client = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print(a.getsockname()[0], client.getpeername()[0])
"""


@pytest.mark.skipif(not PODNET.exists(), reason="scripts/setup.sh builds .tools/lib/kvgate-podnet.so")
def test_podnet_binds_only_for_kvgates_pods_leaves_their_connects_on_the_node() -> None:
    """kvgate's own processes: a bind of every address takes the pod's (kopf's liveness server
    binds 0.0.0.0 in code), while a connect to 127.0.0.1 still reaches the node, where the API
    server is (here: this test's listener, which the pod's address does not have)."""
    env = {"LD_PRELOAD": str(PODNET), "KVGATE_POD_IP": "127.10.9.9", "KVGATE_PODNET_BINDS_ONLY": "1",
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    with socket.socket() as node:
        node.bind(("127.0.0.1", 0))
        node.listen()
        done = subprocess.run([sys.executable, "-c", BINDS_ONLY_PROBE, str(node.getsockname()[1])], env=env,
                              capture_output=True, text=True, timeout=30)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["127.10.9.9", "127.0.0.1"], done.stdout


def _pod(name: str, ns: str, ip: str, labels: dict[str, str], ready: bool = True) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


SERVICES = [
    {
        "metadata": {"name": "engine", "namespace": "serve"},
        "spec": {"selector": {"app": "engine"}, "ports": [{"port": 80, "targetPort": "http"}]},
    },
    {
        "metadata": {"name": "empty", "namespace": "serve"},
        "spec": {"selector": {"app": "none"}, "ports": [{"port": 1}]},
    },
]
PODS = [
    _pod("a", "serve", "127.10.0.5", {"app": "engine"}),
    _pod("b", "serve", "127.10.0.6", {"app": "engine"}, ready=False),
    _pod("c", "other", "127.10.0.7", {"app": "engine"}),
    _pod("d", "serve", "10.0.0.9", {"app": "engine"}),  # never an address off loopback
]


def _net() -> cluster_net.ClusterNetwork:
    net = cluster_net.ClusterNetwork(
        None, {"envoy-gateway.envoy-gateway-system.svc.cluster.local.": "127.9.0.1"}
    )  # type: ignore[arg-type]
    net.backends = cluster_net.backends_of(SERVICES, PODS)
    net.services = {(s["metadata"]["namespace"], s["metadata"]["name"]): s for s in SERVICES}
    return net


def _ask(net: cluster_net.ClusterNetwork, name: str) -> dns.message.Message:
    wire = net.answer(dns.message.make_query(name, dns.rdatatype.A).to_wire())
    assert wire is not None
    return dns.message.from_wire(wire)


def test_services_resolve_to_their_ready_pods_on_loopback_only() -> None:
    net = _net()
    assert net.backends[("serve", "engine")].endpoints == [("127.10.0.5", {80: 8000})]
    reply = _ask(net, "engine.serve.svc.cluster.local.")
    assert [r.address for rrset in reply.answer for r in rrset] == ["127.10.0.5"]
    assert _ask(net, "empty.serve.svc.cluster.local.").answer == []  # a Service with no ready pod
    assert (
        _ask(net, "envoy-gateway.envoy-gateway-system.svc.cluster.local.").answer[0][0].address == "127.9.0.1"
    )


def test_other_names_are_nxdomain_and_garbage_gets_no_answer() -> None:
    net = _net()
    for name in ("example.com.", "missing.serve.svc.cluster.local.", "engine.svc.cluster.local."):
        assert _ask(net, name).rcode() == dns.rcode.NXDOMAIN
    assert net.answer(b"\x00\x01garbage") is None


def test_a_pods_resolv_conf_points_at_the_cluster_dns() -> None:
    text = cluster_net.resolv_conf("serve")
    assert f"nameserver {cluster_net.DNS_ADDRESS}" in text
    assert "search serve.svc.cluster.local svc.cluster.local cluster.local" in text


def test_the_kubelets_variable_expansion() -> None:
    env = {"POD": "envoy-1", "N": "3"}
    assert pod_process._expand("--service-node $(POD)", env) == "--service-node envoy-1"
    assert pod_process._expand("$(MISSING) $$(POD) $(N)", env) == "$(MISSING) $(POD) 3"


def test_secret_volumes_and_annotation_fields(tmp_path: Path) -> None:
    spec = {
        "volumes": [
            {"name": "certs", "secret": {"secretName": "envoy", "defaultMode": 0o400}},
            {"name": "sds", "configMap": {"name": "sds", "items": [{"key": "a.json", "path": "x/a.json"}]}},
        ],
        "containers": [],
    }
    pod = pod_process.Pod(
        spec=spec,
        root=tmp_path,
        name="p",
        namespace="n",
        image_env={},
        annotations={"topology.kubernetes.io/zone": "z1"},
        secrets={"envoy": {"tls.crt": "CERT", "tls.key": "KEY"}},
        config_maps={"sds": {"a.json": "{}", "b.json": "[]"}},
    )
    certs = pod.volume("certs")
    assert (certs / "tls.crt").read_text() == "CERT" and (certs / "tls.key").stat().st_mode & 0o777 == 0o400
    sds = pod.volume("sds")
    assert (sds / "x" / "a.json").read_text() == "{}" and not (sds / "b.json").exists()
    assert pod._field("metadata.annotations['topology.kubernetes.io/zone']") == "z1"
    assert pod._field("metadata.labels['absent']") == ""


def test_a_changed_secret_reaches_the_mounted_volume_whole_and_a_subpath_file_stays(tmp_path: Path) -> None:
    spec = {
        "volumes": [
            {"name": "tenants", "secret": {"secretName": "tenants"}},
            {"name": "sds", "configMap": {"name": "sds", "items": [{"key": "a.json", "path": "x/a.json"}]}},
            {"name": "unmounted", "secret": {"secretName": "other"}},
        ],
        "containers": [],
    }
    pod = pod_process.Pod(
        spec=spec,
        root=tmp_path,
        name="p",
        namespace="n",
        image_env={},
        secrets={"tenants": {"tenants.yaml": "- {name: a, key: k1}", "old.yaml": "x"}, "other": {"o": "1"}},
        config_maps={"sds": {"a.json": "{}"}},
    )
    tenants, sds = pod.volume("tenants"), pod.volume("sds")
    before = (tenants / "tenants.yaml").stat().st_ino
    # as a subPath mount would: the container holds the old file, not the folder's entry
    held = (tenants / "tenants.yaml").open()
    changed = pod.refresh(
        {"sds": {"a.json": "{}"}},
        {"tenants": {"tenants.yaml": "- {name: a, key: k2}"}, "other": {"o": "2"}},
    )
    assert changed == ["tenants"]
    assert (tenants / "tenants.yaml").read_text() == "- {name: a, key: k2}"
    assert (tenants / "tenants.yaml").stat().st_ino != before  # replaced, never rewritten in place
    assert not (tenants / "old.yaml").exists()  # a key gone is a file gone
    assert held.read() == "- {name: a, key: k1}"
    held.close()
    assert (sds / "x" / "a.json").read_text() == "{}"
    assert not (tmp_path / "volumes" / "unmounted").exists()  # only volumes in use are written
    # a Secret deleted meanwhile: the last content stays, as the kubelet keeps it
    assert pod.refresh({"sds": {"a.json": "[]"}}, {}) == ["sds"]
    assert (tenants / "tenants.yaml").read_text() == "- {name: a, key: k2}"
    assert (sds / "x" / "a.json").read_text() == "[]"


def test_the_relay_carries_tcp_through_a_unix_socket(tmp_path: Path) -> None:
    async def run() -> bytes:
        async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            w.write(b"echo:" + await r.read(100))
            await w.drain()
            w.close()

        target = await asyncio.start_server(echo, "127.0.0.1", 0)
        port = target.sockets[0].getsockname()[1]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            front = s.getsockname()[1]
        sock = tmp_path / "r.sock"
        relay = asyncio.create_task(
            netns_relay.serve([f"127.0.0.1:{front}={sock}"], [f"{sock}=127.0.0.1:{port}"])
        )
        for _ in range(100):
            await asyncio.sleep(0.02)
            if sock.exists():
                break
        reader, writer = await asyncio.open_connection("127.0.0.1", front)
        writer.write(b"hi")
        writer.write_eof()
        got = await asyncio.wait_for(reader.read(), 10)
        relay.cancel()
        target.close()
        return got

    assert asyncio.run(run()) == b"echo:hi"


@pytest.mark.skipif(not pod_process.namespaces_work(), reason="needs private mount namespaces (root)")
def test_two_pods_whose_containers_bind_every_address_themselves_coexist(tmp_path: Path) -> None:
    """A container in a network namespace of its own (what the node gives Envoy Gateway's
    shutdown-manager, a Go program the podnet shim cannot reach) binds 0.0.0.0 on its port, and
    the node relays that port from the pod's address: two such pods on one port coexist."""
    import httpx

    from kvgate.testing.polling import eventually

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = f"import http.server as h; h.ThreadingHTTPServer(('0.0.0.0', {port}), h.SimpleHTTPRequestHandler).serve_forever()"
    pods = []
    for i, ip in enumerate(("127.10.7.1", "127.10.7.2")):
        container = {"name": "go", "command": [sys.executable, "-c", server],
                     "readinessProbe": {"httpGet": {"path": "/", "port": port}}}  # fmt: skip
        pod = pod_process.Pod(spec={"containers": [container]}, root=tmp_path / f"pod{i}", name=f"p{i}",
                              namespace="ns", image_env={"PATH": "/usr/bin:/bin"}, pod_ip=ip, own_address=True,
                              own_network={"go"})  # fmt: skip
        pod.start(container, tmp_path / f"pod{i}.log")
        pods.append(pod)
    try:
        for ip in ("127.10.7.1", "127.10.7.2"):
            eventually(lambda ip=ip: httpx.get(f"http://{ip}:{port}/", timeout=2).status_code == 200, 30,
                       f"the relayed port at {ip}")  # fmt: skip
        # nothing bound the node's own loopback: the servers are inside their namespaces
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=2)
    finally:
        for pod in pods:
            pod.stop(5)
    assert not list(pod_process.RELAY_DIR.glob(f"*-{port}.sock")), "the relay sockets outlived their pods"


def test_the_pods_fs_group_owns_its_secret_and_empty_dir_volumes(tmp_path: Path) -> None:
    """As the kubelet's SetVolumeOwnership: a Secret with defaultMode 0440 is group-owned by
    fsGroup, so a non-root container in that group reads it (the EPP's tenants file under the
    images' user 65532), and a refreshed file keeps that ownership."""
    spec = {
        "securityContext": {"fsGroup": 4242},
        "volumes": [
            {"name": "tenants", "secret": {"secretName": "tenants", "defaultMode": 0o440}},
            {"name": "scratch", "emptyDir": {}},
        ],
        "containers": [],
    }
    pod = pod_process.Pod(
        spec=spec,
        root=tmp_path,
        name="p",
        namespace="n",
        image_env={},
        secrets={"tenants": {"tenants.yaml": "- {name: a, key: k1}"}},
    )
    tenants, scratch = pod.volume("tenants"), pod.volume("scratch")
    for path in (tenants, tenants / "tenants.yaml", scratch):
        assert path.stat().st_gid == 4242, path
    assert (tenants / "tenants.yaml").stat().st_mode & 0o777 == 0o440
    assert tenants.stat().st_mode & stat.S_ISGID and scratch.stat().st_mode & 0o7777 == 0o2777
    pod.refresh({}, {"tenants": {"tenants.yaml": "- {name: a, key: k2}"}})
    assert (tenants / "tenants.yaml").stat().st_gid == 4242
    # no fsGroup: files stay as written (root's), as before
    plain = pod_process.Pod(
        spec={**spec, "securityContext": {}},
        root=tmp_path / "plain",
        name="q",
        namespace="n",
        image_env={},
        secrets={"tenants": {"tenants.yaml": "x"}},
    )
    assert (plain.volume("tenants") / "tenants.yaml").stat().st_gid == os.getgid()
