"""The chart and the images `make images` builds agree: image references and tags, the
non-root uid, the ports each image exposes and the writable paths its environment points at.
Reads files and `scripts/images.sh --list` only; builds nothing."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvgate.api.k8s.crds import EngineSpec
from kvgate.operator.children.common import EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT
from kvgate.operator.config import OperatorConfig

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "kvgate"
WRITABLE = "/tmp"  # the one emptyDir the chart's and the operator's pods mount writable


def _listed(flavor: str) -> dict[str, tuple[str, str]]:
    out = subprocess.run(
        [ROOT / "scripts" / "images.sh", "--list"],
        env={**os.environ, "FLAVOR": flavor},
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {name: (ref, archive) for name, ref, archive in (line.split() for line in out.splitlines())}


def _final_stage(component: str) -> str:
    return (ROOT / "docker" / f"{component}.Dockerfile").read_text().split("\nFROM ")[-1]


def _env(stage: str) -> dict[str, str]:
    """ENV assignments of a stage (continuation lines joined)."""
    joined = stage.replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in re.findall(r"^ENV\s+(.+)$", joined, flags=re.M):
        env.update(dict(re.findall(r"(\w+)=(\S+)", line)))
    return env


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.fixture(scope="module")
def app_version() -> str:
    return str(yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"])


def test_chart_default_images_are_the_ones_make_images_builds(
    values: dict[str, Any], app_version: str
) -> None:
    version = re.search(r'^version = "(.+)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M)
    assert version and version.group(1) == app_version, "the chart's appVersion is the package version"
    cuda, cpu = _listed("cuda"), _listed("cpu")
    assert cuda["engine"][0] == values["defaults"]["engineImage"]  # the chart's engine is the CUDA one
    assert cpu["engine"][0] == values["defaults"]["engineImage"] + "-cpu"
    assert cuda["epp"][0] == cpu["epp"][0] == values["defaults"]["eppImage"]
    operator_image = f"{values['image']['repository']}:{values['image']['tag'] or app_version}"
    assert cuda["operator"][0] == operator_image
    for name, (_ref, archive) in {**cuda, "engine-cpu": cpu["engine"]}.items():
        assert archive.startswith("dist/images/") and archive.endswith(".oci.tar")
        assert name.split("-")[0] in Path(archive).name


def test_dockerfile_users_match_the_chart(values: dict[str, Any]) -> None:
    template = (CHART / "templates" / "deployment.yaml").read_text()
    chart_uid = int(re.search(r"runAsUser: (\d+)", template).group(1))  # type: ignore[union-attr]
    for component in ("engine", "epp", "operator"):
        (user,) = re.findall(r"^USER\s+(\S+)", _final_stage(component), flags=re.M)
        uid, gid = (int(x) for x in user.split(":"))
        assert uid == gid == chart_uid == values["operator"]["podRunAsUser"] == OperatorConfig().run_as_user


def test_dockerfile_ports_match_the_chart_and_the_operator(values: dict[str, Any]) -> None:
    def exposed(component: str) -> set[int]:
        return {
            int(p)
            for line in re.findall(r"^EXPOSE\s+(.+)$", _final_stage(component), flags=re.M)
            for p in line.split()
        }

    engine = EngineSpec()
    assert exposed("engine") == {engine.port, engine.kv_events_port}
    assert exposed("epp") == {EPP_GRPC_PORT, EPP_HEALTH_PORT, EPP_METRICS_PORT}
    assert exposed("operator") == {values["operator"]["livenessPort"]}


def test_dockerfile_writable_paths_are_on_the_pods_tmp_volume() -> None:
    template = (CHART / "templates" / "deployment.yaml").read_text()
    assert re.search(rf"mountPath: {WRITABLE}\n", template), "the operator pod mounts a writable /tmp"
    for component in ("engine", "epp", "operator"):
        stage = _final_stage(component)
        env = _env(stage)
        assert env.get("PYTHONDONTWRITEBYTECODE") == "1", f"{component}: no .pyc writes on a read-only root"
        assert re.findall(r"^WORKDIR\s+(\S+)", stage, flags=re.M)[-1] == WRITABLE
        writable = {
            k: v for k, v in env.items() if k == "HOME" or (k.endswith(("_HOME", "_CACHE_DIR")) and "/" in v)
        }
        assert "HOME" in writable
        for key, path in writable.items():
            assert path == WRITABLE or path.startswith(WRITABLE + "/"), (
                f"{component}: {key}={path} is not under {WRITABLE}"
            )


def test_operator_children_mount_tmp_where_the_images_write() -> None:
    from kvgate.api.k8s.crds import ModelDeploymentSpec
    from kvgate.operator import children as ch

    spec = ModelDeploymentSpec.model_validate({"model": {"source": "hf://org/model"}})
    owner = ch.model_deployment_owner("m", "ns", "uid-1")
    containers = {
        kid["spec"]["template"]["spec"]["containers"][0]["name"]: kid["spec"]["template"]["spec"]
        for kid in ch.model_deployment_children("m", owner, spec, OperatorConfig(), ch.Capabilities())
        if kid["kind"] == "Deployment"
    }
    assert containers, "the operator makes engine and EPP Deployments"
    for name, pod in containers.items():
        container = pod["containers"][0]
        assert container["securityContext"]["readOnlyRootFilesystem"] is True, name
        assert WRITABLE in {m["mountPath"] for m in container["volumeMounts"]}, name
        image_env = _env(_final_stage("engine" if name == "engine" else "epp"))
        pod_env = {e["name"]: e.get("value") for e in container.get("env", [])}
        for key in ("HOME", "HF_HOME"):
            if key in pod_env and key in image_env:
                assert pod_env[key] == image_env[key], (name, key)
