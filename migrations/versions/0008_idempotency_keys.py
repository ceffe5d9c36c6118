"""Idempotency keys kept apart from tasks, so that they outlive the tasks' retention.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")


def upgrade() -> None:
    op.create_table(
        "idempotency_keys",
        sa.Column("key", sa.Text, primary_key=True),
        sa.Column("task_id", sa.BigInteger, nullable=False),
        sa.Column("created_at", Epoch, nullable=False),
    )
    op.create_index("ix_idempotency_keys_created", "idempotency_keys", ["created_at"])
    op.execute(
        "INSERT INTO idempotency_keys (key, task_id, created_at) "
        "SELECT idempotency_key, id, COALESCE(created_at, updated_at, 0) FROM bus_commands "
        "WHERE idempotency_key IS NOT NULL"
    )


def downgrade() -> None:
    op.drop_index("ix_idempotency_keys_created", table_name="idempotency_keys")
    op.drop_table("idempotency_keys")
