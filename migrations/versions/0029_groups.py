"""Groups: ``bus_commands.group_key`` (a conversation, a customer) and the index of each
group's unfinished tasks, which a claim counts when the agent sets group_concurrency.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

IN_GROUP = (
    "group_key IS NOT NULL AND (status = 'queued' OR status = 'paused' OR status = 'claimed')"
)


def upgrade() -> None:
    op.add_column("bus_commands", sa.Column("group_key", sa.Text))
    op.create_index(
        "ix_bus_commands_group",
        "bus_commands",
        ["agent", "group_key", "id"],
        sqlite_where=sa.text(IN_GROUP),
        postgresql_where=sa.text(IN_GROUP),
    )


def downgrade() -> None:
    op.drop_index("ix_bus_commands_group", "bus_commands")
    op.execute("ALTER TABLE bus_commands DROP COLUMN group_key")
