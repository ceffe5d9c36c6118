"""bus_commands.paused_at: when the task last paused (the re-entry hold counts from it).

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    with op.batch_alter_table("bus_commands") as batch:
        batch.add_column(sa.Column("paused_at", Epoch))
    op.execute("UPDATE bus_commands SET paused_at = updated_at WHERE status = 'paused'")


def downgrade() -> None:
    with op.batch_alter_table("bus_commands") as batch:
        batch.drop_column("paused_at")
