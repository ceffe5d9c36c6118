"""A worker runs up to ``concurrency`` tasks at once: the workers table says how many
it may run and which it is running.

``current_task`` stays (one of the running tasks, the earliest claimed) for the
queries written against it.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column(
        "workers", sa.Column("concurrency", sa.Integer, nullable=False, server_default="1")
    )
    op.add_column("workers", sa.Column("running", sa.JSON))


def downgrade() -> None:
    # A plain DROP COLUMN (SQLite 3.35+), as revision 0009 does.
    op.execute("ALTER TABLE workers DROP COLUMN running")
    op.execute("ALTER TABLE workers DROP COLUMN concurrency")
