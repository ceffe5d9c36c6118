"""Schedules: ``schedule_runs`` keeps, per configured schedule, when a sweeper first saw
it (no occurrence before that runs) and the last occurrence it enqueued or skipped.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "schedule_runs",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("first_seen", Epoch, nullable=False),
        sa.Column("last_at", Epoch),
        sa.Column("last_task_id", sa.BigInteger),
    )


def downgrade() -> None:
    op.drop_table("schedule_runs")
