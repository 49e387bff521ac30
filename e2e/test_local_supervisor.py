"""The process supervisor behind `kvgate up`: prefixed logs, whole process groups stopped, and no
orphans even when the supervisor itself is killed with SIGKILL."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kvgate.local.ports import PortBusyError, plan_ports
from kvgate.local.supervisor import ProcessSpec, Restarter, RestartPolicy, Supervisor, describe_exit
from kvgate.testing import eventually
from kvgate.testing.processes import pid_alive

# A child that prints, spawns a grandchild into its own group, reports the grandchild's pid,
# and then sleeps (ignoring nothing: SIGTERM ends it).
PARENT = textwrap.dedent(
    """
    import subprocess, sys, time
    print("hello from the child", flush=True)
    g = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    print(f"grandchild {g.pid}", flush=True)
    time.sleep(300)
    """
)


def _grandchild(lines: list[str]) -> int:
    return int(next(line for line in lines if "grandchild" in line).split()[-1])


def test_logs_are_prefixed_and_stop_all_ends_the_whole_group(tmp_path: Path) -> None:
    echo = io.StringIO()
    sup = Supervisor(tmp_path, echo=echo)
    proc = sup.start(ProcessSpec(name="engine-0", argv=[sys.executable, "-c", PARENT]))
    eventually(lambda: "grandchild" in echo.getvalue(), 15, "the grandchild's pid in the log")
    lines = echo.getvalue().splitlines()
    assert lines[0].startswith("[engine-0]") and lines[0].endswith("hello from the child")
    grandchild = _grandchild(lines)
    sup.stop_all(timeout_s=5)
    assert proc.exit_code() is not None
    eventually(lambda: not pid_alive(grandchild), 10, "the grandchild gone after stop_all")
    assert "hello from the child" in (tmp_path / "engine-0.log").read_text()
    assert proc.tail()[0] == "hello from the child"


def test_a_progress_bar_shows_as_where_it_ended_not_one_endless_line(tmp_path: Path) -> None:
    """A bar redraws with carriage returns (tqdm when stderr is not a terminal it knows of):
    the console shows the last redraw, the log file keeps every byte."""
    bar = "import sys; [sys.stderr.write(f'\\rLoading {i}/50') for i in range(51)]; sys.stderr.write('\\n'); print('done', flush=True)"
    echo = io.StringIO()
    sup = Supervisor(tmp_path, echo=echo)
    sup.start(ProcessSpec(name="engine-0", argv=[sys.executable, "-c", bar]))
    eventually(lambda: "done" in echo.getvalue(), 15, "the child's last line")
    lines = echo.getvalue().splitlines()
    assert lines[0].startswith("[engine-0]") and lines[0].endswith("Loading 50/50"), lines[0][:200]
    assert "Loading 0/50" not in lines[0]
    assert b"\rLoading 0/50" in (tmp_path / "engine-0.log").read_bytes()
    sup.stop_all(timeout_s=5)


def test_a_child_that_ignores_sigterm_is_killed(tmp_path: Path) -> None:
    sup = Supervisor(tmp_path)
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(300)"
    proc = sup.start(ProcessSpec(name="stubborn", argv=[sys.executable, "-c", stubborn]))
    eventually(lambda: "up" in (tmp_path / "stubborn.log").read_text(), 15, "the stubborn child up")
    t0 = time.monotonic()
    sup.stop_all(timeout_s=1)
    assert proc.exit_code() == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux-only")
def test_children_die_with_a_sigkilled_supervisor(tmp_path: Path) -> None:
    # The supervisor runs in its own process here, so it can be SIGKILLed like a crashed `kvgate up`.
    script = textwrap.dedent(
        f"""
        import sys, time
        from pathlib import Path
        from kvgate.local.supervisor import ProcessSpec, Supervisor
        sup = Supervisor(Path({str(tmp_path)!r}))
        p = sup.start(ProcessSpec(name="child", argv=[sys.executable, "-c", "import time; time.sleep(300)"]))
        print(p.pid, flush=True)
        time.sleep(300)
        """
    )
    outer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert outer.stdout is not None
    child = int(outer.stdout.readline())
    assert pid_alive(child)
    outer.kill()
    outer.wait(timeout=10)
    eventually(lambda: not pid_alive(child), 10, "the child gone with its supervisor (not orphaned)")


def test_port_plan_is_consecutive_from_the_base_and_names_busy_ports() -> None:
    plan = plan_ports(8080, 20000, 2)
    assert plan.engines == (20000, 20001)
    assert plan.kv_events == (20002, 20003)
    assert plan.kv_replay == (20004, 20005)
    assert (plan.epp_grpc, plan.epp_health, plan.epp_metrics, plan.envoy_admin) == (
        20006,
        20007,
        20008,
        20009,
    )
    free = plan_ports(0, 0, 3)
    ports = [p for _, p in free.named()]
    assert len(set(ports)) == len(ports) == 3 * 3 + 5
    free.check_free()
    clash = plan_ports(20000, 20000, 1)
    with pytest.raises(PortBusyError, match="planned for both"):
        clash.check_free()
    with pytest.raises(PortBusyError, match="out of range"):
        plan_ports(8080, 65534, 2).check_free()


def test_port_plan_gives_each_epp_replica_its_own_ports() -> None:
    plan = plan_ports(8080, 20000, 2, epp_replicas=2)
    assert [(e.grpc, e.health, e.metrics) for e in plan.epps] == [
        (20006, 20007, 20008),
        (20009, 20010, 20011),
    ]
    assert plan.envoy_admin == 20012 and plan.epp_grpc == 20006
    assert ("epp-1 ext-proc gRPC", 20009) in plan.named()
    with pytest.raises(ValueError, match="EPP replica"):
        plan_ports(8080, 20000, 2, epp_replicas=0)


def test_restart_backoff_doubles_is_capped_and_gives_up_on_a_crash_loop() -> None:
    r = Restarter(RestartPolicy(initial_backoff_s=0.5, max_backoff_s=3.0, max_restarts=4, window_s=60))
    assert [r.on_exit("engine-0", t) for t in (0, 1, 2, 3)] == [0.5, 1.0, 2.0, 3.0]
    assert r.on_exit("engine-0", 4) is None  # the fifth exit within 60 s: crash-looping
    assert r.on_exit("epp-0", 4) == 0.5  # counted per child
    # exits older than the window are forgotten: an occasional crash never adds up to giving up
    r2 = Restarter(RestartPolicy(max_restarts=1, window_s=10))
    assert r2.on_exit("envoy", 0) == 0.5
    assert r2.on_exit("envoy", 11) == 0.5
    assert not r2.due("envoy", 11.2) and r2.pending("envoy")
    assert r2.due("envoy", 11.5) and not r2.pending("envoy")


def test_restart_starts_the_same_command_again_and_appends_to_its_log(tmp_path: Path) -> None:
    echo = io.StringIO()
    sup = Supervisor(tmp_path, echo=echo)
    argv = [sys.executable, "-c", "import os; print('run', os.getpid(), flush=True)"]
    proc = sup.start(ProcessSpec(name="flaky", argv=argv))
    first = proc.pid
    proc.popen.wait(timeout=15)
    with pytest.raises(RuntimeError):
        sup.restart(
            sup.start(ProcessSpec(name="sleeper", argv=[sys.executable, "-c", "import time; time.sleep(60)"]))
        )
    sup.restart(proc)
    assert proc.pid != first and proc in sup.processes
    proc.popen.wait(timeout=15)
    sup.stop_all(timeout_s=5)
    log = (tmp_path / "flaky.log").read_text().splitlines()
    assert log == [f"run {first}", f"run {proc.pid}"]
    assert describe_exit(-signal.SIGKILL) == "signal SIGKILL" and describe_exit(3) == "code 3"
