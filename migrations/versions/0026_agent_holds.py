"""Holds on agents' queues: ``agent_holds`` names the agents whose tasks no worker
claims (``busctl agents pause``), with who put the hold and why.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "agent_holds",
        sa.Column("agent", sa.Text, primary_key=True),
        sa.Column("reason", sa.Text),
        sa.Column("held_by", sa.Text, nullable=False),
        sa.Column("held_at", Epoch, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("agent_holds")
