"""Groups: the tasks of one group (a conversation, a customer) run at most the agent's
``group_concurrency`` at once, in enqueue order.

A claim takes a task of a group only when fewer than ``group_concurrency`` of the
group's other tasks hold a turn ahead of it: the earlier ones not yet ended, and the
later ones already running. With ``group_order = "enqueue"`` (the default) an earlier
task holds its turn while paused or waiting for a retry, so the next turn waits for it;
with ``"any"`` only the earlier tasks due now or running hold one.

Nothing is locked for it: a claim only ever makes a task that held a turn hold it still
(queued becomes claimed), and two claims at once each count the other's task (queued,
or claimed) among those ahead of the later one, so no claim can take a turn beyond the
limit; a turn frees only when a task ends (or, with ``"any"``, pauses). The count reads
the partial index of the groups' unfinished tasks. Tasks without a group, and agents
without ``group_concurrency``, are claimed as before (the claim is the same statement).
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.catalog.model import AgentConfig
from agentbus.queue.states import TaskStatus
from agentbus.schema import IN_GROUP
from agentbus.schema import bus_commands as t

#: The order of a group's turns: "enqueue" (a waiting task keeps its turn) or "any".
ENQUEUE, ANY = "enqueue", "any"
P_GROUP_LIMIT = sa.bindparam("p_group_limit", type_=sa.Integer)


@dataclass(frozen=True)
class GroupRule:
    """How many tasks of one group of an agent run at once, and in which order."""

    limit: int
    order: str = ENQUEUE

    @classmethod
    def of(cls, agent: AgentConfig | None) -> GroupRule | None:
        """The agent's rule (None: its groups are not limited)."""
        if agent is None or agent.group_concurrency is None:
            return None
        return cls(agent.group_concurrency, agent.group_order)

    @property
    def params(self) -> dict[str, int]:
        return {"p_group_limit": self.limit}


def _state(status: TaskStatus) -> sa.ColumnElement[str]:
    """A state written into the SQL, not bound (as ``agentbus.queue.statements`` writes them)."""
    return sa.literal_column(f"'{status.value}'", sa.Text)


def mode_of(rule: GroupRule | None) -> str | None:
    """Which claim statement a rule takes (None: the one without groups)."""
    return None if rule is None else rule.order


def turn_free(order: str, now: sa.ColumnElement[float]) -> sa.ColumnElement[bool]:
    """The task of ``bus_commands`` the statement reads has no group, or fewer than
    ``p_group_limit`` of its group's other tasks hold a turn ahead of it."""
    o = t.alias("o")
    claimed = o.c.status == _state(TaskStatus.CLAIMED)
    if order == ANY:
        due = sa.and_(o.c.status == _state(TaskStatus.QUEUED), o.c.run_after <= now)
        ahead = sa.or_(claimed, sa.and_(o.c.id < t.c.id, due))
    else:
        ahead = sa.or_(claimed, o.c.id < t.c.id)
    holding = (
        sa.select(sa.func.count())
        .select_from(o)
        .where(o.c.agent == t.c.agent, o.c.group_key == t.c.group_key)
        .where(sa.text(IN_GROUP.replace("group_key", "o.group_key").replace("status", "o.status")))
        .where(o.c.id != t.c.id, ahead)
        .scalar_subquery()
    )
    return sa.or_(t.c.group_key.is_(None), holding < P_GROUP_LIMIT)


def standing(conn: Connection) -> dict[str, dict[str, int]]:
    """Per agent, its groups with unfinished tasks and their tasks by state (queued,
    claimed, paused): what waits for a turn (read through the groups' partial index)."""
    rows = conn.execute(
        sa.select(t.c.agent, t.c.status, sa.func.count())
        .where(sa.text(IN_GROUP))
        .group_by(t.c.agent, t.c.status)
    ).all()
    out: dict[str, dict[str, int]] = {}
    for agent, status, tasks in rows:
        out.setdefault(agent, {"groups": 0, "queued": 0, "claimed": 0, "paused": 0})[status] = tasks
    for agent, groups in conn.execute(
        sa.select(t.c.agent, sa.func.count(sa.distinct(t.c.group_key)))
        .where(sa.text(IN_GROUP))
        .group_by(t.c.agent)
    ).all():
        out[agent]["groups"] = groups
    return out
