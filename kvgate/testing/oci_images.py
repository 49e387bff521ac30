"""The images a node runs pods from: the OCI archives `make images` wrote (dist/images/*.oci.tar).

An archive is read in place (tarfile: its index, manifest and config are small JSON blobs) to
learn the reference it carries and the image's entrypoint, command, environment, user and
working directory. Its file system goes into buildah's storage (Debian's buildah, the tool
scripts/images.sh builds with), once: not at all when images.sh built it there, since an image's
ID in that storage is its config digest. Each container then gets a working container of its
own, a copy-on-write root that is the image plus an empty writable layer, as a container runtime
gives, removed with the pod.
"""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# buildah as scripts/images.sh runs it: no daemon, chroot isolation
BUILDAH_ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}
REF_NAME = "org.opencontainers.image.ref.name"


@dataclass(frozen=True)
class ImageConfig:
    """What the image's config says about running it (OCI image spec, `config`)."""

    entrypoint: list[str]
    cmd: list[str]
    env: dict[str, str]
    user: str
    workdir: str

    @classmethod
    def parse(cls, doc: dict[str, Any]) -> ImageConfig:
        config = doc.get("config") or {}
        env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        return cls(
            entrypoint=list(config.get("Entrypoint") or []),
            cmd=list(config.get("Cmd") or []),
            env=env,
            user=str(config.get("User") or ""),
            workdir=str(config.get("WorkingDir") or "/"),
        )


@dataclass(frozen=True)
class Archive:
    path: Path
    ref: str  # the reference the archive was written with (its index's ref.name)
    manifest_digest: str
    config_digest: str  # the image's ID in buildah's storage
    config: ImageConfig


def _blob(tar: tarfile.TarFile, digest: str) -> dict[str, Any]:
    algorithm, _, hexdigest = digest.partition(":")
    member = tar.extractfile(f"blobs/{algorithm}/{hexdigest}")
    if member is None:
        raise ValueError(f"blob {digest} is not a file")
    return dict(json.load(member))


def read_archive(path: Path) -> Archive:
    """One OCI archive's reference and config, without unpacking its layers."""
    with tarfile.open(path) as tar:
        index_file = tar.extractfile("index.json")
        if index_file is None:
            raise ValueError(f"{path}: no index.json")
        index = json.load(index_file)
        manifests = index.get("manifests") or []
        if len(manifests) != 1:
            raise ValueError(f"{path}: {len(manifests)} manifests in its index, expected one")
        entry = manifests[0]
        ref = (entry.get("annotations") or {}).get(REF_NAME)
        if not ref:
            raise ValueError(f"{path}: its manifest names no reference ({REF_NAME})")
        manifest = _blob(tar, entry["digest"])
        config_digest = manifest["config"]["digest"]
        config = ImageConfig.parse(_blob(tar, config_digest))
    return Archive(path, ref, entry["digest"], config_digest, config)


def normalized(ref: str) -> str:
    """A reference as a container runtime compares it: Docker Hub's implied parts made explicit."""
    name, at, digest = ref.partition("@")
    parts = name.split("/")
    if len(parts) == 1 or ("." not in parts[0] and ":" not in parts[0] and parts[0] != "localhost"):
        parts = ["docker.io", *(["library"] if len(parts) == 1 else []), *parts]
    if not at and ":" not in parts[-1]:
        parts[-1] += ":latest"
    return "/".join(parts) + (at + digest)


def _buildah(*args: str, timeout: float = 600) -> str:
    done = subprocess.run(
        ["buildah", *args], capture_output=True, text=True, env=BUILDAH_ENV, timeout=timeout
    )
    if done.returncode != 0:
        raise RuntimeError(f"buildah {' '.join(args)}: {done.stderr.strip()[-600:]}")
    return done.stdout.strip()


@dataclass(frozen=True)
class Root:
    """A container's root file system: a buildah working container, mounted."""

    name: str
    path: Path
    config: ImageConfig


class ImageStore:
    """The archives in a folder, by reference, and the working containers made from them.

    Working containers are named `<prefix><pod uid>-<container>`, so a node killed before it
    removed its own finds them at its next start (`sweep`)."""

    def __init__(self, folder: Path, prefix: str = "kvgate-node-") -> None:
        self.folder, self.prefix = folder, prefix
        self.archives: dict[str, Archive] = {}
        for path in sorted(folder.glob("*.oci.tar")):
            archive = read_archive(path)
            self.archives[normalized(archive.ref)] = archive
            self.archives[
                normalized(f"{archive.ref.split('@')[0].rsplit(':', 1)[0]}@{archive.manifest_digest}")
            ] = archive
        self._imported: set[str] = set()
        self._lock = threading.Lock()

    def find(self, image: str) -> Archive | None:
        return self.archives.get(normalized(image))

    def _import(self, archive: Archive) -> str:
        """The image's ID in buildah's storage, importing the archive if it is not there."""
        with self._lock:
            image_id = archive.config_digest.partition(":")[2]
            if image_id in self._imported:
                return image_id
            present = subprocess.run(
                ["buildah", "inspect", "--type", "image", image_id],
                capture_output=True,
                env=BUILDAH_ENV,
                timeout=120,
            )
            if present.returncode != 0:
                _buildah("pull", "--quiet", f"oci-archive:{archive.path}", timeout=1800)
            self._imported.add(image_id)
            return image_id

    def root(self, image: str, name: str) -> Root:
        archive = self.find(image)
        if archive is None:
            raise LookupError(f"no archive in {self.folder} holds {image}")
        image_id = self._import(archive)
        full = self.prefix + name
        self.remove(name)  # a leftover of a container that was restarted
        _buildah("from", "--quiet", "--pull=never", "--name", full, image_id)
        path = Path(_buildah("mount", full))
        return Root(full, path, archive.config)

    def remove(self, name: str) -> None:
        full = name if name.startswith(self.prefix) else self.prefix + name
        subprocess.run(["buildah", "rm", full], capture_output=True, env=BUILDAH_ENV, timeout=120)

    def sweep(self) -> list[str]:
        """Removes the working containers a previous node left behind; returns their names."""
        listing = subprocess.run(
            ["buildah", "containers", "--noheading", "--format", "{{.ContainerName}}"],
            capture_output=True,
            text=True,
            env=BUILDAH_ENV,
            timeout=120,
        )
        names = [n for n in listing.stdout.split() if n.startswith(self.prefix)]
        for name in names:
            self.remove(name)
        return names
