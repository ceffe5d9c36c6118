"""Admission: call slots, circuits, the usage ledger, account state, and the
routing columns of route_log. The KPI views learn gate refusals (decision 'refuse')
and account-scoped cooldowns (model_cooldown keys ``model@account``).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-30
"""

from __future__ import annotations

import importlib

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")
_v4 = importlib.import_module("agentbus.migrations.versions.0004_kpis")

COOLDOWN_OUTCOMES = "('rate_limited', 'overloaded', 'timeout')"
ROUTE_COLUMNS = (
    ("role", sa.Text),
    ("fallback_from", sa.Text),
    ("provider", sa.Text),
    ("account", sa.Text),
    ("code", sa.Text),
    ("retry_after", Epoch),
    ("gates", sa.JSON),
    ("prompt_tokens", sa.Integer),
    ("completion_tokens", sa.Integer),
    ("cost", sa.Float),
)
VIEWS = {
    # KPI 1: claims whose every candidate was temporarily unusable (cooling,
    # refused by a gate, or answering 429/503/529/timeout).
    "kpi_cooldown_hits": f"""
SELECT r.task_id, r.claim_token, MAX(r.at) AS at,
       (SELECT e.to_status FROM task_events e
         WHERE e.task_id = r.task_id AND e.claim_token = r.claim_token
           AND e.from_status = 'claimed'
         ORDER BY e.id LIMIT 1) AS outcome
  FROM route_log r
 GROUP BY r.task_id, r.claim_token
HAVING SUM(CASE WHEN r.decision IN ('skip', 'refuse') OR r.outcome IN {COOLDOWN_OUTCOMES}
                THEN 0 ELSE 1 END) = 0
""",
    "kpi_resumes": _v4.VIEWS["kpi_resumes"],
    # KPI 3: every candidate skipped as cooling, checked against model_cooldown
    # at that moment (the model's own cooldown or its account's).
    "kpi_decisions": """
SELECT r.id, r.task_id, r.model, r.decision, r.at,
       CASE WHEN EXISTS (SELECT 1 FROM cooldown_history h
                          WHERE h.model_id IN (r.model, r.model || '@' || COALESCE(r.account, ''))
                            AND h.set_at <= r.at AND h.cooldown_until > r.at)
            THEN 1 ELSE 0 END AS consistent
  FROM route_log r
 WHERE r.decision = 'skip'
""",
    "kpi_failures": f"""
SELECT e.id, e.task_id, e.worker, e.at,
       CASE WHEN EXISTS (SELECT 1 FROM route_log r
                          WHERE r.task_id = e.task_id AND r.claim_token = e.claim_token)
             AND NOT EXISTS (SELECT 1 FROM route_log r
                              WHERE r.task_id = e.task_id AND r.claim_token = e.claim_token
                                AND r.decision NOT IN ('skip', 'refuse')
                                AND (r.outcome IS NULL OR r.outcome NOT IN {COOLDOWN_OUTCOMES}))
            THEN 1 ELSE 0 END AS cooldown_caused
  FROM task_events e
 WHERE e.from_status = 'claimed'
   AND (e.to_status IN ('failed', 'error') OR (e.to_status = 'queued' AND e.reason = 'retry'))
   AND e.reason NOT IN ('poison pill', 'lease expired')
""",
}


def _drop_views() -> None:
    for name in ("kpi_summary", *reversed(list(VIEWS))):
        op.execute(f"DROP VIEW {name}")


def _create_views(views: dict[str, str]) -> None:
    for name, body in views.items():
        op.execute(f"CREATE VIEW {name} AS {body}")
    op.execute(f"CREATE VIEW kpi_summary AS {_v4.SUMMARY}")


def upgrade() -> None:
    _drop_views()
    for name, kind in ROUTE_COLUMNS:
        op.add_column("route_log", sa.Column(name, kind))
    _create_views(VIEWS)
    op.create_table(
        "call_slots",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("provider", sa.Text, nullable=False),
        sa.Column("account", sa.Text, nullable=False, server_default=""),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("bulkhead", sa.Text),
        sa.Column("task_id", sa.BigInteger),
        sa.Column("worker", sa.Text),
        sa.Column("admitted_at", Epoch, nullable=False),
        sa.Column("lease_until", Epoch, nullable=False),
        sa.Column("released_at", Epoch),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_call_slots_account", "call_slots", ["provider", "account", "admitted_at"])
    op.create_index("ix_call_slots_agent", "call_slots", ["agent", "admitted_at"])
    op.create_index(
        "ix_call_slots_open",
        "call_slots",
        ["lease_until"],
        sqlite_where=sa.text("released_at IS NULL"),
        postgresql_where=sa.text("released_at IS NULL"),
    )
    op.create_table(
        "circuits",
        sa.Column("provider", sa.Text, primary_key=True),
        sa.Column("endpoint", sa.Text, nullable=False),
        sa.Column("state", sa.Text, nullable=False, server_default="closed"),
        sa.Column("consecutive_failures", sa.Integer, nullable=False, server_default="0"),
        sa.Column("opened_at", Epoch),
        sa.Column("open_until", Epoch),
        sa.Column("probe_owner", sa.Text),
        sa.Column("probe_until", Epoch),
        sa.Column("updated_at", Epoch, nullable=False),
        sa.CheckConstraint("state IN ('closed', 'open', 'half_open')", name="ck_circuits_state"),
    )
    op.create_table(
        "circuit_calls",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("provider", sa.Text, nullable=False),
        sa.Column("at", Epoch, nullable=False),
        sa.Column("failed", sa.Boolean, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_circuit_calls_provider", "circuit_calls", ["provider", "at"])
    op.create_table(
        "usage_daily",
        sa.Column("day", Epoch, primary_key=True),
        sa.Column("model", sa.Text, primary_key=True),
        sa.Column("account", sa.Text, primary_key=True),
        sa.Column("worker", sa.Text, primary_key=True),
        sa.Column("provider", sa.Text, nullable=False),
        sa.Column("calls", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("cost", sa.Float, nullable=False, server_default="0"),
    )
    op.create_table(
        "account_state",
        sa.Column("provider", sa.Text, primary_key=True),
        sa.Column("account", sa.Text, primary_key=True),
        sa.Column("fingerprint", sa.Text, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("unusable_since", Epoch, nullable=False),
    )


def downgrade() -> None:
    for table in ("account_state", "usage_daily", "circuit_calls", "circuits", "call_slots"):
        op.drop_table(table)
    _drop_views()
    with op.batch_alter_table("route_log") as batch:
        for name, _ in reversed(ROUTE_COLUMNS):
            batch.drop_column(name)
    _create_views({name: _v4.VIEWS[name] for name in VIEWS})
