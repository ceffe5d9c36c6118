"""Routing log, cooldown history and the KPI views.

The views have the same text on SQLite and Postgres. Base views give one row
per fact with its time (``at``) so any window can be applied; ``kpi_summary``
aggregates all time. ``active_cooldowns`` and ``bus_now`` differ per dialect
only in how they read the clock.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-30
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Epoch = sa.Float(precision=53).with_variant(sa.REAL(), "sqlite")

COOLDOWN_OUTCOMES = "('rate_limited', 'overloaded', 'timeout')"

VIEWS = {
    # KPI 1: every (task, claim) whose every model was cooling down (skipped, or
    # answered 429/503/529/timeout), with what became of the task then.
    "kpi_cooldown_hits": f"""
SELECT r.task_id, r.claim_token, MAX(r.at) AS at,
       (SELECT e.to_status FROM task_events e
         WHERE e.task_id = r.task_id AND e.claim_token = r.claim_token
           AND e.from_status = 'claimed'
         ORDER BY e.id LIMIT 1) AS outcome
  FROM route_log r
 GROUP BY r.task_id, r.claim_token
HAVING SUM(CASE WHEN r.decision = 'skip' OR r.outcome IN {COOLDOWN_OUTCOMES}
                THEN 0 ELSE 1 END) = 0
""",
    # KPI 2: every sweeper resume, with the task's next settled state
    # (done = success; paused, failed, error = not; NULL = still running).
    "kpi_resumes": """
SELECT r.id, r.task_id, r.at,
       (SELECT s.to_status FROM task_events s
         WHERE s.task_id = r.task_id AND s.id > r.id AND s.from_status = 'claimed'
           AND s.to_status IN ('done', 'paused', 'failed', 'error')
         ORDER BY s.id LIMIT 1) AS outcome
  FROM task_events r
 WHERE r.from_status = 'paused' AND r.to_status = 'queued'
""",
    # KPI 3: every model a worker skipped as cooling down, checked against what
    # model_cooldown said at that moment (from cooldown_history).
    "kpi_decisions": """
SELECT r.id, r.task_id, r.model, r.decision, r.at,
       CASE WHEN EXISTS (SELECT 1 FROM cooldown_history h
                          WHERE h.model_id = r.model AND h.set_at <= r.at
                            AND h.cooldown_until > r.at)
            THEN 1 ELSE 0 END AS consistent
  FROM route_log r
 WHERE r.decision = 'skip'
""",
    # KPI 4: every genuine failure a worker counted (it raises
    # consecutive_failures), flagged when cooldowns alone caused it.
    "kpi_failures": f"""
SELECT e.id, e.task_id, e.worker, e.at,
       CASE WHEN EXISTS (SELECT 1 FROM route_log r
                          WHERE r.task_id = e.task_id AND r.claim_token = e.claim_token)
             AND NOT EXISTS (SELECT 1 FROM route_log r
                              WHERE r.task_id = e.task_id AND r.claim_token = e.claim_token
                                AND r.decision <> 'skip'
                                AND (r.outcome IS NULL OR r.outcome NOT IN {COOLDOWN_OUTCOMES}))
            THEN 1 ELSE 0 END AS cooldown_caused
  FROM task_events e
 WHERE e.from_status = 'claimed'
   AND (e.to_status IN ('failed', 'error') OR (e.to_status = 'queued' AND e.reason = 'retry'))
   AND e.reason NOT IN ('poison pill', 'lease expired')
""",
}

SUMMARY = """
SELECT 1 AS kpi, 'preservation' AS name,
       (SELECT COUNT(*) FROM kpi_cooldown_hits WHERE outcome = 'paused') AS numerator,
       (SELECT COUNT(*) FROM kpi_cooldown_hits WHERE outcome IS NOT NULL) AS denominator,
       'paused / tasks whose every model was cooling' AS meaning, '100 %' AS target
UNION ALL
SELECT 2, 'resume success',
       (SELECT COUNT(*) FROM kpi_resumes WHERE outcome = 'done'),
       (SELECT COUNT(*) FROM kpi_resumes WHERE outcome IS NOT NULL),
       'done next / settled sweeper resumes', '>= 80 %'
UNION ALL
SELECT 3, 'cooldown consistency',
       (SELECT COUNT(*) FROM kpi_decisions WHERE consistent = 1),
       (SELECT COUNT(*) FROM kpi_decisions),
       'skips that matched model_cooldown at that moment', '100 %'
UNION ALL
SELECT 4, 'backoff inversion',
       (SELECT COUNT(*) FROM kpi_failures WHERE cooldown_caused = 1),
       (SELECT COUNT(*) FROM kpi_failures),
       'failure counts caused by cooldowns / all counted failures', '0'
"""

NOW = {
    "sqlite": "SELECT CAST((julianday('now') - 2440587.5) * 86400.0 AS REAL) AS epoch",
    "postgresql": "SELECT CAST(EXTRACT(EPOCH FROM clock_timestamp()) AS DOUBLE PRECISION) AS epoch",
}
ACTIVE_COOLDOWNS = """
SELECT c.model_id, c.cooldown_until, c.cooldown_until - n.epoch AS seconds_left, c.reason,
       c.source
  FROM model_cooldown c, bus_now n
 WHERE c.cooldown_until > n.epoch
"""


def upgrade() -> None:
    op.create_table(
        "route_log",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("task_id", sa.BigInteger, nullable=False),
        sa.Column("claim_token", sa.BigInteger, nullable=False),
        sa.Column("agent", sa.Text, nullable=False),
        sa.Column("worker", sa.Text),
        sa.Column("model", sa.Text, nullable=False),
        sa.Column("decision", sa.Text, nullable=False),
        sa.Column("outcome", sa.Text),
        sa.Column("cooldown_until", Epoch),
        sa.Column("at", Epoch, nullable=False),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_route_log_task", "route_log", ["task_id", "claim_token"])
    op.create_index("ix_route_log_at", "route_log", ["at"])
    op.create_table(
        "cooldown_history",
        sa.Column("id", BigId, primary_key=True),
        sa.Column("model_id", sa.Text, nullable=False),
        sa.Column("cooldown_until", Epoch, nullable=False),
        sa.Column("set_at", Epoch, nullable=False),
        sa.Column("reason", sa.Text),
        sa.Column("source", sa.Text),
        sqlite_autoincrement=True,
    )
    op.create_index("ix_cooldown_history_model", "cooldown_history", ["model_id", "set_at"])
    for name, body in VIEWS.items():
        op.execute(f"CREATE VIEW {name} AS {body}")
    op.execute(f"CREATE VIEW kpi_summary AS {SUMMARY}")
    op.execute(f"CREATE VIEW bus_now AS {NOW[op.get_bind().dialect.name]}")
    op.execute(f"CREATE VIEW active_cooldowns AS {ACTIVE_COOLDOWNS}")


def downgrade() -> None:
    for name in ("active_cooldowns", "bus_now", "kpi_summary", *reversed(list(VIEWS))):
        op.execute(f"DROP VIEW {name}")
    op.drop_table("cooldown_history")
    op.drop_table("route_log")
