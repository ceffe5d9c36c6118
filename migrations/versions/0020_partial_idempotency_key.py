"""The idempotency keys of bus_commands are unique through a partial index: only the
tasks that have a key are in it.

A UNIQUE constraint indexes every row, the many tasks enqueued without a key
(NULL) included: each enqueue wrote a page of that index for nothing. Unique
over the keyed rows alone, the index allows and refuses the same tasks, and an
enqueue without a key writes one index page less (SQLite, synchronous=FULL:
~10 % of the bare insert of a task and its event).

PostgreSQL drops the constraint and makes the index. SQLite cannot drop a
constraint: the table is made again from its own ``CREATE TABLE`` text without
it, as in 0011 (rows, indexes and the AUTOINCREMENT high-water mark kept).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-04
"""

from __future__ import annotations

import importlib
import re

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

_v11 = importlib.import_module("agentbus.migrations.versions.0011_cancelled")

NAME = "uq_bus_commands_idempotency_key"
CONSTRAINT = f"CONSTRAINT {NAME} UNIQUE (idempotency_key)"
KEYED = sa.text("idempotency_key IS NOT NULL")


def upgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        table = _v11.sqlite_table()
        found = re.search(r",\s*" + re.escape(CONSTRAINT), table)
        if found is None:
            raise RuntimeError(f"bus_commands has no {CONSTRAINT}: {table}")
        _v11.remake_sqlite_table(found.group(0), "")
    else:
        op.drop_constraint(NAME, "bus_commands", type_="unique")
    op.create_index(
        NAME,
        "bus_commands",
        ["idempotency_key"],
        unique=True,
        sqlite_where=KEYED,
        postgresql_where=KEYED,
    )


def downgrade() -> None:
    op.drop_index(NAME, "bus_commands")
    if op.get_bind().dialect.name == "sqlite":
        table = _v11.sqlite_table()
        if not table.endswith("\n)") or table.count("\n)") != 1:
            raise RuntimeError(f"bus_commands does not end as expected: {table}")
        _v11.remake_sqlite_table("\n)", f", \n\t{CONSTRAINT}\n)")
    else:
        op.create_unique_constraint(NAME, "bus_commands", ["idempotency_key"])
