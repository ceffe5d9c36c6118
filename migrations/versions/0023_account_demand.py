"""Fair shares of a provider account: ``account_demand`` says which agents wait for an
account's windows (refused by them, until a little after the refusal said), with the
share each has of them. While other agents wait, an agent may use its share of the
windows, and the rest is kept for them.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "account_demand",
        sa.Column("provider", sa.Text, primary_key=True),
        sa.Column("account", sa.Text, primary_key=True),
        sa.Column("agent", sa.Text, primary_key=True),
        sa.Column("share", sa.Float, nullable=False),
        sa.Column("until", Epoch, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("account_demand")
