"""The workspace client budget (slots, shared hysteresis state) and the workspace event log.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "budget_slots",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("holder", sa.Text, primary_key=True),
        sa.Column("reserved_at", Epoch, nullable=False),
        sa.Column("lease_until", Epoch, nullable=False),
    )
    op.create_table(
        "budget_state",
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("armed", sa.Boolean, nullable=False),
        sa.Column("last_refused", sa.JSON, nullable=False),
        sa.Column("updated_at", Epoch, nullable=False),
    )
    op.create_table(
        "bus_events",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("at", Epoch, nullable=False),
        sa.Column("kind", sa.Text, nullable=False),
        sa.Column("scope", sa.Text, nullable=False),
        sa.Column("source", sa.Text),
        sa.Column("detail", sa.JSON),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_bus_events_kind", "bus_events", ["kind", "id"])
    op.create_index("ix_bus_events_at", "bus_events", ["at"])


def downgrade() -> None:
    op.drop_table("bus_events")
    op.drop_table("budget_state")
    op.drop_table("budget_slots")
