"""Observations processes add up: histograms of call latency, task run time and
sweeper passes, and the sweeper's job failures (``bus_observations``).

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "bus_observations",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("labels", sa.Text, primary_key=True),
        sa.Column("le", sa.Text, primary_key=True),
        sa.Column("value", sa.Float, nullable=False, server_default="0"),
    )


def downgrade() -> None:
    op.drop_table("bus_observations")
