"""How far each worker's host clock is from the database's (PostgreSQL; 0 on SQLite):
``workers.clock_offset``, seconds the database's clock is ahead.

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-01
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("clock_offset", sa.Float))


def downgrade() -> None:
    op.execute("ALTER TABLE workers DROP COLUMN clock_offset")
