"""The batch service's schema migrations (Alembic). `upgrade(connection)` brings a database to
the newest revision; Store runs it at start, under PostgreSQL's advisory lock when replicas
start together.

A database made before migrations existed (tables from `create_all`, no `alembic_version`) holds
revision 0001's schema: it is stamped 0001 first, then upgraded. A schema change is a new file
in versions/ (`alembic revision` against a scratch database, or by hand), and
tests/batch/test_migrations.py fails while the models and the newest revision disagree.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, inspect

HERE = Path(__file__).resolve().parent
BASELINE = "0001"  # the schema create_all made before migrations existed


def config(connection: Connection) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(HERE))
    cfg.attributes["connection"] = connection
    return cfg


def upgrade(connection: Connection) -> None:
    """The database at the newest revision (a fresh one gets every table)."""
    cfg = config(connection)
    tables = set(inspect(connection).get_table_names())
    if "batches" in tables and "alembic_version" not in tables:
        command.stamp(cfg, BASELINE)
    command.upgrade(cfg, "head")
