"""The sweeper's side of the queue: rescue expired claims, resume, postpone, demote.

Every change is guarded by the state it expects, so two sweepers working at
once never apply one twice: the second one's write matches nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.queue import events
from agentbus.queue import todos as ops
from agentbus.queue.base import QueueBase
from agentbus.queue.statements import POSTPONE, SETTLE
from agentbus.schema import bus_commands as t


@dataclass(frozen=True)
class Rescued:
    requeued: list[int]
    poisoned: list[int]


class SweepOps(QueueBase):
    def rescue(
        self, task_id: int, token: int, *, poison: str | None = None, by: str = "sweeper"
    ) -> None:
        """A claim whose lease expired: back to queued, or failed when ``poison`` says why.

        Guarded by the token and by the lease having expired, so a worker that
        heartbeats in time keeps its task.
        """
        if poison is None:
            self._settle("rescue", task_id, token, by, "lease expired", {})
        else:
            self._settle(
                "rescue_fail",
                task_id,
                token,
                by,
                "poison pill",
                {"p_error": poison},
                detail={"poison": poison},
            )

    def rescue_expired(self, *, limit: int, rescue_limit: int, by: str = "sweeper") -> Rescued:
        """Rescue up to ``limit`` claims whose lease has expired (the oldest first).

        A task whose lease has now expired ``rescue_limit`` times fails as a
        poison pill (it probably kills its worker); the others go back to the
        queue, where the next claim gives them a new token.
        """

        def work(conn: Connection) -> Rescued:
            now = self.clock()
            pick = (
                sa.select(t.c.id, t.c.claim_token, t.c.rescue_count, t.c.claimed_by)
                .where(t.c.status == "claimed", t.c.lease_until < now)
                .order_by(t.c.lease_until)
                .limit(limit)
            )
            if self.db.dialect == "postgresql":
                pick = pick.with_for_update(skip_locked=True)
            out = Rescued([], [])
            log = []
            for task_id, token, rescues, holder in conn.execute(pick).all():
                poison = None
                if rescues + 1 >= rescue_limit:
                    poison = (
                        f"lease expired {rescues + 1} times (last held by {holder}): "
                        "the task may be crashing its worker"
                    )
                action = "rescue" if poison is None else "rescue_fail"
                params = {"p_id": task_id, "p_token": token, "p_now": now, "p_error": poison}
                if conn.execute(SETTLE[action], params).rowcount != 1:
                    continue  # heartbeat arrived or another sweeper got there: not ours
                (out.requeued if poison is None else out.poisoned).append(int(task_id))
                log.append(
                    events.event(
                        int(task_id),
                        "claimed",
                        "queued" if poison is None else "failed",
                        now,
                        reason="lease expired" if poison is None else "poison pill",
                        worker=by,
                        claim_token=token,
                        detail={"was_held_by": holder, "poison": poison},
                    )
                )
            events.record(conn, log)
            return out

        return self.db.write(work)

    def resume(self, task_ids: Sequence[int], *, by: str = "sweeper") -> list[int]:
        """Paused -> queued; returns the ids that were still paused and moved."""
        return self._move_many("resume", task_ids, by, "resume", {})

    def postpone(self, new_times: Mapping[int, float], reason: str) -> list[int]:
        """Move the resume_after of paused tasks (still paused: no transition, no event)."""

        def work(conn: Connection) -> list[int]:
            return [
                task_id
                for task_id, when in new_times.items()
                if conn.execute(
                    POSTPONE, {"p_id": task_id, "p_resume_after": when, "p_reason": reason}
                ).rowcount
                == 1
            ]

        return self.db.write(work) if new_times else []

    def demote(self, tasks: Mapping[int, str], reason: str, *, by: str = "sweeper") -> list[int]:
        """Paused -> failed (paused too long), filing one ops_todo per task that moved.

        ``tasks`` maps task id -> agent (for the todo).
        """

        def extra(conn: Connection, moved: list[int], now: float) -> None:
            ops.add(
                conn,
                [
                    {
                        "kind": "demoted",
                        "task_id": i,
                        "agent": tasks[i],
                        "why": reason,
                        "created_at": now,
                    }
                    for i in moved
                ],
            )

        return self._move_many(
            "demote",
            list(tasks),
            by,
            "demoted",
            {"p_error": reason},
            detail={"why": reason},
            also=extra,
        )
