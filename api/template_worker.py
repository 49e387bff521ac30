"""Child process that renders one request-supplied chat template under hard OS limits.

Started by `kvgate.api.chat_template.render_untrusted_chat_template`: reads one JSON job on
stdin, applies RLIMIT_AS (address space) and RLIMIT_CPU before touching the template, renders,
writes one JSON answer on stdout and exits. A template that blows a limit gets the process
killed by the kernel; the parent then reports the limit to the client.
"""

from __future__ import annotations

import json
import math
import resource
import signal
import sys


def _vm_size_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    job = json.loads(sys.stdin.buffer.read())
    from kvgate.api.chat_template import _render_job  # imported before the limits: jinja2 loads here

    cpu = math.ceil(float(job["timeout_s"])) + 1
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    base = _vm_size_bytes()
    if base:
        limit = base + int(job["max_memory_bytes"])
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Wall clock from here on, not from the parent's spawn: a render that loops without output
    # (nested range loops) otherwise runs until RLIMIT_CPU, which on a busy host is several
    # times longer in wall time. SIGALRM's default action ends the process; the parent reports it.
    signal.setitimer(signal.ITIMER_REAL, float(job["timeout_s"]))
    try:
        answer = _render_job(job)
    except MemoryError:
        answer = {"error": "the request's chat template exceeded its memory limit"}
    sys.stdout.write(json.dumps(answer))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
