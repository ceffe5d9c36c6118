"""Learnt token windows per model: the providers limit tokens per model (OpenAI per
model and organisation, Anthropic per model class), and the rate-limit headers of an
answer are those of the model that answered. ``account_limits`` gets ``model`` in
its key; the windows learnt so far are dropped (the next answers teach them again).

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def _table(*keys: str) -> None:
    op.create_table(
        "account_limits",
        *(sa.Column(key, sa.Text, primary_key=True) for key in keys),
        sa.Column("size", sa.BigInteger, nullable=False),
        sa.Column("remaining", sa.BigInteger),
        sa.Column("observed_at", Epoch, nullable=False),
    )


def upgrade() -> None:
    op.drop_table("account_limits")
    _table("provider", "account", "model", "gate")


def downgrade() -> None:
    op.drop_table("account_limits")
    _table("provider", "account", "gate")
