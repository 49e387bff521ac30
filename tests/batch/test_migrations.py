"""The batch schema comes from its Alembic migrations: a fresh database gets the newest revision,
one made before migrations existed (create_all, no alembic_version) is stamped and upgraded
with its rows kept, and the models never drift from what the migrations build (SQLite and a
real PostgreSQL)."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from kvgate.batch import migrations
from kvgate.batch.store import Base, Store
from tests.batch.test_store import make_batch


def _head() -> str:
    cfg = migrations.config(None)  # type: ignore[arg-type]  # (reads the scripts only)
    head = ScriptDirectory.from_config(cfg).get_current_head()
    assert head is not None
    return head


def _revision_and_drift(store: Store) -> tuple[str | None, list]:
    with store.engine.connect() as conn:
        ctx = MigrationContext.configure(conn)
        return ctx.get_current_revision(), compare_metadata(ctx, Base.metadata)


@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_fresh_database_is_at_the_newest_revision_and_matches_the_models(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    url = f"sqlite:///{tmp_path / 'b.db'}" if backend == "sqlite" else request.getfixturevalue("pg_url")
    store = Store(url)
    revision, drift = _revision_and_drift(store)
    assert revision == _head()
    assert drift == [], drift  # a model changed without a migration: add one under migrations/versions
    Store(url).close()  # a second start upgrades nothing and fails on nothing
    make_batch(store, 3)
    store.close()


def test_a_database_from_before_migrations_is_stamped_and_keeps_its_rows(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'old.db'}"
    engine = create_engine(url)
    Base.metadata.create_all(engine)  # what every earlier version did at start
    engine.dispose()
    first = Store(url)
    bid = make_batch(first, 2)
    first.close()
    with create_engine(url).connect() as conn:
        conn.execute(text("DROP TABLE alembic_version"))  # as the old versions left it
        conn.commit()
    store = Store(url)
    assert _revision_and_drift(store) == (_head(), [])
    assert store.counts(bid).total == 2
    store.close()
