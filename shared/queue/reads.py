"""Read-only queries over tasks and their events, for busctl, producers and tests."""

from __future__ import annotations

from collections import Counter
from typing import Any

import sqlalchemy as sa

from agentbus.admission import usage
from agentbus.db import Database
from agentbus.errors import TaskNotFound
from agentbus.queue import counts as task_counts
from agentbus.queue import events
from agentbus.queue.malformed import ACTIVE as UNFINISHED
from agentbus.queue.malformed import task_problems
from agentbus.queue.statements import in_state
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import Task
from agentbus.schema import bus_commands as t
from agentbus.schema import circuits, route_log, workers


def get_task(db: Database, task_id: int) -> Task:
    found = _flagged(db, sa.select(t).where(t.c.id == task_id))
    if not found:
        raise TaskNotFound(f"task {task_id} does not exist")
    return found[0]


def _flagged(db: Database, query: sa.Select[Any]) -> list[Task]:
    """The tasks ``query`` reads, each with what makes its row malformed, if anything."""

    def work(conn: sa.Connection) -> list[Task]:
        rows = conn.execute(query).all()
        problems = task_problems(conn, [int(r.id) for r in rows])
        return [Task.from_row(r._mapping, malformed=problems.get(int(r.id))) for r in rows]

    return db.read(work)


def task_events(db: Database, task_id: int) -> list[dict[str, Any]]:
    """The events of one task, oldest first."""
    return db.read(lambda conn: events.for_task(conn, task_id))


def counts(db: Database) -> Counter[tuple[str, str]]:
    """Task counts keyed by (status, agent), from the counts the triggers keep."""
    return db.read(task_counts.read)


def live_agents(db: Database) -> set[str]:
    """The agents that have a registered worker now."""
    query = sa.select(workers.c.agent).distinct()
    rows = db.read(lambda conn: conn.execute(query).scalars().all())
    return set(rows)


def list_tasks(
    db: Database,
    *,
    status: str | None = None,
    agent: str | None = None,
    limit: int = 50,
    before: int | None = None,
) -> list[Task]:
    """The newest tasks (older than id ``before``: the next page), optionally of one
    status and/or agent. A page reads back from its start by id: finished tasks are most
    of the table, and a state not yet ended is read through its partial index."""
    stmt = sa.select(t).order_by(t.c.id.desc()).limit(limit)
    if before is not None:
        stmt = stmt.where(t.c.id < before)
    if status in UNFINISHED:
        stmt = stmt.where(in_state(TaskStatus(status)))
    elif status is not None:
        stmt = stmt.where(t.c.status == status)
    if agent is not None:
        stmt = stmt.where(t.c.agent == agent)
    return _flagged(db, stmt)


def routes(db: Database, *, limit: int = 50, task_id: int | None = None) -> list[dict[str, Any]]:
    """The newest routing decisions (route_log), newest first."""
    stmt = sa.select(route_log).order_by(route_log.c.id.desc()).limit(limit)
    if task_id is not None:
        stmt = stmt.where(route_log.c.task_id == task_id)
    return [dict(r._mapping) for r in db.read(lambda conn: conn.execute(stmt).all())]


def refusals(db: Database, *, limit: int = 50) -> list[dict[str, Any]]:
    """The newest refusals, newest first: of a worker's candidates (agent, task, model)
    and of governed MCP calls (agent ``mcp:<client>``, model ``mcp:<tool>``, no task)."""
    r = route_log.c
    stmt = (
        sa.select(r.at, r.agent, r.task_id, r.model, r.account, r.refusal)
        .where(r.refusal.is_not(None))
        .order_by(r.id.desc())
        .limit(limit)
    )
    return [
        {
            "at": row.at,
            "agent": row.agent,
            "task_id": row.task_id or None,
            "candidate": f"{row.model}@{row.account}" if row.account else row.model,
            **row.refusal,
        }
        for row in db.read(lambda conn: conn.execute(stmt).all())
    ]


def circuit_states(db: Database) -> list[dict[str, Any]]:
    """Every provider circuit the workers have written."""
    stmt = sa.select(circuits).order_by(circuits.c.provider)
    return [dict(r._mapping) for r in db.read(lambda conn: conn.execute(stmt).all())]


def usage_by_day(db: Database, since: float) -> list[dict[str, Any]]:
    """Calls, tokens and cost per UTC day and model since ``since``."""
    return db.read(lambda conn: usage.by_day(conn, since))
