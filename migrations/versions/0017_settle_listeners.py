"""Producers listening for settled tasks: ``settle_listeners`` (one row per listening
connection while it listens), so that a settle notifies only while someone listens.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

# REAL on SQLite; double precision on Postgres (its REAL is 4 bytes: seconds lost).
Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "settle_listeners",
        sa.Column("listener", sa.Text, primary_key=True),
        sa.Column("until", Epoch, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("settle_listeners")
