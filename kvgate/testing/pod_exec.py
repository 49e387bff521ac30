"""The last step of starting a container in its image's root, what runc does after the mounts:
chroot into the root, enter the working directory, drop capabilities from the bounding set, set
no_new_privs, switch to the user and groups, and exec the command found on the image's PATH.

    python -m kvgate.testing.pod_exec --root DIR --workdir /tmp --user 65532:65532 \
        [--groups 1,2] [--drop-caps ALL|NAME,...] [--no-new-privs] -- kvgate engine serve ...

It runs as root in the container's mount namespace (kvgate.testing.pods prepared it) and is the
host interpreter's last act: everything it needs is imported before the chroot.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import sys

PR_CAPBSET_DROP = 24
PR_SET_NO_NEW_PRIVS = 38
# capability(7) numbers; Kubernetes names them without the CAP_ prefix
CAPABILITIES = (
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE "
    "NET_BIND_SERVICE NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO "
    "SYS_CHROOT SYS_PTRACE SYS_PACCT SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME "
    "SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP MAC_OVERRIDE MAC_ADMIN SYSLOG "
    "WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE"
).split()


def _last_cap() -> int:
    try:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            return int(f.read())
    except (OSError, ValueError):
        return len(CAPABILITIES) - 1


def caps_to_drop(spec: str, last: int) -> list[int]:
    names = [n.strip().upper().removeprefix("CAP_") for n in spec.split(",") if n.strip()]
    if "ALL" in names:
        return list(range(last + 1))
    unknown = [n for n in names if n not in CAPABILITIES]
    if unknown:
        raise ValueError(f"unknown capabilities: {', '.join(unknown)}")
    return [CAPABILITIES.index(n) for n in names if CAPABILITIES.index(n) <= last]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m kvgate.testing.pod_exec", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--root", required=True)
    p.add_argument("--workdir", default="/")
    p.add_argument("--user", default="0:0", help="UID:GID")
    p.add_argument("--groups", default="", help="supplementary GIDs, comma-separated")
    p.add_argument("--drop-caps", default="")
    p.add_argument("--no-new-privs", action="store_true")
    p.add_argument("--preload", help="LD_PRELOAD for the command (a path inside the root)")
    p.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command")
    uid, _, gid = args.user.partition(":")
    groups = [int(g) for g in args.groups.split(",") if g]
    libc = ctypes.CDLL(None, use_errno=True)
    drop = caps_to_drop(args.drop_caps, _last_cap())

    os.chroot(args.root)
    os.chdir("/")
    try:
        os.makedirs(args.workdir, exist_ok=True)  # runc makes a missing working directory
        os.chdir(args.workdir)
    except OSError as exc:
        print(f"pod_exec: working directory {args.workdir}: {exc.strerror}", file=sys.stderr)
        return 128
    for cap in drop:
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            print(f"pod_exec: dropping capability {cap}: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
            return 128
    os.setgroups(groups)
    os.setgid(int(gid or uid))
    os.setuid(int(uid))  # from root to another user: permitted and effective sets are cleared
    if args.no_new_privs and libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        print(f"pod_exec: no_new_privs: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 128
    program = command[0] if "/" in command[0] else shutil.which(command[0], path=os.environ.get("PATH", ""))
    if program is None:
        print(f'pod_exec: exec: "{command[0]}": executable file not found in $PATH', file=sys.stderr)
        return 127
    env = dict(os.environ)
    if args.preload:
        env["LD_PRELOAD"] = args.preload
    try:
        os.execve(program, command, env)
    except OSError as exc:
        print(f"pod_exec: exec {program}: {exc.strerror}", file=sys.stderr)
        return 126


if __name__ == "__main__":
    sys.exit(main())
