"""Run a container of a pod manifest the operator writes as a process on this machine, the way
the kubelet would start it: the exact command and args, the env (values, fieldRefs, Secret and
ConfigMap keys, plus the image's ENV), every volume mounted at its mountPath (a private mount
namespace with bind mounts: configMap files, emptyDirs, PVCs, the service-account folder), a
read-only root filesystem when the container asks for one, and its runAsUser/runAsGroup (when
this venv's interpreter is usable by that user).

A container whose image is in the node's image store (kvgate.testing.oci_images: the OCI
archives `make images` wrote) runs in that image's root instead: a working container of its own
(the image plus a writable layer), with /proc, a /dev of the usual nodes, /sys read-only, the
pod's /etc/hosts, /etc/hostname and /etc/resolv.conf, and every volume bound inside it (mount
points resolved inside the root, never through a link out of it); its UTS namespace carries the
pod's name; then kvgate.testing.pod_exec chroots, drops the capabilities the securityContext
drops, sets no_new_privs, switches to runAsUser/runAsGroup or the image's USER and execs the
image's ENTRYPOINT and CMD as Kubernetes combines them with command and args, with the image's
ENV and working directory. runAsNonRoot is checked against the user that results.

Otherwise what cannot run here is substituted, and only that: the image is this checkout's venv (its PATH
replaces /opt/kvgate/bin), the pod network is the host's loopback (the pod IP is 127.0.0.1, or
a loopback address of the pod's own: then a container told to bind every address, `0.0.0.0` or
`tcp://*`, binds that one, as it would inside its own network namespace), and a PVC is a folder
(the test's, or the hostPath of the PersistentVolume it is bound to).
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from kvgate.testing.oci_images import ImageStore, Root

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
# Where the checkout and venv are set aside while volumes are mounted over their parents.
STAGING = Path("/var/tmp/kvgate-pod-staging")
# the Unix sockets that carry a container's ports across its network namespace (short paths:
# a socket's path is at most 107 bytes)
RELAY_DIR = Path("/tmp/kvgate-pod-relays")
PODNET_IN_ROOT = "/usr/lib/kvgate-podnet.so"  # where an image's container finds the shim
SA_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# the device nodes a container runtime gives every container (the OCI runtime spec's defaults)
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")


class ContainerConfigError(Exception):
    """What the kubelet reports as CreateContainerConfigError: the container cannot start as
    specified (its runAsNonRoot against the image's user, say)."""


def namespaces_work() -> bool:
    """Whether this machine lets us make a private mount namespace (root, or user namespaces)."""
    probe = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "true"], capture_output=True, timeout=10
    )
    return probe.returncode == 0


def usable_by_others(path: Path) -> bool:
    """Whether a non-root user can run `path` (every folder above it searchable by others)."""
    real = path.resolve()
    return all(p.stat().st_mode & stat.S_IXOTH for p in [real, *real.parents])


def interpreter_usable_by_others() -> bool:
    """Whether a non-root user can run this venv's interpreter (a pyenv python under a 0700
    /root cannot be): if not, containers run as root here and runAsUser is not exercised."""
    return usable_by_others(Path(sys.executable))


def image_env(component: str) -> dict[str, str]:
    """The ENV of the final stage of docker/<component>.Dockerfile, with this venv as the image."""
    env: dict[str, str] = {}
    lines = (REPO / "docker" / f"{component}.Dockerfile").read_text().replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("FROM "):
            env = {}
        elif line.startswith("ENV "):
            for item in shlex.split(line[4:]):
                key, _, value = item.partition("=")
                env[key] = value.replace("$PATH", HOST_PATH).replace("/opt/kvgate/bin", str(VENV_BIN))
    env.setdefault("PATH", f"{VENV_BIN}:{HOST_PATH}")
    env.pop("VIRTUAL_ENV", None)
    return env


@dataclass
class Container:
    """A running container: its process and log (what `eventually` watches while waiting)."""

    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


