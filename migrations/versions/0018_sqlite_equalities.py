"""SQLite: the status CHECK of bus_commands and the counting trigger of task_events
compare with equalities instead of an ``IN`` list.

SQLite evaluates ``x IN (a, b, c)`` over three or more constants by building a
temporary b-tree of the list, at every row the expression is evaluated for: the
CHECK at every insert of a task and every change of its status, the trigger's
condition at every event: ~30-40k instructions each time, ~140k a task a worker
claims and completes (callgrind). Written as ``x = a OR x = b OR …`` it
compares in place; what it allows and counts is the same. PostgreSQL evaluates
an ``IN`` list in place and is left as it is.

The table is made again as in 0011 (SQLite cannot alter a constraint); the
trigger is dropped and made again.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-02
"""

from __future__ import annotations

import importlib

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

_v11 = importlib.import_module("agentbus.migrations.versions.0011_cancelled")
_v12 = importlib.import_module("agentbus.migrations.versions.0012_counters")


def _as_equalities(in_list: str) -> str:
    """``x IN (a, b, c)`` written as ``x = a OR x = b OR x = c``."""
    column, _, values = in_list.partition(" IN (")
    return " OR ".join(f"{column} = {v.strip()}" for v in values.removesuffix(")").split(","))


AS_LIST = f"status IN ({_v11.AFTER})"
AS_EQUALITIES = _as_equalities(AS_LIST)

ENDS_AS_LIST = next(when for name, _, when in _v12.TASK_COUNTS if name == "task_ends")
ENDS_AS_EQUALITIES = _as_equalities(ENDS_AS_LIST)


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _v11.remake_sqlite_table(AS_LIST, AS_EQUALITIES)
        _counting_trigger(ENDS_AS_EQUALITIES)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        _v11.remake_sqlite_table(AS_EQUALITIES, AS_LIST)
        _counting_trigger(ENDS_AS_LIST)


def _counting_trigger(ends: str) -> None:
    """task_events' counting trigger made again (0012's), the condition of a task's end
    written ``ends``."""
    counts = [
        (name, label, ends if name == "task_ends" else when)
        for name, label, when in _v12.TASK_COUNTS
    ]
    op.execute("DROP TRIGGER count_task_events")
    _v12._sqlite_trigger("task_events", counts)
