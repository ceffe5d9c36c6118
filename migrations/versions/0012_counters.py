"""Counters that never go backwards: ``bus_counters``, kept by triggers.

A trigger on ``task_events`` counts pauses, resumes, demotions and the tasks
that end failed, in error or cancelled; one on ``route_log`` counts admission
refusals by code. They run in the transaction of the change they count, and
retention deletes the counted rows, never the counts. Completions are not
counted here: every worker would update one row per commit. The counts start
from what the tables hold at upgrade.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

# name, label, the condition on NEW (the inserted row), the table
TASK_COUNTS = [
    ("pauses", "''", "NEW.to_status = 'paused'"),
    ("resumes", "''", "NEW.from_status = 'paused' AND NEW.to_status = 'queued'"),
    ("demotions", "''", "NEW.reason = 'demoted'"),
    ("task_ends", "NEW.to_status", "NEW.to_status IN ('failed', 'error', 'cancelled')"),
]
ROUTE_COUNTS = [("admission_refusals", "NEW.code", "NEW.code IS NOT NULL")]
BUMP = (
    "INSERT INTO bus_counters (name, label, value) {source} "
    "ON CONFLICT (name, label) DO UPDATE SET value = bus_counters.value + 1"
)


def upgrade() -> None:
    op.create_table(
        "bus_counters",
        sa.Column("name", sa.Text, primary_key=True),
        sa.Column("label", sa.Text, primary_key=True, server_default=""),
        sa.Column("value", sa.BigInteger, nullable=False, server_default="0"),
    )
    _seed()
    for table, counts in (("task_events", TASK_COUNTS), ("route_log", ROUTE_COUNTS)):
        if op.get_bind().dialect.name == "postgresql":
            _postgres_trigger(table, counts)
        else:
            _sqlite_trigger(table, counts)


def downgrade() -> None:
    postgres = op.get_bind().dialect.name == "postgresql"
    for table in ("task_events", "route_log"):
        op.execute(f"DROP TRIGGER IF EXISTS count_{table}" + (f" ON {table}" if postgres else ""))
        if postgres:
            op.execute(f"DROP FUNCTION IF EXISTS agentbus_count_{table}()")
    op.drop_table("bus_counters")


def _seed() -> None:
    """The counts of what the tables hold now (history before this revision)."""
    for table, counts in (("task_events", TASK_COUNTS), ("route_log", ROUTE_COUNTS)):
        for name, label, when in counts:
            row = label.replace("NEW.", "")
            cond = when.replace("NEW.", "")
            by = "" if row == "''" else f" GROUP BY {row}"
            op.execute(
                f"INSERT INTO bus_counters (name, label, value) "
                f"SELECT '{name}', {row}, COUNT(*) FROM {table} WHERE {cond}{by}"
            )


def _sqlite_trigger(table: str, counts: list[tuple[str, str, str]]) -> None:
    body = "; ".join(
        BUMP.format(source=f"SELECT '{name}', {label}, 1 WHERE {when}")
        for name, label, when in counts
    )
    any_of = " OR ".join(f"({when})" for _, _, when in counts)
    op.execute(
        f"CREATE TRIGGER count_{table} AFTER INSERT ON {table} WHEN {any_of} BEGIN {body}; END"
    )


def _postgres_trigger(table: str, counts: list[tuple[str, str, str]]) -> None:
    body = " ".join(
        f"IF {when} THEN {BUMP.format(source=f'VALUES ({name!r}, {label}, 1)')}; END IF;"
        for name, label, when in counts
    )
    op.execute(
        f"CREATE FUNCTION agentbus_count_{table}() RETURNS trigger LANGUAGE plpgsql AS $$ "
        f"BEGIN {body} RETURN NULL; END $$"
    )
    any_of = " OR ".join(f"({when})" for _, _, when in counts)
    op.execute(
        f"CREATE TRIGGER count_{table} AFTER INSERT ON {table} FOR EACH ROW "
        f"WHEN ({any_of}) EXECUTE FUNCTION agentbus_count_{table}()"
    )
