"""A task may be cancelled: ``cancelled`` joins the statuses bus_commands.status allows.

PostgreSQL changes the CHECK constraint in place. SQLite cannot alter a
constraint, so the table is made again from its own ``CREATE TABLE`` text with
the new list (columns of an adopted table included), its rows copied, its
indexes made again from their own text (the partial ones keep their WHERE)
and its AUTOINCREMENT high-water mark kept.

The downgrade fails the cancelled tasks (``last_error`` says they were
cancelled) before the constraint narrows again.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-01
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

_v2 = importlib.import_module("agentbus.migrations.versions.0002_agentbus_schema")
BEFORE = "'queued', 'claimed', 'done', 'paused', 'failed', 'error'"
AFTER = BEFORE + ", 'cancelled'"
CHECK = "ck_bus_commands_status"


def upgrade() -> None:
    _statuses(BEFORE, AFTER)


def downgrade() -> None:
    op.execute(
        "UPDATE bus_commands SET status = 'failed', "
        "last_error = COALESCE(last_error, 'cancelled') WHERE status = 'cancelled'"
    )
    _statuses(AFTER, BEFORE)


def _statuses(old: str, new: str) -> None:
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint(CHECK, "bus_commands", type_="check")
        op.create_check_constraint(CHECK, "bus_commands", f"status IN ({new})")
        return
    remake_sqlite_table(f"status IN ({old})", f"status IN ({new})")


def sqlite_table() -> str:
    """SQLite: bus_commands' own ``CREATE TABLE`` text."""
    return str(
        op.get_bind()
        .execute(
            sa.text("SELECT sql FROM sqlite_master WHERE type = 'table' AND name = 'bus_commands'")
        )
        .scalar_one()
    )


def remake_sqlite_table(old: str, new: str) -> None:
    """SQLite: bus_commands made again from its own ``CREATE TABLE`` text with ``old``
    written as ``new``, its rows copied, its indexes and triggers made again from their
    own text and its AUTOINCREMENT high-water mark kept."""
    bind = op.get_bind()
    table = sqlite_table()
    if old not in table:
        raise RuntimeError(f"bus_commands has no {old}: {table}")
    indexes = list(
        bind.execute(
            sa.text(
                "SELECT sql FROM sqlite_master WHERE type IN ('index', 'trigger') "
                "AND tbl_name = 'bus_commands' AND sql IS NOT NULL"
            )
        ).scalars()
    )
    seq = _v2._sqlite_sequence()
    made = table.replace(old, new, 1)
    made = made.replace("bus_commands", "bus_commands_new", 1)
    op.execute(made)
    op.execute("INSERT INTO bus_commands_new SELECT * FROM bus_commands")
    op.execute("DROP TABLE bus_commands")
    op.execute("ALTER TABLE bus_commands_new RENAME TO bus_commands")
    for index in indexes:
        op.execute(index)
    if seq is not None:  # ids are never reused: the old table's high-water mark stays
        op.execute(sa.text("DELETE FROM sqlite_sequence WHERE name = 'bus_commands'"))
        op.execute(
            sa.text(
                "INSERT INTO sqlite_sequence (name, seq) SELECT 'bus_commands', "
                "max(:seq, COALESCE((SELECT max(id) FROM bus_commands), 0))"
            ).bindparams(seq=seq)
        )
