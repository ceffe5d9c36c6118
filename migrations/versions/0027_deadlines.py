"""Deadlines: ``bus_commands.expires_at`` (a task not started by then is never started),
the index the sweeper finds the waiting ones by, and the count of the tasks a deadline
ended (``bus_counters`` ``expiries``, kept by the counting trigger of ``task_events``).

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-07
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

_v12 = importlib.import_module("agentbus.migrations.versions.0012_counters")
_v18 = importlib.import_module("agentbus.migrations.versions.0018_sqlite_equalities")

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")
WITH_DEADLINE = "expires_at IS NOT NULL AND (status = 'queued' OR status = 'paused')"
EXPIRIES = ("expiries", "''", "NEW.reason = 'deadline'")


def upgrade() -> None:
    op.add_column("bus_commands", sa.Column("expires_at", Epoch))
    op.create_index(
        "ix_bus_commands_deadline",
        "bus_commands",
        ["expires_at"],
        sqlite_where=sa.text(WITH_DEADLINE),
        postgresql_where=sa.text(WITH_DEADLINE),
    )
    _counting_trigger([*_counts(), EXPIRIES])


def downgrade() -> None:
    _counting_trigger(_counts())
    op.execute("DELETE FROM bus_counters WHERE name = 'expiries'")
    op.drop_index("ix_bus_commands_deadline", "bus_commands")
    op.execute("ALTER TABLE bus_commands DROP COLUMN expires_at")


def _counts() -> list[tuple[str, str, str]]:
    """task_events' counts as the trigger keeps them now (0012's; on SQLite a task's end
    written as equalities, 0018)."""
    if op.get_bind().dialect.name == "postgresql":
        return list(_v12.TASK_COUNTS)
    return [
        (name, label, _v18.ENDS_AS_EQUALITIES if name == "task_ends" else when)
        for name, label, when in _v12.TASK_COUNTS
    ]


def _counting_trigger(counts: list[tuple[str, str, str]]) -> None:
    """task_events' counting trigger made again, keeping ``counts``."""
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP TRIGGER count_task_events ON task_events")
        op.execute("DROP FUNCTION agentbus_count_task_events()")
        _v12._postgres_trigger("task_events", counts)
    else:
        op.execute("DROP TRIGGER count_task_events")
        _v12._sqlite_trigger("task_events", counts)
