"""The engine pod's hf:// adapter sidecar exactly as the operator writes it, run as a process
(kvgate/testing/pods.py: its command, env, Secret, the emptyDir and the ConfigMap volume at
their mount paths, read-only root filesystem): it fetches the adapters its ConfigMap lists from
the Hub (a fake one on loopback, gated by a token) into the folder the operator's load requests
name, and picks up an adapter added later when the kubelet refreshes the mounted ConfigMap,
without a restart.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.api.k8s.crds import ModelDeploymentSpec
from kvgate.operator import children as ch
from kvgate.operator.config import OperatorConfig
from kvgate.testing import eventually, fake_hub
from kvgate.testing import pods as pod_process

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(not pod_process.namespaces_work(), reason="needs a private mount namespace (unshare)"),
]
TOKEN = "hf_adapter_secret"


def adapter_folder(folder: Path, rank: int) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank}))
    (folder / "adapter_model.safetensors").write_bytes(b"weights-" + str(rank).encode())
    return folder


def test_sidecar_fetches_listed_hf_adapters_and_later_ones(tmp_path: Path) -> None:
    spec = ModelDeploymentSpec.model_validate(
        {
            "model": {"source": "hf://acme/base", "servedName": "base", "hfTokenSecret": "hf-token"},
            "engine": {"accelerator": "none"},
            "adapters": [{"name": "sql", "source": "hf://acme/sql-lora@v1"}],
        }
    )
    owner = ch.model_deployment_owner("m", "models", "uid-1")
    kids = ch.model_deployment_children("m", owner, spec, OperatorConfig(), ch.Capabilities())
    deployment = next(k for k in kids if k["kind"] == "Deployment" and k["metadata"]["name"] == "m")
    config_map = next(k for k in kids if k["kind"] == "ConfigMap" and k["metadata"]["name"] == "m-adapters")
    (sidecar,) = [
        c for c in deployment["spec"]["template"]["spec"]["initContainers"] if c["name"] == "fetch-adapters"
    ]
    assert sidecar["restartPolicy"] == "Always"  # a native sidecar: runs beside the engine

    hub = fake_hub.FakeHub()
    hub.add_folder("acme/sql-lora", adapter_folder(tmp_path / "sql", 8), revisions=("v1",), token=TOKEN)
    hub.add_folder("acme/chat-lora", adapter_folder(tmp_path / "chat", 4), token=TOKEN)
    with fake_hub.serve(hub):
        pod = pod_process.pod_from_deployment(
            deployment,
            tmp_path / "pod",
            "engine",
            service_env={"HF_ENDPOINT": hub.url},
            secrets={"hf-token": {"token": TOKEN}},
            config_maps={"m-adapters": config_map["data"]},
        )
        try:
            running = pod.start(sidecar, tmp_path / "sidecar.log")
            fetched = pod.volume("hf-adapters")
            sql = spec.adapters[0]
            # The folder the operator's load request names, relative to the emptyDir's mount.
            sql_dir = fetched / Path(ch.adapter_path(spec, sql)).relative_to("/adapters/hf")
            eventually(
                lambda: (sql_dir / "adapter_model.safetensors").is_file(), 60, "sql fetched", watch=[running]
            )
            assert (sql_dir / "adapter_model.safetensors").read_bytes() == b"weights-8"
            assert sorted(p.name for p in fetched.iterdir()) == ["acme--sql-lora@v1"]  # no .partial left

            # The kubelet refreshes the mounted ConfigMap when the operator rewrites it.
            spec2 = spec.model_copy(
                update={
                    "adapters": [
                        sql,
                        sql.model_copy(update={"name": "chat", "source": "hf://acme/chat-lora"}),
                    ]
                }
            )
            data = ch.adapters_config_map("m", owner, spec2, OperatorConfig())["data"]
            (pod.volume("adapter-list") / "hf-adapters.json").write_text(data["hf-adapters.json"])
            chat_dir = fetched / "acme--chat-lora"
            eventually(
                lambda: (chat_dir / "adapter_config.json").is_file(), 60, "chat fetched", watch=[running]
            )
            assert ch.adapter_path(spec2, spec2.adapters[1]) == "/adapters/hf/acme--chat-lora"
            assert running.alive()
        finally:
            pod.stop()
