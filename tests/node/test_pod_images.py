"""The node's image mode (kvgate.testing.oci_images, kvgate.testing.pods, kvgate.testing.pod_exec):
an OCI archive read in place, Kubernetes' rules for command/args over ENTRYPOINT/CMD and for the
user, mount targets resolved inside the image's root, and a container run in a root of its own
with the restricted securityContext (the image here: a root whose /usr is the host's, bound
read-only, so no image build is needed)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path
from typing import Any

import pytest

from kvgate.testing import pod_exec
from kvgate.testing import pods as pod_process
from kvgate.testing.oci_images import ImageConfig, ImageStore, Root, normalized, read_archive

CONFIG = {"config": {"Entrypoint": ["kvgate"], "Cmd": ["epp", "serve", "--help"], "User": "65532:65532",
                     "Env": ["PATH=/opt/kvgate/bin:/usr/bin:/bin", "HOME=/tmp"], "WorkingDir": "/tmp"}}  # fmt: skip


def write_archive(path: Path, ref: str, config: dict[str, Any]) -> str:
    """A minimal OCI archive (index, manifest, config, no layers); returns the manifest digest."""
    blobs: dict[str, bytes] = {}

    def blob(doc: dict[str, Any]) -> str:
        data = json.dumps(doc).encode()
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest

    config_digest = blob(config)
    manifest = blob({"schemaVersion": 2, "config": {"digest": config_digest}, "layers": []})
    index = {"schemaVersion": 2, "manifests": [{"digest": manifest, "annotations": {
        "org.opencontainers.image.ref.name": ref}}]}  # fmt: skip
    with tarfile.open(path, "w") as tar:
        for name, data in [("index.json", json.dumps(index).encode()),
                           *((f"blobs/sha256/{d[7:]}", b) for d, b in blobs.items())]:  # fmt: skip
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return manifest


def test_an_archive_is_read_in_place_and_found_by_tag_or_digest(tmp_path: Path) -> None:
    digest = write_archive(tmp_path / "kvgate-epp.oci.tar", "ghcr.io/kvgate/epp:0.1.0", CONFIG)
    archive = read_archive(tmp_path / "kvgate-epp.oci.tar")
    assert archive.ref == "ghcr.io/kvgate/epp:0.1.0" and archive.manifest_digest == digest
    assert archive.config == ImageConfig(["kvgate"], ["epp", "serve", "--help"],
                                         {"PATH": "/opt/kvgate/bin:/usr/bin:/bin", "HOME": "/tmp"}, "65532:65532", "/tmp")  # fmt: skip
    store = ImageStore(tmp_path)
    assert store.find("ghcr.io/kvgate/epp:0.1.0") == archive
    assert store.find(f"ghcr.io/kvgate/epp@{digest}") == archive
    assert store.find("ghcr.io/kvgate/epp:0.2.0") is None
    assert store.find("kvgate/epp:0.1.0") is None  # Docker Hub's, not ghcr.io's
    assert normalized("busybox") == "docker.io/library/busybox:latest"
    assert normalized("localhost/a/b") == "localhost/a/b:latest"


def test_an_archive_without_a_reference_is_refused_with_its_name(tmp_path: Path) -> None:
    write_archive(tmp_path / "x.oci.tar", "", CONFIG)
    with pytest.raises(ValueError, match=r"x\.oci\.tar: its manifest names no reference"):
        read_archive(tmp_path / "x.oci.tar")


def make_root(tmp_path: Path) -> Path:
    root = tmp_path / "rootfs"
    for folder in ("etc", "proc", "dev", "sys", "tmp", "run", "var", "usr"):
        (root / folder).mkdir(parents=True)
    for link, target in (
        ("bin", "usr/bin"),
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
        ("sbin", "usr/sbin"),
    ):
        (root / link).symlink_to(target)
    (root / "var" / "run").symlink_to("/run")  # Debian's: absolute
    (root / "etc" / "passwd").write_text("root:x:0:0::/root:/bin/sh\nkvgate:x:65532:65533::/tmp:/bin/false\n")
    (root / "etc" / "group").write_text("root:x:0:\nkvgate:x:65533:\n")
    (root / "tmp").chmod(0o1777)
    return root


def test_mount_targets_stay_inside_the_root_through_links(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    (root / "usr" / "up").symlink_to("../../../../outside")
    assert pod_process.inside(root, "/var/run/secrets/x") == root / "run" / "secrets" / "x"
    assert pod_process.inside(root, "/bin/sh") == root / "usr" / "bin" / "sh"
    assert pod_process.inside(root, "/../../etc/passwd") == root / "etc" / "passwd"
    assert pod_process.inside(root, "/usr/up/y") == root / "outside" / "y"
    (root / "loop").symlink_to("loop")
    with pytest.raises(pod_process.ContainerConfigError, match="too many levels"):
        pod_process.inside(root, "/loop/a")


def pod_of(
    container: dict[str, Any], root: Path, tmp_path: Path, config: ImageConfig, **security: Any
) -> pod_process.Pod:
    spec = {"securityContext": security, "containers": [container],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "usr", "persistentVolumeClaim": {"claimName": "usr"}}]}  # fmt: skip
    return pod_process.Pod(spec=spec, root=tmp_path / "pod", name="p-0", namespace="ns", image_env={},
                           pod_ip="127.10.8.8", roots={container["name"]: Root("r", root, config)},
                           claims={"usr": Path("/usr")})  # fmt: skip


@pytest.mark.parametrize(
    ("container", "expected"),
    [
        ({}, ["kvgate", "epp", "serve", "--help"]),
        ({"args": ["epp", "serve", "--host", "0.0.0.0"]}, ["kvgate", "epp", "serve", "--host", "127.10.8.8"]),
        ({"command": ["sh"]}, ["sh"]),  # command drops the image's CMD as well
        ({"command": ["sh"], "args": ["-c", "$(HOME)"]}, ["sh", "-c", "/tmp"]),
    ],
)
def test_command_and_args_over_entrypoint_and_cmd(
    tmp_path: Path, container: dict[str, Any], expected: list[str]
) -> None:
    c = {"name": "c", "image": "i", **container}
    pod = pod_of(c, make_root(tmp_path), tmp_path, ImageConfig.parse(CONFIG))
    pod.own_address = True
    assert pod._command(c, pod.env(c), pod.roots["c"]) == expected


def test_the_user_comes_from_the_security_context_or_the_images_user(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    c = {"name": "c", "image": "i"}
    by_name = ImageConfig([], ["sh"], {}, "kvgate", "/")
    assert pod_of(c, root, tmp_path, by_name).user(c, pod_of(c, root, tmp_path, by_name).roots["c"]) == (
        65532,
        65533,
        [],
    )
    pod = pod_of(c, root, tmp_path, by_name, runAsUser=1000, supplementalGroups=[5], fsGroup=7)
    assert pod.user(c, pod.roots["c"]) == (1000, 0, [5, 7])
    as_root = pod_of(c, root, tmp_path, ImageConfig([], ["sh"], {}, "", "/"), runAsNonRoot=True)
    with pytest.raises(pod_process.ContainerConfigError, match="runAsNonRoot and image will run as root"):
        as_root.user(c, as_root.roots["c"])
    nobody = pod_of(c, root, tmp_path, ImageConfig([], ["sh"], {}, "nobody", "/"))
    with pytest.raises(pod_process.ContainerConfigError, match="unable to find user nobody"):
        nobody.user(c, nobody.roots["c"])


def test_capabilities_by_kubernetes_name() -> None:
    assert pod_exec.caps_to_drop("ALL", 40) == list(range(41))
    assert pod_exec.caps_to_drop("NET_RAW,cap_sys_admin", 40) == [13, 21]
    with pytest.raises(ValueError, match="unknown capabilities: NET_MAGIC"):
        pod_exec.caps_to_drop("NET_MAGIC", 40)


SCRIPT = (
    "id -u; id -g; hostname; grep -E '^(CapEff|CapBnd|NoNewPrivs)' /proc/self/status; pwd; "
    "touch /etc/x 2>/dev/null && echo root-writable || echo root-read-only; "
    "touch /tmp/y && echo tmp-writable; cat /run/secrets/kubernetes.io/serviceaccount/token; "
    "grep -c p-0 /etc/hosts; test -c /dev/null && echo dev-null; echo $HOME"
)


@pytest.mark.skipif(not pod_process.namespaces_work(), reason="needs private mount namespaces (root)")
def test_a_container_runs_in_its_root_with_the_restricted_security_context(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("a-token\n")
    restricted = {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                  "capabilities": {"drop": ["ALL"]}, "runAsNonRoot": True}  # fmt: skip
    c = {"name": "c", "image": "i", "command": ["sh", "-c", SCRIPT], "securityContext": restricted,
         "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "usr", "mountPath": "/usr", "readOnly": True}]}  # fmt: skip
    pod = pod_of(
        c, root, tmp_path, ImageConfig([], [], {"PATH": "/usr/bin:/bin", "HOME": "/tmp"}, "kvgate", "/tmp")
    )
    pod.service_account_dir = sa
    host_had = Path("/run/secrets/kubernetes.io").exists()
    done = pod.run(c, 60)
    pod.stop(5)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[:3] == ["65532", "65533", "p-0"], done.stdout
    assert "CapEff:\t0000000000000000" in done.stdout and "CapBnd:\t0000000000000000" in done.stdout
    assert "NoNewPrivs:\t1" in done.stdout
    assert lines[-7:] == ["/tmp", "root-read-only", "tmp-writable", "a-token", "1", "dev-null", "/tmp"], (
        done.stdout
    )
    # the service account went to the root's /run through Debian's /var/run link, not the host's
    assert (root / "run" / "secrets" / "kubernetes.io" / "serviceaccount").is_dir()
    assert Path("/run/secrets/kubernetes.io").exists() == host_had


@pytest.mark.skipif(not pod_process.namespaces_work(), reason="needs private mount namespaces (root)")
def test_a_missing_command_is_the_runtimes_clear_error(tmp_path: Path) -> None:
    root = make_root(tmp_path)
    c = {"name": "c", "image": "i", "command": ["no-such-binary"],
         "volumeMounts": [{"name": "usr", "mountPath": "/usr", "readOnly": True}]}  # fmt: skip
    pod = pod_of(c, root, tmp_path, ImageConfig([], [], {"PATH": "/usr/bin"}, "kvgate", "/"))
    done = pod.run(c, 60)
    pod.stop(5)
    assert done.returncode == 127
    assert 'exec: "no-such-binary": executable file not found in $PATH' in done.stderr
