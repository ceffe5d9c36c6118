"""Token windows: ``call_slots.tokens_in`` and ``tokens_out`` hold what a call spends of
its account's token windows (tpm, itpm, otpm): the estimate from its admission until
its answer reports the real figures. NULL: no token window counted the call. A
partial index reads an account's counted calls by time, and only those: the rate
windows keep reading theirs by number. ``account_limits`` keeps the token windows
an account's answers announce, the size of a window the config does not set.

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

COUNTED = "tokens_in IS NOT NULL"
Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.add_column("call_slots", sa.Column("tokens_in", sa.BigInteger))
    op.add_column("call_slots", sa.Column("tokens_out", sa.BigInteger))
    counted = sa.text(COUNTED)
    op.create_index(
        "ix_call_slots_tokens",
        "call_slots",
        ["provider", "account", "admitted_at"],
        sqlite_where=counted,
        postgresql_where=counted,
    )

    op.create_table(
        "account_limits",
        sa.Column("provider", sa.Text, primary_key=True),
        sa.Column("account", sa.Text, primary_key=True),
        sa.Column("gate", sa.Text, primary_key=True),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("remaining", sa.BigInteger),
        sa.Column("observed_at", Epoch, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("account_limits")
    op.drop_index("ix_call_slots_tokens", "call_slots")
    for column in ("tokens_in", "tokens_out"):
        op.execute(f"ALTER TABLE call_slots DROP COLUMN {column}")
