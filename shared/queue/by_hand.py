"""What operators and producers do to tasks by hand: cancel, and find tasks to act on.

Resuming a paused task now is the sweeper's own guarded move (``SweepOps.resume``)
with the operator's name; retrying a failed one is ``TaskQueue.retry``. Each move
writes an event naming who made it (the event's ``worker`` column).
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.queue import events
from agentbus.queue.guarded import GuardedQueue
from agentbus.queue.statements import CANCEL
from agentbus.queue.states import TRANSITIONS, TaskStatus
from agentbus.schema import bus_commands as t


class ByHandOps(GuardedQueue):
    def cancel(self, task_ids: Sequence[int], *, by: str) -> list[int]:
        """Queued, paused or claimed -> cancelled; returns the ids that moved.

        A claimed task's worker finds its claim gone: its settle and its lease
        renewal match nothing, and it abandons the call before its next candidate.
        """
        sources, target = TRANSITIONS["cancel"]

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            moved: list[int] = []
            rows = []
            for source in sorted(sources):
                params = {
                    "p_ids": list(task_ids),
                    "p_source": source.value,
                    "p_now": now,
                    "p_note": f"cancelled by {by}",
                }
                for task_id in conn.execute(CANCEL, params).scalars():
                    moved.append(int(task_id))
                    rows.append(
                        events.event(
                            int(task_id),
                            source.value,
                            target.value,
                            now,
                            reason="cancel",
                            worker=by,
                        )
                    )
            events.record(conn, rows)
            return sorted(moved)

        return self.db.write(work) if task_ids else []

    def matching(
        self, *, agent: str | None = None, status: TaskStatus | None = None, limit: int = 10_000
    ) -> list[int]:
        """The ids of the tasks of ``agent`` in ``status`` (either may be None: any)."""
        query = sa.select(t.c.id).order_by(t.c.id).limit(limit)
        if agent is not None:
            query = query.where(t.c.agent == agent)
        if status is not None:
            query = query.where(t.c.status == status.value)
        return [int(i) for i in self.db.read(lambda conn: conn.execute(query).scalars().all())]

    def existing(self, task_ids: Sequence[int]) -> set[int]:
        """Which of ``task_ids`` name a task."""
        query = sa.select(t.c.id).where(t.c.id.in_(list(task_ids)))
        return {int(i) for i in self.db.read(lambda conn: conn.execute(query).scalars().all())}
