"""``account_limits`` keeps the size of each learnt window alone: what an answer says
remains of it goes straight into the window (``slots.count_elsewhere``), never into
this row, so its ``remaining`` column was never written.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0025"
down_revision = "0024"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("account_limits") as batch:
        batch.drop_column("remaining")


def downgrade() -> None:
    with op.batch_alter_table("account_limits") as batch:
        batch.add_column(sa.Column("remaining", sa.BigInteger))
