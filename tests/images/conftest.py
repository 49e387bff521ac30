"""Runs the images `make images` built (dist/images/*.oci.tar) the way the chart's pods run
them, without a container engine: each archive is unpacked by buildah (`buildah from
oci-archive:...`, `buildah mount`), and a process starts in it as a pod's would: the image's
own entrypoint, environment, working directory and numeric USER, a read-only root filesystem,
a fresh writable /tmp (the chart's emptyDir), the model mounted read-only at /models (the
operator's MODEL_DIR), the host's network (loopback) in place of the pod's.

These tests only run when asked: `make images-test` (pytest -m images). `make test` skips them.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# buildah as scripts/images.sh runs it: no daemon, chroot isolation
BUILDAH_ENV = {**os.environ, "BUILDAH_ISOLATION": "chroot"}

# Mounts a private view of the image's root, makes it read-only, then execs the command.
# $1 root, $2 binds ("src:dst" lines), the rest: the command (chroot drops to the image's user).
_MOUNT_AND_EXEC = r"""
set -eu
root=$1; binds=$2; shift 2
mount --make-rprivate /
mount --bind "$root" "$root"
mkdir -p "$root/proc" "$root/dev" "$root/tmp"
mount -t proc proc "$root/proc"
mount --rbind /dev "$root/dev"
mount -t tmpfs -o mode=1777 tmpfs "$root/tmp"
printf '%s\n' "$binds" | while IFS=: read -r src dst; do
    [ -n "$src" ] || continue
    # a target reached through a symlink (Debian's /var/run -> /run) would resolve on the host
    case "$(realpath -m "$root$dst")" in "$(realpath "$root")"/*) ;; *) echo "bind target $dst leaves the image" >&2; exit 1 ;; esac
    [ "$(realpath -m "$root$dst")" = "$(realpath -m "$root")$dst" ] || { echo "bind target $dst crosses a symlink; name the real path" >&2; exit 1; }
    if [ -d "$src" ]; then mkdir -p "$root$dst"; elif [ ! -e "$root$dst" ]; then : >"$root$dst"; fi
    mount --bind "$src" "$root$dst"
    mount -o remount,bind,ro "$root$dst"
done
mount -o remount,bind,ro "$root"
exec "$@"
"""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "images" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="runs the built images: `make images && make images-test`")
    for item in items:
        if item.get_closest_marker("images"):
            item.add_marker(skip)


def built_images() -> dict[str, Path]:
    """Image name -> its archive, as `scripts/images.sh --list` names them (FLAVOR from the env)."""
    out = subprocess.run(
        [ROOT / "scripts" / "images.sh", "--list"], check=True, capture_output=True, text=True
    ).stdout
    return {name: ROOT / archive for name, _ref, archive in (line.split() for line in out.splitlines())}


@dataclass
class Image:
    name: str
    rootfs: Path
    user: str
    env: dict[str, str]
    entrypoint: list[str]
    cmd: list[str]
    workdir: str

    def argv(
        self,
        *args: str,
        binds: dict[str, str] | None = None,
        entrypoint: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> list[str]:
        """The command line that runs the image with ``args`` in place of its CMD (and
        ``entrypoint`` in place of its ENTRYPOINT)."""
        if ":" not in self.user or not all(part.isdigit() for part in self.user.split(":")):
            raise AssertionError(f"{self.name}: USER {self.user!r} is not a numeric uid:gid")
        spec = "\n".join(f"{src}:{dst}" for src, dst in (binds or {}).items())
        env_list = [f"{k}={v}" for k, v in {**self.env, **(env or {})}.items()]
        entry = self.entrypoint if entrypoint is None else entrypoint
        inner = ["/usr/bin/env", "-C", self.workdir, *entry, *(args or self.cmd)]
        return [
            "unshare", "--mount", "--", "/bin/sh", "-c", _MOUNT_AND_EXEC, "sh", str(self.rootfs), spec,
            "env", "-i", *env_list, "chroot", f"--userspec={self.user}", str(self.rootfs), *inner,
        ]  # fmt: skip


def _buildah(*args: str) -> str:
    done = subprocess.run(["buildah", *args], env=BUILDAH_ENV, capture_output=True, text=True)
    if done.returncode != 0:
        raise AssertionError(f"buildah {' '.join(args)} failed: {done.stderr.strip()[-2000:]}")
    return done.stdout.strip()


@pytest.fixture(scope="session")
def open_image() -> Iterator[object]:
    """open_image(name) -> Image: the archive unpacked once per session, removed at the end."""
    if shutil.which("buildah") is None or shutil.which("unshare") is None:
        pytest.fail("buildah and unshare are needed: run `make images` first (it installs buildah)")
    opened: dict[str, Image] = {}
    containers: list[str] = []

    def open_(name: str) -> Image:
        if name in opened:
            return opened[name]
        archive = built_images()[name]
        if not archive.exists():
            pytest.fail(f"{archive} is missing: run `make images` first")
        ctr = _buildah("from", "--quiet", "--pull-always", f"oci-archive:{archive}")
        containers.append(ctr)
        rootfs = Path(_buildah("mount", ctr))
        config = json.loads(_buildah("inspect", "--type", "container", ctr))["OCIv1"]["config"]
        opened[name] = Image(
            name=name,
            rootfs=rootfs,
            user=config.get("User", ""),
            env=dict(e.split("=", 1) for e in config.get("Env", [])),
            entrypoint=config.get("Entrypoint") or [],
            cmd=config.get("Cmd") or [],
            workdir=config.get("WorkingDir") or "/",
        )
        return opened[name]

    yield open_
    for ctr in containers:
        subprocess.run(["buildah", "rm", ctr], env=BUILDAH_ENV, capture_output=True)
