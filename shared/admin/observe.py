"""What operators watch, read cheaply: the monotonic counters, how long each agent's
next task has been due, live workers per agent, token and cost totals, the tasks that
failed lately, and the last hour minute by minute.

Every read here costs what the rows that matter cost, not the history: counters
are rows of ``bus_counters`` (kept by triggers); ages and failures read the
partial and time indexes; the last hour is a range scan of ``task_events.at``.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus import process_metrics
from agentbus.queue.statements import in_state
from agentbus.queue.states import TaskStatus
from agentbus.schema import bus_commands as t
from agentbus.schema import bus_counters, task_counts, task_events, usage_daily, workers

RECENT_FAILURES = 20
HOUR = 3600.0

#: The tasks that failed (or errored) last, newest first: the start of their partial
#: index on updated_at, read backwards.
RECENT_FAILED = (
    sa.select(t.c.id, t.c.agent, t.c.status, t.c.last_error, t.c.updated_at)
    .where(in_state(TaskStatus.FAILED, TaskStatus.ERROR))
    .order_by(t.c.updated_at.desc())
    .limit(RECENT_FAILURES)
)


def observe(conn: Connection, now: float, stale_sec: float) -> dict[str, Any]:
    counters: dict[str, dict[str, int]] = {}
    for name, label, value in conn.execute(
        sa.select(bus_counters.c.name, bus_counters.c.label, bus_counters.c.value)
    ):
        counters.setdefault(name, {})[label] = int(value)
    oldest = {a: due for a, due in conn.execute(next_due(now)).all() if due is not None}
    live: dict[str, int] = dict(
        conn.execute(
            sa.select(workers.c.agent, sa.func.count())
            .where(workers.c.heartbeat_at >= now - stale_sec)
            .group_by(workers.c.agent)
        ).all()
    )
    usage = conn.execute(
        sa.select(
            usage_daily.c.model,
            sa.func.sum(usage_daily.c.prompt_tokens + usage_daily.c.completion_tokens),
            sa.func.sum(usage_daily.c.cost),
        ).group_by(usage_daily.c.model)
    ).all()
    failed = conn.execute(RECENT_FAILED).all()
    return {
        "counters": counters,
        "oldest_queued_age": {a: max(0.0, now - due) for a, due in sorted(oldest.items())},
        "live_workers": {a: int(n) for a, n in sorted(live.items())},
        "usage_totals": [
            {"model": m, "tokens": int(tok or 0), "cost": float(cost or 0.0)}
            for m, tok, cost in sorted(usage)
        ],
        "recent_failures": [
            {
                "id": f.id,
                "agent": f.agent,
                "status": f.status,
                "last_error": f.last_error,
                "at": f.updated_at,
            }
            for f in failed
        ],
        "last_hour": last_hour(conn, now),
        "observations": process_metrics.read(conn),
    }


def next_due(now: float) -> sa.Select[Any]:
    """(agent, since when its next task has been due) for each agent with queued tasks:
    the head of the claim's own index (``ix_bus_commands_claim``), the task its workers
    take next. With one priority that is the task that has waited longest; higher
    priorities come first, as the claim takes them. One index read per agent, however
    many tasks wait (the oldest by creation read every queued task)."""
    queued = (
        sa.select(task_counts.c.agent)
        .where(task_counts.c.status == TaskStatus.QUEUED.value)
        .group_by(task_counts.c.agent)
        .having(sa.func.sum(task_counts.c.n) > 0)
        .subquery()
    )
    head = (
        sa.select(t.c.run_after)
        .where(in_state(TaskStatus.QUEUED), t.c.agent == queued.c.agent, t.c.run_after <= now)
        .order_by(t.c.priority.desc(), t.c.run_after, t.c.id)
        .limit(1)
        .scalar_subquery()
    )
    return sa.select(queued.c.agent, head)


def last_hour(conn: Connection, now: float) -> dict[str, list[int]]:
    """Tasks done, paused and failed (or errored) in each of the last 60 minutes
    (oldest first), from the event log's time index."""
    s = TaskStatus
    ends = {s.DONE.value: [s.DONE], s.PAUSED.value: [s.PAUSED], s.FAILED.value: [s.FAILED, s.ERROR]}
    out = {name: [0] * 60 for name in ends}
    start = now - HOUR
    minute = sa.cast((task_events.c.at - start) / 60, sa.Integer)
    rows = conn.execute(
        sa.select(task_events.c.to_status, minute, sa.func.count())
        .where(
            task_events.c.at > start,
            task_events.c.to_status.in_([s for group in ends.values() for s in group]),
        )
        .group_by(task_events.c.to_status, minute)
    )
    for status, at_minute, n in rows:
        for name, group in ends.items():
            if status in group:
                out[name][min(59, max(0, int(at_minute)))] += int(n)
    return out


def unserved(queue: dict[str, dict[str, int]], live: dict[str, int]) -> list[str]:
    """Agents with queued tasks and no live worker: the first thing to fix."""
    return sorted(a for a, by in queue.items() if by.get(TaskStatus.QUEUED) and not live.get(a))
