"""A completed task's answer besides its text: ``bus_commands.result_detail`` (JSON:
model, finish_reason, tool_calls, usage).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("bus_commands", sa.Column("result_detail", sa.JSON))


def downgrade() -> None:
    op.execute("ALTER TABLE bus_commands DROP COLUMN result_detail")
