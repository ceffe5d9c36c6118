"""Workspace settings (the client budget's mode and size), the refusal as clients see
it on route_log, and the record of adopted tables for databases migrated before it.

An earlier release adopted the older system's ops_todos and model_cooldown in
place, without the keys the demotion's and the cooldowns' upserts need; such a
table is now kept aside as legacy_<name> like revision 0002 does (this
revision's downgrade leaves it so; 0002's puts it back).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-30
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

from agentbus.migrations import adoption

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")
_v2 = importlib.import_module("agentbus.migrations.versions.0002_agentbus_schema")
_v4 = importlib.import_module("agentbus.migrations.versions.0004_kpis")


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
    adoption.repair("ops_todos", _v2._create_ops_todos, ["kind", "task_id"])
    views = {"active_cooldowns": _v4.ACTIVE_COOLDOWNS}
    adoption.repair("model_cooldown", _v2._create_model_cooldown, ["model_id"], views)


def downgrade() -> None:
    # adopted_tables stays: revision 0002's downgrade reads it.
    # A plain DROP COLUMN (SQLite 3.35+): a batch copy would trip over the KPI views.
    op.execute("ALTER TABLE route_log DROP COLUMN refusal")
    op.drop_table("workspace_settings")
