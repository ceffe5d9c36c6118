"""The workspace event log: what happened to the workspace (not to one task), for
people and dashboards. Written in the transaction of the change it describes, and
mirrored to the structured log.

Kinds: ``budget_warning``, ``refused_batch`` (the client budget), ``circuit_open``,
``circuit_half_open``, ``circuit_closed``, ``cooldown_set``, ``cooldown_expired``,
``agent_held``, ``agent_hold_lifted`` (``agentbus.queue.holds``).
Task pauses, resumes and demotions live in ``task_events``; ``recent`` merges them
in as ``paused``, ``resumed`` and ``demoted``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus import masking
from agentbus.db import Database
from agentbus.logging import get_logger, when
from agentbus.queue.states import TaskStatus
from agentbus.schema import PAUSE_EVENTS, bus_events, task_events

log = get_logger("agentbus.events")
WORKSPACE = "workspace"
TIMES = frozenset({"until", "was_until", "resume_after", "open_until", "opened_at"})  # epochs
SESSION = "session"
TASK_KINDS = ("paused", "resumed", "demoted")
PAUSED = TaskStatus.PAUSED


def emit(
    conn: Connection,
    kind: str,
    at: float,
    *,
    scope: str = WORKSPACE,
    source: str | None = None,
    detail: Mapping[str, Any] | None = None,
) -> None:
    detail = masking.mask_value(dict(detail or {}))
    conn.execute(
        sa.insert(bus_events).values(at=at, kind=kind, scope=scope, source=source, detail=detail)
    )
    shown = {
        k: when(v) if k in TIMES and isinstance(v, (int, float)) else v
        for k, v in dict(detail or {}).items()
    }
    log.info(kind, scope=scope, source=source, **shown)


def recent(
    db: Database, *, kinds: Collection[str] = (), since: float | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    """The newest events (workspace events and task pauses/resumes/demotions), oldest first."""

    def work(conn: Connection) -> list[dict[str, Any]]:
        q = sa.select(bus_events).order_by(bus_events.c.at.desc()).limit(limit)
        if kinds:
            q = q.where(bus_events.c.kind.in_(list(kinds)))
        if since is not None:
            q = q.where(bus_events.c.at > since)
        rows = [dict(r._mapping) for r in conn.execute(q)]
        wanted = [k for k in TASK_KINDS if not kinds or k in kinds]
        if wanted:
            q2 = pause_events(wanted, since, limit)
            for r in conn.execute(q2):
                rows.append(
                    {
                        "id": f"t{r.id}",
                        "at": r.at,
                        "kind": r.kind,
                        "scope": WORKSPACE,
                        "source": r.worker,
                        "detail": {"task_id": r.task_id, "reason": r.reason},
                    }
                )
        rows.sort(key=lambda r: r["at"])
        return rows[-limit:]

    return db.read(work)


def pause_events(wanted: Collection[str], since: float | None, limit: int) -> sa.Select[Any]:
    """The newest task events of the ``wanted`` kinds (paused, resumed, demoted), newest
    first: the end of their partial index on time (``PAUSE_EVENTS``)."""
    e = task_events
    kind = sa.case(
        (e.c.to_status == PAUSED, "paused"), (e.c.reason == "demoted", "demoted"), else_="resumed"
    )
    conditions = {
        "paused": e.c.to_status == PAUSED,
        "resumed": sa.and_(e.c.from_status == PAUSED, e.c.to_status == TaskStatus.QUEUED),
        "demoted": sa.and_(e.c.from_status == PAUSED, e.c.reason == "demoted"),
    }
    query = (
        sa.select(e.c.id, e.c.at, kind.label("kind"), e.c.task_id, e.c.reason, e.c.worker)
        .where(PAUSE_EVENTS, sa.or_(*(conditions[k] for k in wanted)))
        .order_by(e.c.at.desc())
        .limit(limit)
    )
    return query if since is None else query.where(e.c.at > since)
