"""The schema the batch service had before migrations: files, batches and their lines.

Revision ID: 0001
Revises:
Create Date: 2026-12-08
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.Integer(), nullable=False),
        sa.Column("path", sa.String(1024), nullable=False),
    )
    op.create_index("ix_files_id", "files", ["id"], unique=True)
    op.create_index("ix_files_owner", "files", ["owner"])
    op.create_table(
        "batches",
        sa.Column("seq", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("id", sa.String(64), nullable=False),
        sa.Column("owner", sa.String(64), nullable=False),
        sa.Column("authorization", sa.Text(), nullable=True),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(16), nullable=False),
        sa.Column("metadata_json", sa.Text(), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("errors_json", sa.Text(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("created_at", sa.Integer(), nullable=False),
        *(
            sa.Column(f"{stamp}_at", sa.Integer(), nullable=True)
            for stamp in (
                "expires",
                "in_progress",
                "finalizing",
                "completed",
                "failed",
                "cancelling",
                "cancelled",
            )
        ),
    )
    op.create_index("ix_batches_id", "batches", ["id"], unique=True)
    op.create_index("ix_batches_owner", "batches", ["owner"])
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_table(
        "lines",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id"), nullable=False),
        sa.Column("idx", sa.Integer(), nullable=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("url", sa.String(64), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("request_id", sa.String(64), nullable=True),
        sa.Column("claimed_by", sa.String(128), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.UniqueConstraint("batch_id", "custom_id"),
        sa.UniqueConstraint("batch_id", "idx"),
    )
    op.create_index("ix_lines_batch_id", "lines", ["batch_id"])
    op.create_index("ix_lines_status", "lines", ["status"])


def downgrade() -> None:
    for table in ("lines", "batches", "files"):
        op.drop_table(table)
