"""One spelling of outcomes: routing history says ``retryable`` and ``permanent``
(as the command provider's config does) where it said ``error`` and ``fatal``.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

RENAMES = {"error": "retryable", "fatal": "permanent"}


def upgrade() -> None:
    for old, new in RENAMES.items():
        op.execute(f"UPDATE route_log SET outcome = '{new}' WHERE outcome = '{old}'")


def downgrade() -> None:
    for old, new in RENAMES.items():
        op.execute(f"UPDATE route_log SET outcome = '{old}' WHERE outcome = '{new}'")
