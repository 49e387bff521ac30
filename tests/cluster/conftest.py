"""A real control plane for the cluster tests: `scripts/cluster.sh` (etcd, kube-apiserver,
kube-controller-manager, kube-scheduler built from Go modules) started once per session.

The build is cold-expensive (about 11 minutes of Go on 2 cores, then cached): `make test` runs
these tests when it is cached (`make cluster` once builds it) and CI always builds it first
(scripts/test.sh). Without the build they are skipped, and the skip says how to get it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / ".tools" / "bin"
CRDS = ("inferencepools.inference.networking.k8s.io", "inferenceobjectives.inference.networking.x-k8s.io",
        "modeldeployments.kvgate.dev")  # fmt: skip


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("CI") == "true":
        return
    built = (
        subprocess.run([ROOT / "scripts" / "build_cluster.sh", "--cached"], capture_output=True).returncode
        == 0
    )
    if built:
        return
    skip = pytest.mark.skip(
        reason="the control plane is not built yet: `make cluster` builds it once (~11 min)"
    )
    for item in items:
        if item.get_closest_marker("cluster"):
            item.add_marker(skip)


@dataclass
class Cluster:
    kubeconfig: Path
    proc: subprocess.Popen[str]
    # the node runs kvgate's pods from the OCI archives in dist/images (scripts/cluster.sh said so)
    images: bool = False

    def env(self) -> dict[str, str]:
        return {
            **os.environ,
            "KUBECONFIG": str(self.kubeconfig),
            "HELM_CACHE_HOME": str(self.kubeconfig.parent / "helm"),
        }

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(TOOLS / "kubectl"), *args],
            input=stdin,
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=120,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {done.stderr.strip()[-3000:]}")
        return done

    def helm(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run(
            [str(TOOLS / "helm"), *args],
            capture_output=True,
            text=True,
            env=self.env(),
            timeout=300,
            cwd=ROOT,
        )
        if check and done.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed: {done.stderr.strip()[-3000:]}")
        return done

    def get(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", *args, "-o", "json").stdout)

    def delete(self, kind: str, name: str, namespace: str, within: float) -> None:
        """Delete an object and wait until the API server no longer has it, by polling: kubectl's
        own wait watches for the deletion event, and with this kubectl and API server (watch-list
        client) that watch missed it, reporting a timeout for an object long gone."""
        self.kubectl("delete", kind, name, "-n", namespace, "--wait=false")
        deadline = time.monotonic() + within
        while self.kubectl(
            "get", kind, name, "-n", namespace, "--ignore-not-found", "-o", "name"
        ).stdout.strip():
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{kind} {namespace}/{name} still exists {within:g} s after its deletion"
                )
            time.sleep(0.5)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if shutil.which("openssl") is None:
        pytest.fail("openssl is needed for the control plane's keys (Debian package 'openssl')")
    state = tmp_path_factory.mktemp("cluster") / "state"
    log = state.parent / "cluster.log"
    out = log.open("w")
    proc = subprocess.Popen(
        [ROOT / "scripts" / "cluster.sh"],
        env={**os.environ, "KVGATE_CLUSTER_DIR": str(state)},
        stdout=out,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        start_new_session=True,  # its own process group: nothing it started can outlive a kill
    )
    # a cold build in CI takes ~11 min on 2 cores; a cached start ~10 s
    deadline = time.monotonic() + 1500
    while "cluster ready" not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            _kill_group(proc)
            raise AssertionError(f"scripts/cluster.sh did not get ready:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    text = log.read_text()
    cluster = Cluster(state / "kubeconfig", proc, images=runs_images(text))
    if os.environ.get("CI") == "true" and not cluster.images:
        _kill_group(proc)
        raise AssertionError(
            "CI builds the images before these tests (scripts/test.sh), so the node must run "
            f"kvgate's pods from them:\n{text[-3000:]}"
        )
    try:
        yield cluster
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            out.close()
            raise AssertionError(
                f"scripts/cluster.sh did not stop within 60 s:\n{log.read_text()[-3000:]}"
            ) from None
        _kill_group(proc)  # a clean stop leaves none; this is the guarantee
        out.close()
        assert not state.exists(), "scripts/cluster.sh left its state behind"


def runs_images(cluster_log: str) -> bool:
    """Whether scripts/cluster.sh said the node runs kvgate's pods from OCI archives. Both of its
    lines begin "pods of kvgate's images run from": the other one goes on "this checkout's
    venv" (matching the prefix alone took every venv cluster for an image one)."""
    return re.search(r"pods of kvgate's images run from (?!this checkout's venv)", cluster_log) is not None


def _kill_group(proc: subprocess.Popen[str]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(10)


@pytest.fixture(scope="session")
def crds(cluster: Cluster) -> Cluster:
    cluster.kubectl("apply", "--server-side", "-k", str(ROOT / "crds"))
    for name in CRDS:
        cluster.kubectl("wait", "--for=condition=Established", f"crd/{name}", "--timeout=60s")
    return cluster