@dataclass
class Pod:
    """One pod's runtime: its volumes live under `root` and are shared by its containers."""

    spec: dict[str, Any]  # the Deployment's pod template spec
    root: Path
    name: str
    namespace: str
    image_env: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)
    pod_ip: str = "127.0.0.1"
    node_name: str = "node-1"
    # Rewrite "bind every address" to the pod IP (pods of their own loopback address).
    own_address: bool = False
    config_maps: dict[str, dict[str, str]] = field(default_factory=dict)
    secrets: dict[str, dict[str, str]] = field(default_factory=dict)
    claims: dict[str, Path] = field(default_factory=dict)
    service_account_dir: Path | None = None
    # projected volumes other than the API access one: volume -> (file path -> content), the
    # service-account tokens for their audiences requested by the node beforehand
    projected: dict[str, dict[str, str]] = field(default_factory=dict)
    service_env: dict[str, str] = field(default_factory=dict)  # KUBERNETES_SERVICE_HOST/PORT
    # the pod's /etc/resolv.conf (the cluster DNS), and a /dev/shm of its own (Envoy's
    # hot-restart memory is named by --base-id alone): what a pod's sandbox gives it
    resolv_conf: str | None = None
    private_shm: bool = False
    # None: switch to runAsUser when this venv's interpreter is usable by others (kvgate's
    # images); otherwise whether the image's binaries are
    can_switch_user: bool | None = None
    # image mode: container name -> its root (a working container of the store's)
    roots: dict[str, Root] = field(default_factory=dict)
    store: ImageStore | None = None
    # containers in a network namespace of their own, loopback only, their ports relayed from
    # the pod's address: a Go program binds every address with its own system calls, which the
    # podnet shim cannot reach, so two such pods would collide on the node's shared loopback
    own_network: set[str] = field(default_factory=set)
    # kvgate/testing/podnet.c for kvgate's own processes, binds only: a bind of every address
    # takes the pod's (kopf's liveness and metrics servers bind 0.0.0.0 in code, not in args)
    podnet: Path | None = None
    _volumes: dict[str, Path] = field(default_factory=dict)
    _made_mount_points: list[Path] = field(default_factory=list)
    _procs: list[subprocess.Popen[Any]] = field(default_factory=list)
    _relays: dict[str, list[subprocess.Popen[Any]]] = field(default_factory=dict)

    # -- volumes -----------------------------------------------------------------------------
    def volume(self, name: str) -> Path:
        if name in self._volumes:
            return self._volumes[name]
        (spec,) = [v for v in self.spec.get("volumes", []) if v["name"] == name]
        path = self.root / "volumes" / name
        if "emptyDir" in spec:
            path.mkdir(parents=True)
            path.chmod(0o777)  # what the kubelet gives an emptyDir
            self._give_to_fs_group(path, read_only=False)
        elif "configMap" in spec or "secret" in spec:
            path.mkdir(parents=True)
            for rel, (text, mode) in self._source_files(spec).items():
                file = path / rel
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_text(text)
                file.chmod(mode)
            path.chmod(0o755)
            self._give_to_fs_group(path, read_only=True)
        elif "projected" in spec and name in self.projected:
            path.mkdir(parents=True)
            mode = int(spec["projected"].get("defaultMode", 0o644))
            for rel, text in self.projected[name].items():
                file = path / rel
                file.parent.mkdir(parents=True, exist_ok=True)
                file.write_text(text)
                file.chmod(mode)
            path.chmod(0o755)
            self._give_to_fs_group(path, read_only=True)
        elif "projected" in spec and self.service_account_dir is not None:
            # the ServiceAccount admission plugin's kube-api-access volume: token, ca.crt, namespace
            path = self.service_account_dir
        elif "persistentVolumeClaim" in spec:
            path = self.claims[spec["persistentVolumeClaim"]["claimName"]]
        else:
            raise NotImplementedError(f"volume {name}: {sorted(spec)}")
        self._volumes[name] = path
        return path

    def _give_to_fs_group(self, path: Path, *, read_only: bool) -> None:
        """The kubelet's volume ownership for the pod's fsGroup (SetVolumeOwnership): each file
        and folder gets that group and group read (and write, on a writable volume), folders
        setgid; so a Secret mounted with defaultMode 0440 is readable by a non-root container
        the pod's fsGroup puts in that group, as on a real node."""
        group = (self.spec.get("securityContext") or {}).get("fsGroup")
        if group is None:
            return
        mask = 0o440 if read_only else 0o660
        for entry in [path, *path.rglob("*")]:
            os.lchown(entry, -1, int(group))
            mode = stat.S_IMODE(entry.lstat().st_mode)
            entry.chmod(mode | mask | (stat.S_ISGID | 0o110 if entry.is_dir() else 0))

    def _source_files(self, spec: dict[str, Any]) -> dict[str, tuple[str, int]]:
        """A configMap or secret volume's files: relative path -> (content, mode)."""
        source = spec.get("configMap") or spec["secret"]
        data = self.config_maps[source["name"]] if "configMap" in spec else self.secrets[source["secretName"]]
        items = source.get("items") or [{"key": k, "path": k} for k in data]
        return {
            item["path"]: (data[item["key"]], int(item.get("mode", source.get("defaultMode", 0o644))))
            for item in items
            if item["key"] in data  # an optional key that is absent
        }

    def refresh(
        self, config_maps: dict[str, dict[str, str]], secrets: dict[str, dict[str, str]]
    ) -> list[str]:
        """As the kubelet's periodic sync: the configMap and secret volumes already mounted get
        their objects' current keys, each file replaced whole (rename), keys gone removed. A
        subPath mount keeps the file it was given (as on a real node); env vars never change.
        Returns the volumes that changed."""
        self.config_maps, self.secrets = config_maps, secrets
        changed = []
        for spec in self.spec.get("volumes", []):
            path = self._volumes.get(spec["name"])
            if path is None or not ("configMap" in spec or "secret" in spec):
                continue
            try:
                files = self._source_files(spec)
            except KeyError:
                continue  # the object is gone: the kubelet keeps what it last wrote
            old = {
                str(f.relative_to(path))
                for f in path.rglob("*")
                if f.is_file() and not f.name.startswith(".")
            }
            dirty = False
            for rel, (text, mode) in files.items():
                file = path / rel
                if rel in old and file.read_text() == text:
                    continue
                file.parent.mkdir(parents=True, exist_ok=True)
                tmp = file.with_name(f".{file.name}.tmp")
                tmp.write_text(text)
                tmp.chmod(mode)
                self._give_to_fs_group(tmp, read_only=True)
                tmp.replace(file)
                dirty = True
            for rel in old - set(files):
                (path / rel).unlink(missing_ok=True)
                dirty = True
            if dirty:
                changed.append(spec["name"])
        return changed

    def _mounts(self, container: dict[str, Any]) -> list[tuple[Path, str, bool]]:
        mounts = [*self._sandbox_mounts()]
        mounts += [
            (self.volume(m["name"]), m["mountPath"], bool(m.get("readOnly")))
            for m in container.get("volumeMounts", [])
        ]
        if (
            self.service_account_dir is not None
            and self.spec.get("automountServiceAccountToken", True)
            and all(target != SA_MOUNT for _, target, _ in mounts)
        ):
            mounts.append((self.service_account_dir, SA_MOUNT, True))
        # A mount whose target hides another mount's source goes last (e.g. /tmp over pytest's tmp).
        return sorted(mounts, key=lambda m: any(str(o[0]).startswith(m[1] + "/") for o in mounts))

    def _sandbox_mounts(self) -> list[tuple[Path, str, bool]]:
        mounts = []
        if self.resolv_conf is not None:
            path = self.root / "resolv.conf"
            if not path.exists():
                self.root.mkdir(parents=True, exist_ok=True)
                path.write_text(self.resolv_conf)
                path.chmod(0o644)
            mounts.append((path, "/etc/resolv.conf", True))
        if self.private_shm:
            shm = self.root / "shm"
            shm.mkdir(parents=True, exist_ok=True)
            shm.chmod(0o1777)
            mounts.append((shm, "/dev/shm", False))
        return mounts

    # -- env ---------------------------------------------------------------------------------
    def _field(self, path: str) -> str:
        keyed = re.fullmatch(r"metadata\.(annotations|labels)\['([^']+)'\]", path)
        if keyed:
            return (self.annotations if keyed[1] == "annotations" else self.labels).get(keyed[2], "")
        return {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "status.podIP": self.pod_ip,
            "spec.nodeName": self.node_name,
        }[path]

    def env(self, container: dict[str, Any]) -> dict[str, str]:
        root = self.roots.get(container["name"])
        if root is not None:
            env = {**root.config.env, "HOSTNAME": self.name, **self.service_env}
        else:
            env = {**self.image_env, **self.service_env}
        if self.podnet is not None:
            env |= {"KVGATE_POD_IP": self.pod_ip, "KVGATE_PODNET_BINDS_ONLY": "1"}
            if root is None:
                env["LD_PRELOAD"] = str(self.podnet)
        for item in container.get("env", []):
            source = item.get("valueFrom")
            if source is None:
                env[item["name"]] = item.get("value", "")
            elif "fieldRef" in source:
                env[item["name"]] = self._field(source["fieldRef"]["fieldPath"])
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                env[item["name"]] = self.secrets[ref["name"]][ref["key"]]
            elif "configMapKeyRef" in source:
                ref = source["configMapKeyRef"]
                env[item["name"]] = self.config_maps[ref["name"]][ref["key"]]
            else:
                raise NotImplementedError(f"env {item['name']}: {sorted(source)}")
        return env

    # -- processes ---------------------------------------------------------------------------
    def _kept(self, container: dict[str, Any]) -> list[tuple[Path, Path]]:
        """(path, staging folder) for the checkout and the venv where a volume mounted over a
        parent (an emptyDir on /tmp, with the clone under /tmp) would hide the code the
        container runs: they are bind-mounted aside first and back in place after."""
        targets = [Path(t) for _, t, _ in self._mounts(container)]
        wanted = sorted({REPO, Path(sys.prefix)}, key=lambda p: len(p.parts))
        kept: list[Path] = []
        for path in wanted:
            if any(path.is_relative_to(t) for t in targets) and not any(path.is_relative_to(k) for k in kept):
                kept.append(path)
        return [(path, STAGING / f"{self.name}-{i}") for i, path in enumerate(kept)]

    def argv(self, container: dict[str, Any]) -> list[str]:
        root = self.roots.get(container["name"])
        if root is not None:
            return self._rooted_argv(container, root)
        script = ["set -e"]
        kept = self._kept(container)
        for path, staging in kept:
            script.append(f"mount --bind {shlex.quote(str(path))} {shlex.quote(str(staging))}")
        for source, target, read_only in self._mounts(container):
            script.append(f"mount --bind {shlex.quote(str(source))} {shlex.quote(target)}")
            if read_only:
                script.append(f"mount -o remount,bind,ro {shlex.quote(target)}")
        for path, staging in kept:
            script.append(f"mkdir -p {shlex.quote(str(path))}")
            script.append(f"mount --bind {shlex.quote(str(staging))} {shlex.quote(str(path))}")
        security = {**(self.spec.get("securityContext") or {}), **(container.get("securityContext") or {})}
        if security.get("readOnlyRootFilesystem"):
            script.append("mount -o remount,bind,ro /")
        env = self.env(container)
        command = self._command(container, env, None)
        user = []
        can_switch = interpreter_usable_by_others() if self.can_switch_user is None else self.can_switch_user
        if "runAsUser" in security and can_switch:
            group = security.get("runAsGroup", security["runAsUser"])
            extra = self._supplementary_groups()
            groups = [f"--groups={','.join(map(str, extra))}"] if extra else ["--clear-groups"]
            user = ["setpriv", f"--reuid={security['runAsUser']}", f"--regid={group}", *groups]
            if security.get("allowPrivilegeEscalation") is False:
                user.append("--no-new-privs")
        unshare = ["unshare", "--mount", "--propagation", "private"]
        relayed = self._relayed(container)
        if relayed:
            unshare.insert(2, "--net")
            inside = [a for port, sock in relayed for a in ("--unix", f"{sock}=127.0.0.1:{port}")]
            script += [
                "ip link set lo up",
                shlex.join([sys.executable, "-m", "kvgate.testing.netns_relay", "--die-with-parent", *inside])
                + " >/dev/null 2>&1 &",
            ]
        script.append("exec " + shlex.join([*user, *command]))
        return [*unshare, "sh", "-c", "\n".join(script)]

    def ports(self, container: dict[str, Any]) -> list[int]:
        """The ports a container serves: its containerPorts and the ones its probes dial."""
        named = {p.get("name"): int(p["containerPort"]) for p in container.get("ports", [])}
        found = set(named.values())
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container.get(kind) or {}
            for handler in ("httpGet", "tcpSocket", "grpc"):
                port = (probe.get(handler) or {}).get("port")
                if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
                    found.add(int(port))
                elif port in named:
                    found.add(named[port])
        return sorted(found)

    def _relayed(self, container: dict[str, Any]) -> list[tuple[int, Path]]:
        if container["name"] not in self.own_network:
            return []
        key = hashlib.sha1(f"{self.root}/{container['name']}".encode()).hexdigest()[:12]
        return [(port, RELAY_DIR / f"{key}-{port}.sock") for port in self.ports(container)]

    def _relay_out(self, container: dict[str, Any]) -> None:
        """The outside half: the pod's address and each port, to the namespace's sockets."""
        relayed = self._relayed(container)
        if not relayed:
            return
        RELAY_DIR.mkdir(parents=True, exist_ok=True)
        outside = [a for port, sock in relayed for a in ("--tcp", f"{self.pod_ip}:{port}={sock}")]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvgate.testing.netns_relay", *outside],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self._procs.append(proc)

    def _command(self, container: dict[str, Any], env: dict[str, str], root: Root | None) -> list[str]:
        """command and args, over the image's ENTRYPOINT and CMD as Kubernetes combines them:
        command replaces ENTRYPOINT (and drops CMD), args replace CMD; $(VAR) expanded."""
        own = [_expand(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
        if root is None:
            command = own
        elif "command" in container:
            command = own
        elif "args" in container:
            command = [*root.config.entrypoint, *own]
        else:
            command = [*root.config.entrypoint, *root.config.cmd]
        if not command:
            raise ContainerConfigError(f"container {container['name']}: no command, and the image has none")
        if self.own_address and container["name"] not in self.own_network:
            command = [
                a.replace("0.0.0.0", self.pod_ip).replace("tcp://*:", f"tcp://{self.pod_ip}:")
                for a in command
            ]
        return command

    # -- image mode ----------------------------------------------------------------------------
    def _security(self, container: dict[str, Any]) -> dict[str, Any]:
        return {**(self.spec.get("securityContext") or {}), **(container.get("securityContext") or {})}

    def _pod_files(self) -> list[tuple[Path, str, bool]]:
        """/etc/hosts and /etc/hostname, as the kubelet writes them for a pod."""
        hosts, hostname = self.root / "hosts", self.root / "hostname"
        if not hosts.exists():
            self.root.mkdir(parents=True, exist_ok=True)
            hosts.write_text(
                f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost\n{self.pod_ip}\t{self.name}\n"
            )
            hostname.write_text(self.name + "\n")
        return [(hosts, "/etc/hosts", False), (hostname, "/etc/hostname", False)]

    def _rooted_mounts(self, container: dict[str, Any], root: Root) -> list[tuple[Path, Path, bool]]:
        """(source, target on this machine, read-only): each target resolved inside the root,
        parents first, so a mount is never hidden by one over its parent."""
        mounts = [*self._pod_files(), *self._mounts(container)]
        if self.podnet is not None:
            mounts.append((self.podnet, PODNET_IN_ROOT, True))
        if all(target != "/dev/shm" for _, target, _ in mounts):
            shm = self.root / "shm"
            shm.mkdir(parents=True, exist_ok=True)
            shm.chmod(0o1777)
            mounts.append((shm, "/dev/shm", False))
        resolved = [(source, inside(root.path, target), ro) for source, target, ro in mounts]
        return sorted(resolved, key=lambda m: len(m[1].parts))

    def user(self, container: dict[str, Any], root: Root) -> tuple[int, int, list[int]]:
        """The uid, gid and supplementary groups the container runs with: runAsUser and
        runAsGroup over the image's USER (a name looked up in the image's /etc/passwd)."""
        security = self._security(container)
        name, _, group = root.config.user.partition(":")
        passwd = _table(root.path / "etc" / "passwd")
        groups = _table(root.path / "etc" / "group")
        if "runAsUser" in security:
            uid = int(security["runAsUser"])
        elif not name or name.isdigit():
            uid = int(name or 0)
        elif name in passwd:
            uid = int(passwd[name][2])
        else:
            raise ContainerConfigError(f"unable to find user {name}: no matching entries in passwd file")
        if "runAsGroup" in security:
            gid = int(security["runAsGroup"])
        elif group:
            if group.isdigit():
                gid = int(group)
            elif group in groups:
                gid = int(groups[group][2])
            else:
                raise ContainerConfigError(f"unable to find group {group}: no matching entries in group file")
        else:
            entry = next((e for e in passwd.values() if e[2] == str(uid) and len(e) > 3), None)
            gid = int(entry[3]) if entry else 0
        if security.get("runAsNonRoot") and uid == 0:
            raise ContainerConfigError("container has runAsNonRoot and image will run as root")
        return uid, gid, self._supplementary_groups()

    def _supplementary_groups(self) -> list[int]:
        """The pod's supplementalGroups and its fsGroup, which every container also runs in."""
        pod_security = self.spec.get("securityContext") or {}
        extra = {int(g) for g in pod_security.get("supplementalGroups", [])}
        if pod_security.get("fsGroup") is not None:
            extra.add(int(pod_security["fsGroup"]))
        return sorted(extra)

    def _rooted_argv(self, container: dict[str, Any], root: Root) -> list[str]:
        q = shlex.quote
        r = root.path
        security = self._security(container)
        env = self.env(container)
        command = self._command(container, env, root)
        uid, gid, groups = self.user(container, root)
        script = [
            "set -e",
            # a mount of its own, so that making it read-only touches this container's view alone
            f"mount --bind {q(str(r))} {q(str(r))}",
            f"mount -t proc proc {q(str(r / 'proc'))}",
            f"mount -t tmpfs -o nosuid,mode=755 dev {q(str(r / 'dev'))}",
        ]
        for node in DEVICES:
            script.append(
                f": >{q(str(r / 'dev' / node))}; mount --bind /dev/{node} {q(str(r / 'dev' / node))}"
            )
        script += [
            f"mkdir {q(str(r / 'dev' / 'shm'))} {q(str(r / 'dev' / 'pts'))}",
            f"ln -s /proc/self/fd {q(str(r / 'dev' / 'fd'))}",
            *(
                f"ln -s /proc/self/fd/{i} {q(str(r / 'dev' / n))}"
                for i, n in enumerate(("stdin", "stdout", "stderr"))
            ),
            f"mount --rbind /sys {q(str(r / 'sys'))}",
            f"mount -o remount,bind,ro {q(str(r / 'sys'))}",
        ]
        for source, target, read_only in self._rooted_mounts(container, root):
            script.append(f"mount --bind {q(str(source))} {q(str(target))}")
            if read_only:
                script.append(f"mount -o remount,bind,ro {q(str(target))}")
        if security.get("readOnlyRootFilesystem"):
            script.append(f"mount -o remount,bind,ro {q(str(r))}")
        script.append(f"hostname {q(self.name)}")
        launcher = [sys.executable, "-m", "kvgate.testing.pod_exec", "--root", str(r),
                    "--workdir", container.get("workingDir") or root.config.workdir,
                    "--user", f"{uid}:{gid}", "--groups", ",".join(map(str, groups))]  # fmt: skip
        drop = (security.get("capabilities") or {}).get("drop") or []
        if drop:
            launcher += ["--drop-caps", ",".join(drop)]
        if security.get("allowPrivilegeEscalation") is False:
            launcher.append("--no-new-privs")
        if self.podnet is not None:
            launcher += ["--preload", PODNET_IN_ROOT]
        script.append("exec " + shlex.join([*launcher, "--", *command]))
        return ["unshare", "--mount", "--uts", "--propagation", "private", "sh", "-c", "\n".join(script)]

    def _prepare_root(self, container: dict[str, Any], root: Root) -> None:
        """Mount points inside the root's writable layer (the image is not touched)."""
        for source, target, _ in self._rooted_mounts(container, root):
            if source.is_dir():
                target.mkdir(parents=True, exist_ok=True)
            elif not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()

    def _prepare(self, container: dict[str, Any]) -> dict[str, str]:
        root = self.roots.get(container["name"])
        if root is not None:
            self._prepare_root(container, root)
            return self.env(container)
        points = [Path(t) for _, t, _ in self._mounts(container)] + [s for _, s in self._kept(container)]
        for point in points:
            if not point.exists():
                missing = [p for p in [point, *point.parents] if not p.exists()]
                point.mkdir(parents=True)
                self._made_mount_points += missing
        return self.env(container)

    def run(self, container: dict[str, Any], timeout: float) -> subprocess.CompletedProcess[str]:
        """An init container: runs to completion (or until `stop`, which it counts among the
        pod's processes, or `timeout`: then it is killed and the result says so)."""
        env = self._prepare(container)
        argv = self.argv(container)
        proc = subprocess.Popen(
            argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/"
        )
        self._procs.append(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
            err += f"\nkilled after {timeout:g} s"
        return subprocess.CompletedProcess(argv, proc.returncode, out, err)

    def start(self, container: dict[str, Any], log: Path) -> Container:
        env = self._prepare(container)
        if not any(p.poll() is None for p in self._relays.get(container["name"], [])):
            before = len(self._procs)
            self._relay_out(container)
            self._relays[container["name"]] = self._procs[before:]
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                self.argv(container), env=env, stdout=out, stderr=subprocess.STDOUT, cwd="/"
            )
        self._procs.append(proc)
        return Container(f"{self.name}/{container['name']}", proc, log)

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM, up to `grace` seconds for every container to exit, then SIGKILL."""
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for point in sorted(set(self._made_mount_points), key=lambda p: len(p.parts), reverse=True):
            try:
                point.rmdir()
            except OSError:
                pass
        shutil.rmtree(self.root / "volumes", ignore_errors=True)
        if self.store is not None:
            for root in self.roots.values():
                self.store.remove(root.name)
        for container in self.spec["containers"]:
            for _, sock in self._relayed(container):
                sock.unlink(missing_ok=True)
        try:
            STAGING.rmdir()  # the last pod to stop removes the shared parent
        except OSError:
            pass

    def as_pod_object(self, ready: bool = True) -> dict[str, Any]:
        """The Pod the API server would list for it."""
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": self.name, "namespace": self.namespace, "labels": dict(self.labels)},
            "status": {
                "phase": "Running",
                "podIP": self.pod_ip,
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        }


def inside(root: Path, path: str) -> Path:
    """`path` as the container sees it, on this machine: its links followed inside `root` (an
    absolute target starts again at the root, `..` stops there), so no mount lands outside it
    (Debian's /var/run is a link to /run: on the host it would be the host's /run)."""
    parts = [p for p in PurePosixPath(path).parts if p != "/"]
    resolved: list[str] = []
    hops = 0
    while parts:
        part = parts.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        candidate = root.joinpath(*resolved, part)
        if candidate.is_symlink():
            hops += 1
            if hops > 40:
                raise ContainerConfigError(f"{path}: too many levels of symbolic links in the image")
            target = os.readlink(candidate)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in PurePosixPath(target).parts if p != "/"] + parts
            continue
        resolved.append(part)
    return root.joinpath(*resolved)


def _table(path: Path) -> dict[str, list[str]]:
    """/etc/passwd or /etc/group of an image, by name (missing: empty)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    return {f[0]: f for f in (line.split(":") for line in lines) if len(f) >= 3}


def _expand(arg: str, env: dict[str, str]) -> str:
    """The kubelet's $(VAR) expansion in command and args: a defined variable is replaced, an
    undefined reference stays as written, and $$ escapes a dollar."""

    def one(m: re.Match[str]) -> str:
        if m[0] == "$$":
            return "$"
        return env.get(m[1], m[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)", one, arg)


def pod_from_deployment(deployment: dict[str, Any], root: Path, component: str, **kw: Any) -> Pod:
    template = deployment["spec"]["template"]
    return Pod(
        spec=template["spec"],
        root=root,
        name=f"{deployment['metadata']['name']}-0",
        namespace=deployment["metadata"]["namespace"],
        labels=dict(template["metadata"]["labels"]),
        image_env=image_env(component),
        **kw,
    )
