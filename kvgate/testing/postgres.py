"""A real PostgreSQL server on loopback for tests: Debian's binaries (postgresql-15), a data
folder of its own, a free port, trust authentication for one user, and a fresh database per test.

`PostgresServer.kill()` SIGKILLs the postmaster and `start()` brings it back on the same port and
data (crash recovery replays its WAL), the fault the batch service must survive. Run as root, the
server runs as the `postgres` user (initdb refuses root). `available()` says why it cannot run.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.local.ports import LOOPBACK, free_ports
from kvgate.testing.polling import eventually

PG_BIN = Path(os.environ.get("KVGATE_PG_BIN", "/usr/lib/postgresql/15/bin"))
USER = "kvgate"


def available() -> str | None:
    """None if a server can be started here, else why not (for pytest.skip)."""
    for tool in ("initdb", "postgres"):
        if not (PG_BIN / tool).is_file():
            return f"PostgreSQL binaries not found in {PG_BIN} (apt-get install postgresql-15, or $KVGATE_PG_BIN)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no 'postgres' user to run PostgreSQL as"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return "psycopg is not installed (pip install 'psycopg[binary]>=3', the batch extra)"
    return None


def _as_postgres() -> list[str]:
    if os.geteuid() != 0:
        return []
    return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups"]


@dataclass
class PostgresServer:
    root: Path
    port: int
    popen: subprocess.Popen[bytes] | None = None
    _dbs: int = field(default=0)

    @property
    def data(self) -> Path:
        return self.root / "data"

    @property
    def log_path(self) -> Path:
        return self.root / "postgres.log"

    def url(self, db: str = "postgres") -> str:
        return f"postgresql://{USER}@{LOOPBACK}:{self.port}/{db}"

    def init(self) -> None:
        self.data.mkdir(mode=0o700)
        if os.geteuid() == 0:
            pw = pwd.getpwnam("postgres")
            for path in (self.root, self.data):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        subprocess.run(
            [
                *_as_postgres(),
                str(PG_BIN / "initdb"),
                "-D",
                str(self.data),
                "-U",
                USER,
                "--auth=trust",
                "-E",
                "UTF8",
            ],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        log = self.log_path.open("ab")
        self.popen = subprocess.Popen(
            [
                *_as_postgres(),
                str(PG_BIN / "postgres"),
                "-D",
                str(self.data),
                "-p",
                str(self.port),
                "-c",
                f"listen_addresses={LOOPBACK}",
                "-c",
                f"unix_socket_directories={self.data}",
                "-c",
                "fsync=on",
                "-c",
                "max_connections=100",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        eventually(self._answers, 60, "PostgreSQL accepting connections", interval=0.2)

    def _answers(self) -> bool:
        import psycopg

        if self.popen is not None and self.popen.poll() is not None:
            raise AssertionError(f"postgres exited: {self.log_path.read_text()[-2000:]}")
        try:
            with psycopg.connect(self.url(), connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            return True
        except psycopg.OperationalError:
            return False

    def create_database(self) -> str:
        """A new empty database; its URL."""
        import psycopg

        self._dbs += 1
        name = f"t{self._dbs}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend (its whole group), no shutdown."""
        assert self.popen is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, signal.SIGKILL)
        self.popen.wait(timeout=30)
        # the backends die with the group; the stale pid file is the postmaster's to ignore
        eventually(
            lambda: not _any_in_group(self.popen.pid if self.popen else 0), 30, "postgres backends gone"
        )

    def stop(self) -> None:
        if self.popen is None or self.popen.poll() is not None:
            return
        self.popen.send_signal(signal.SIGINT)  # fast shutdown
        try:
            self.popen.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()


def _any_in_group(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@contextlib.contextmanager
def postgres_server():  # type: ignore[no-untyped-def]
    """A started server in a new temporary folder, stopped and removed afterwards."""
    root = Path(tempfile.mkdtemp(prefix="kvgate-pg-"))
    server = PostgresServer(root, free_ports(1)[0])
    try:
        server.init()
        server.start()
        yield server
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
