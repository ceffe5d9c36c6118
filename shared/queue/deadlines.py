"""Deadlines: a task not started by its ``expires_at`` is never started.

A worker that claims such a task ends it without a call (``Expire``, the settle of
its claim); so does one whose task would pause or retry until after its deadline.
The sweeper ends the queued and paused tasks whose deadline has passed (``lapse``),
read through the partial index of the waiting tasks that have one, and wakes at the
next deadline. Each ends ``cancelled`` with the event reason ``deadline`` (counted as
``expiries``) and a note saying when the deadline was.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.queue import events
from agentbus.queue.guarded import GuardedQueue
from agentbus.queue.statements import LAPSE
from agentbus.queue.states import TRANSITIONS, TaskStatus
from agentbus.schema import WITH_DEADLINE
from agentbus.schema import bus_commands as t

_WAITING = sa.text(WITH_DEADLINE)  # the index's condition, word for word (SQLite needs it)
NEXT_DEADLINE = sa.select(sa.func.min(t.c.expires_at)).where(_WAITING)


def note(expires_at: float) -> str:
    """What an expired task's ``result_note`` says."""
    return f"deadline: not started by {iso(expires_at)}"


def iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


class DeadlineOps(GuardedQueue):
    def lapse_due(self, limit: int, *, by: str = "sweeper") -> list[int]:
        """End up to ``limit`` queued or paused tasks whose deadline has passed (the
        earliest first); returns their ids."""
        postgres = self.db.dialect == "postgresql"

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            pick = (
                sa.select(t.c.id, t.c.status, t.c.expires_at)
                .where(_WAITING, t.c.expires_at <= now)
                .order_by(t.c.expires_at)
                .limit(limit)
            )
            if postgres:  # one a worker is claiming now is the worker's to end
                pick = pick.with_for_update(skip_locked=True)
            rows = conn.execute(pick).all()
            return self._lapse(conn, {r.id: (r.status, r.expires_at) for r in rows}, now, now, by)

        return self.db.write(work)

    def lapse(self, tasks: Mapping[int, float], *, by: str = "sweeper") -> list[int]:
        """End the paused tasks among ``tasks`` (id -> the time it would resume) whose
        deadline comes by that time: they would wait past it."""

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            query = sa.select(t.c.id, t.c.expires_at).where(
                t.c.id.in_(list(tasks)), t.c.expires_at.is_not(None)
            )
            moved: list[int] = []
            for task_id, expires_at in conn.execute(query).all():
                if expires_at <= tasks[task_id]:
                    found = {task_id: (TaskStatus.PAUSED.value, expires_at)}
                    moved += self._lapse(conn, found, now, tasks[task_id], by)
            return moved

        return self.db.write(work) if tasks else []

    def _lapse(
        self,
        conn: Connection,
        found: Mapping[int, tuple[str, float]],
        now: float,
        by_then: float,
        by: str,
    ) -> list[int]:
        """``found``: id -> (state, deadline); each ends if it is still in that state and
        its deadline comes by ``by_then``. One statement per task: each note names its
        own deadline."""
        _, target = TRANSITIONS["lapse"]
        moved, rows = [], []
        for task_id, (status, expires_at) in sorted(found.items()):
            params = {
                "p_ids": [task_id],
                "p_source": status,
                "p_now": now,
                "p_by_then": by_then,
                "p_note": note(expires_at),
            }
            if conn.execute(LAPSE, params).first() is None:
                continue
            moved.append(int(task_id))
            detail = {"deadline": expires_at}
            rows.append(
                events.event(
                    task_id,
                    status,
                    target.value,
                    now,
                    reason=events.DEADLINE,
                    worker=by,
                    detail=detail,
                )
            )
        events.record(conn, rows)
        return moved

    def next_deadline(self) -> float | None:
        """The earliest deadline of a waiting task (an index lookup); None: none has one."""
        value = self.db.read(lambda conn: conn.execute(NEXT_DEADLINE).scalar())
        return float(value) if value is not None else None
