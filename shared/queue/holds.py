"""Holds on agents' queues: an operator stops every worker from claiming an agent's
tasks (``busctl agents pause NAME``) and lets them go on (``busctl agents resume``).

A hold is a row of ``agent_holds``; every claim reads it in the claiming statement
(``NOT_HELD``, a primary-key lookup), so no worker anywhere claims a held agent's
task once the hold has committed, and an idle worker's look for due tasks sees none.
Calls already running finish. Lifting a hold wakes the agent's idle workers. Each
change is a workspace event (``agent_held``, ``agent_hold_lifted``) naming who and
why. Not the task state ``paused``: a held agent's tasks stay ``queued``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus import masking
from agentbus.catalog.model import NAME_RE
from agentbus.db import Database, dialect_insert
from agentbus.errors import BusError, UnknownAgent
from agentbus.queue import wakeups
from agentbus.schema import agent_holds, bus_commands, workers

_H = agent_holds.c
MAX_REASON = 500  # characters

#: SQL: the agent ``p_agent`` has no hold on its queue.
NOT_HELD = ~sa.exists().where(_H.agent == sa.bindparam("p_agent", type_=sa.Text))


@dataclass(frozen=True)
class Hold:
    agent: str
    reason: str | None
    held_by: str
    held_at: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "agent": self.agent,
            "reason": self.reason,
            "held_by": self.held_by,
            "held_at": self.held_at,
        }


def _known(conn: Connection, agent: object, configured: Collection[str]) -> str:
    """``agent``, if the config, a task, a worker or a hold names it; else UnknownAgent."""
    if not isinstance(agent, str) or not NAME_RE.match(agent):
        raise UnknownAgent(f"{agent!r} is not an agent name")
    if agent in configured:
        return agent
    for table in (bus_commands, workers, agent_holds):
        found = sa.select(sa.literal(1)).where(table.c.agent == agent).limit(1)
        if conn.execute(found).first() is not None:
            return agent
    raise UnknownAgent(f"unknown agent {agent!r}: no config, task or worker names it")


def _reason(reason: object) -> str | None:
    if reason is None:
        return None
    if not isinstance(reason, str) or len(reason) > MAX_REASON:
        raise BusError(f"the reason must be text of at most {MAX_REASON} characters")
    return masking.mask(" ".join(reason.split())) or None  # one line


def hold(
    db: Database,
    agent: str,
    reason: str | None,
    by: str,
    now: float,
    configured: Collection[str] = (),
) -> bool:
    """Put a hold on ``agent``'s queue; False: it had one already (left as it was).
    UnknownAgent (nothing written) when neither ``configured`` nor a row names it."""
    from agentbus.admission import workspace_events

    why = _reason(reason)

    def work(conn: Connection) -> bool:
        _known(conn, agent, configured)
        insert: Any = dialect_insert(conn.dialect.name)(agent_holds)
        row = {"agent": agent, "reason": why, "held_by": by, "held_at": now}
        added = conn.execute(insert.on_conflict_do_nothing().returning(_H.agent), row).first()
        if added is None:
            return False
        detail = {"agent": agent, "reason": why}
        workspace_events.emit(conn, "agent_held", now, source=by, detail=detail)
        return True

    return db.write(work)


def lift(db: Database, agent: str, by: str, now: float, configured: Collection[str] = ()) -> bool:
    """Lift the hold on ``agent``'s queue and wake its idle workers; False: it had none.
    UnknownAgent as for ``hold``."""
    from agentbus.admission import workspace_events

    def work(conn: Connection) -> bool:
        _known(conn, agent, configured)
        gone = conn.execute(sa.delete(agent_holds).where(_H.agent == agent).returning(_H.reason))
        if gone.first() is None:
            return False
        workspace_events.emit(conn, "agent_hold_lifted", now, source=by, detail={"agent": agent})
        wakeups.notify(conn, (agent,))
        return True

    return db.write(work)


def holds(conn: Connection) -> list[Hold]:
    """Every hold, by agent."""
    rows = conn.execute(sa.select(_H.agent, _H.reason, _H.held_by, _H.held_at).order_by(_H.agent))
    return [Hold(r.agent, r.reason, r.held_by, float(r.held_at)) for r in rows]


def held(conn: Connection, agent: str) -> Hold | None:
    """The hold on ``agent``'s queue, if there is one."""
    row = conn.execute(
        sa.select(_H.agent, _H.reason, _H.held_by, _H.held_at).where(_H.agent == agent)
    ).first()
    return None if row is None else Hold(row.agent, row.reason, row.held_by, float(row.held_at))
