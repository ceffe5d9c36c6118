"""Tasks counted by agent and state as they change (``task_counts``), and the finished
tasks indexed by when they finished.

Status, /metrics and the dashboard showed the tasks of each agent and state with a
``GROUP BY`` over ``bus_commands``: at 10 M rows that read 1.2 s at every scrape.
Triggers now keep the counts in the transaction of each change: an insert counts
its task, a change of state or agent moves it, a delete (retention, an operator's
SQL) takes it away; a ``TRUNCATE`` (PostgreSQL) empties the counts. Readers add up a
handful of rows.

Every worker's commit changes a count, so the counts are never one row that they all
update: on PostgreSQL each server process writes rows of its own (``shard`` is
``pg_backend_pid()``), which no other transaction writes while it runs, so that no
commit waits on another's count and no two deadlock on theirs. The sweeper adds these
rows into shard 0 now and then (``agentbus.queue.counts.fold``). SQLite has one writer
at a time and keeps shard 0 only.

The finished tasks get partial indexes on ``updated_at`` (done; failed and error;
cancelled): retention finds the tasks past their time, and status the last failures,
through them instead of reading every finished task. The events of pauses and resumes
get one on ``at``: the workspace's latest events are the end of it, where before the
event log was read backwards until enough pauses turned up (all of it, in a fleet that
had none). The client budget's refusals, which status added up from every
``refused_batch`` event ever written, are a counter of ``bus_counters``
(``budget_refused``), kept by a trigger on ``bus_events`` as 0012's are.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-07
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

#: name -> the states of its partial index on updated_at
FINISHED = {
    "ix_bus_commands_done_at": "status = 'done'",
    "ix_bus_commands_failed_at": "status IN ('failed', 'error')",
    "ix_bus_commands_cancelled_at": "status = 'cancelled'",
}
UPSERT = (
    "INSERT INTO task_counts (agent, status, shard, n) VALUES {rows} "
    "ON CONFLICT (agent, status, shard) DO UPDATE SET n = task_counts.n + excluded.n"
)
#: task_events: the events a pause begins or ends (``workspace_events.recent``)
PAUSE_EVENTS = "to_status = 'paused' OR from_status = 'paused'"
#: bus_events: the names a refused_batch event refused (its detail's count)
REFUSED = {
    "postgresql": "CASE WHEN json_typeof({d} -> 'count') = 'number' "
    "THEN ({d} ->> 'count')::numeric::bigint ELSE 0 END",
    "sqlite": "CASE WHEN json_valid({d}) AND json_type({d}, '$.count') IN ('integer', 'real') "
    "THEN CAST(json_extract({d}, '$.count') AS INTEGER) ELSE 0 END",
}
COUNT_REFUSED = (
    "INSERT INTO bus_counters (name, label, value) {source} "
    "ON CONFLICT (name, label) DO UPDATE SET value = bus_counters.value + excluded.value"
)
#: SQLite: the row's state or agent changed
CHANGED = "OLD.status IS NOT NEW.status OR OLD.agent IS NOT NEW.agent"


def upgrade() -> None:
    op.create_table(
        "task_counts",
        sa.Column("agent", sa.Text, primary_key=True),
        sa.Column("status", sa.Text, primary_key=True),
        sa.Column("shard", sa.BigInteger, primary_key=True, server_default="0"),
        sa.Column("n", sa.BigInteger, nullable=False, server_default="0"),
    )
    dialect = op.get_bind().dialect.name
    if dialect == "postgresql":
        _postgres_triggers()
    else:
        _sqlite_triggers()
    # After the triggers: PostgreSQL's CREATE TRIGGER holds writers off until this
    # transaction commits, so no task changes between the count and the triggers.
    op.execute(
        "INSERT INTO task_counts (agent, status, shard, n) "
        "SELECT agent, status, 0, COUNT(*) FROM bus_commands GROUP BY agent, status"
    )
    for name, where in FINISHED.items():
        clause = sa.text(where)
        op.create_index(
            name, "bus_commands", ["updated_at"], sqlite_where=clause, postgresql_where=clause
        )
    _count_refusals(dialect)
    paused = sa.text(PAUSE_EVENTS)
    op.create_index(
        "ix_task_events_paused_at",
        "task_events",
        ["at"],
        sqlite_where=paused,
        postgresql_where=paused,
    )


def downgrade() -> None:
    op.drop_index("ix_task_events_paused_at", "task_events")
    postgres = op.get_bind().dialect.name == "postgresql"
    op.execute("DROP TRIGGER IF EXISTS count_bus_events" + (" ON bus_events" if postgres else ""))
    if postgres:
        op.execute("DROP FUNCTION IF EXISTS agentbus_count_bus_events()")
    op.execute("DELETE FROM bus_counters WHERE name = 'budget_refused'")
    for name in FINISHED:
        op.drop_index(name, "bus_commands")
    if postgres:
        for trigger in ("count_tasks_added", "count_tasks_gone", "count_tasks_moved"):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger} ON bus_commands")
        op.execute("DROP TRIGGER IF EXISTS count_tasks_truncated ON bus_commands")
        for function in ("added", "gone", "moved", "truncated"):
            op.execute(f"DROP FUNCTION IF EXISTS agentbus_count_tasks_{function}()")
    else:
        for trigger in ("count_tasks_added", "count_tasks_gone", "count_tasks_moved"):
            op.execute(f"DROP TRIGGER IF EXISTS {trigger}")
    op.drop_table("task_counts")


def _sqlite_triggers() -> None:
    one = "(NEW.agent, NEW.status, 0, 1)"
    gone = "(OLD.agent, OLD.status, 0, -1)"
    op.execute(
        "CREATE TRIGGER count_tasks_added AFTER INSERT ON bus_commands "
        f"BEGIN {UPSERT.format(rows=one)}; END"
    )
    op.execute(
        "CREATE TRIGGER count_tasks_gone AFTER DELETE ON bus_commands "
        f"BEGIN {UPSERT.format(rows=gone)}; END"
    )
    op.execute(
        "CREATE TRIGGER count_tasks_moved AFTER UPDATE OF status, agent ON bus_commands "
        f"WHEN {CHANGED} "
        f"BEGIN {UPSERT.format(rows=gone)}; {UPSERT.format(rows=one)}; END"
    )


def _postgres_triggers() -> None:
    """Counted once a statement, from the rows it inserted, deleted or changed (its
    transition tables): a worker's settle-and-claim of ten tasks adds up its moves in two
    upserts, where a trigger for each row made twenty (a drain in batches of ten:
    -21 % against -7 %). An UPDATE that moves no task (a heartbeat) writes nothing."""
    pid = "pg_backend_pid()"
    by_statement = (
        "INSERT INTO task_counts (agent, status, shard, n) "
        "SELECT agent, status, {pid}, {sign} COUNT(*) FROM {rows} GROUP BY agent, status "
        "ON CONFLICT (agent, status, shard) DO UPDATE SET n = task_counts.n + excluded.n"
    )
    functions = {
        "added": by_statement.format(pid=pid, sign="", rows="added"),
        "gone": by_statement.format(pid=pid, sign="-", rows="gone"),
        "moved": (
            "INSERT INTO task_counts (agent, status, shard, n) "
            f"SELECT agent, status, {pid}, SUM(n) FROM ("
            "SELECT agent, status, -1 AS n FROM gone UNION ALL "
            "SELECT agent, status, 1 FROM added) AS moves "
            "GROUP BY agent, status HAVING SUM(n) <> 0 "
            "ON CONFLICT (agent, status, shard) DO UPDATE SET n = task_counts.n + excluded.n"
        ),
        "truncated": "DELETE FROM task_counts",
    }
    for name, body in functions.items():
        op.execute(
            f"CREATE FUNCTION agentbus_count_tasks_{name}() RETURNS trigger "
            f"LANGUAGE plpgsql AS $$ BEGIN {body}; RETURN NULL; END $$"
        )
    op.execute(
        "CREATE TRIGGER count_tasks_added AFTER INSERT ON bus_commands "
        "REFERENCING NEW TABLE AS added FOR EACH STATEMENT "
        "EXECUTE FUNCTION agentbus_count_tasks_added()"
    )
    op.execute(
        "CREATE TRIGGER count_tasks_gone AFTER DELETE ON bus_commands "
        "REFERENCING OLD TABLE AS gone FOR EACH STATEMENT "
        "EXECUTE FUNCTION agentbus_count_tasks_gone()"
    )
    op.execute(
        "CREATE TRIGGER count_tasks_moved AFTER UPDATE ON bus_commands "
        "REFERENCING OLD TABLE AS gone NEW TABLE AS added FOR EACH STATEMENT "
        "EXECUTE FUNCTION agentbus_count_tasks_moved()"
    )
    op.execute(
        "CREATE TRIGGER count_tasks_truncated AFTER TRUNCATE ON bus_commands "
        "FOR EACH STATEMENT EXECUTE FUNCTION agentbus_count_tasks_truncated()"
    )


def _count_refusals(dialect: str) -> None:
    """``budget_refused``: from the events there are, then kept by a trigger."""
    seed = REFUSED[dialect].format(d="detail")
    op.execute(
        COUNT_REFUSED.format(
            source=f"SELECT 'budget_refused', '', COALESCE(SUM({seed}), 0) FROM bus_events "
            "WHERE kind = 'refused_batch'"
        )
    )
    new = REFUSED[dialect].format(d="NEW.detail")
    when = "NEW.kind = 'refused_batch'"
    if dialect == "postgresql":
        body = COUNT_REFUSED.format(source=f"VALUES ('budget_refused', '', {new})")
        op.execute(
            "CREATE FUNCTION agentbus_count_bus_events() RETURNS trigger LANGUAGE plpgsql "
            f"AS $$ BEGIN {body}; RETURN NULL; END $$"
        )
        op.execute(
            "CREATE TRIGGER count_bus_events AFTER INSERT ON bus_events FOR EACH ROW "
            f"WHEN ({when}) EXECUTE FUNCTION agentbus_count_bus_events()"
        )
    else:
        body = COUNT_REFUSED.format(source=f"SELECT 'budget_refused', '', {new} WHERE true")
        op.execute(
            f"CREATE TRIGGER count_bus_events AFTER INSERT ON bus_events WHEN {when} "
            f"BEGIN {body}; END"
        )
