"""The older system's bus_commands table, created only where it is missing.

A database that already has it (the older agent bus) keeps it as it is, rows
and extra columns included; revision 0002 then upgrades it in place.

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

# REAL on SQLite; double precision on Postgres (its REAL is 4 bytes: seconds lost).
Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    if sa.inspect(op.get_bind()).has_table("bus_commands"):
        return
    op.create_table(
        "bus_commands",
        sa.Column("id", sa.BigInteger().with_variant(sa.Integer(), "sqlite"), primary_key=True),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("command", sa.Text),
        sa.Column(
            "status",
            sa.Text,
            sa.CheckConstraint("status IN ('queued','claimed','done','failed','error')"),
            nullable=False,
            server_default="queued",
        ),
        sa.Column("result_note", sa.Text),
        sa.Column("created_at", Epoch),
        sa.Column("updated_at", Epoch),
        sqlite_autoincrement=True,
    )


def downgrade() -> None:
    op.drop_table("bus_commands")
