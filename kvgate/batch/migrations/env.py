"""Alembic's entry: migrations run on the connection `kvgate.batch.migrations.upgrade` passes
(never a URL from a config file), in its transaction."""

from __future__ import annotations

from alembic import context

from kvgate.batch.store import Base

connection = context.config.attributes["connection"]
context.configure(connection=connection, target_metadata=Base.metadata, render_as_batch=True)
with context.begin_transaction():
    context.run_migrations()
