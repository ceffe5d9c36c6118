"""Rate windows by number: ``call_slots.account_seq`` and ``agent_seq`` number each
call in its account's and its agent's window, so that an admission finds the
limit-th newest call with two index lookups instead of reading every call of the
window. The calls already there are numbered in admission order. The windows'
indexes by time give way to these (a planner without statistics chose them).

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

#: column -> the columns that make one window, and the window's index by time
WINDOWS = {
    "account_seq": (("provider", "account"), "ix_call_slots_account"),
    "agent_seq": (("agent",), "ix_call_slots_agent"),
}


def upgrade() -> None:
    for column, (keys, by_time) in WINDOWS.items():
        op.drop_index(by_time, "call_slots")
        op.add_column("call_slots", sa.Column(column, sa.BigInteger))
        op.create_index(f"ix_call_slots_{column}", "call_slots", [*keys, column])
        op.execute(
            f"UPDATE call_slots SET {column} = numbered.seq FROM (SELECT id, row_number()"
            f" OVER (PARTITION BY {', '.join(keys)} ORDER BY admitted_at, id) AS seq"
            " FROM call_slots) AS numbered WHERE numbered.id = call_slots.id"
        )


def downgrade() -> None:
    for column, (keys, by_time) in WINDOWS.items():
        op.drop_index(f"ix_call_slots_{column}", "call_slots")
        op.execute(f"ALTER TABLE call_slots DROP COLUMN {column}")
        op.create_index(by_time, "call_slots", [*keys, "admitted_at"])
