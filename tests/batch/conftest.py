"""A real PostgreSQL server (Debian's postgresql-15 binaries) for the batch tests that need one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvgate.testing.postgres import PostgresServer, available, postgres_server


@pytest.fixture(scope="session")
def pg_server() -> Iterator[PostgresServer]:
    why = available()
    if why is not None:
        pytest.skip(why)
    with postgres_server() as server:
        yield server


@pytest.fixture
def pg_url(pg_server: PostgresServer) -> str:
    """A fresh empty database on the session's server."""
    return pg_server.create_database()
