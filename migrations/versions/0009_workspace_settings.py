"""Workspace settings (the client budget's mode and size), the refusal as clients see
it on route_log, and the record of adopted tables for databases migrated before it.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

from agentbus.migrations import adoption

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "workspace_settings",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("value", sa.JSON, nullable=False),
        sa.Column("updated_at", Epoch, nullable=False),
        sa.Column("updated_by", sa.Text),
    )
    op.add_column("route_log", sa.Column("refusal", sa.JSON))
    if not sa.inspect(op.get_bind()).has_table("adopted_tables"):
        adoption.create_record_table()  # revision 0002 creates it since this release


def downgrade() -> None:
    # adopted_tables stays: revision 0002's downgrade reads it.
    # A plain DROP COLUMN (SQLite 3.35+): a batch copy would trip over the KPI views.
    op.execute("ALTER TABLE route_log DROP COLUMN refusal")
    op.drop_table("workspace_settings")
