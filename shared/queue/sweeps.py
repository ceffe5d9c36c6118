"""The sweeper's side of the queue: rescue expired claims, resume, postpone, demote.

Every change is guarded by the state it expects, so two sweepers working at
once never apply one twice: the second one's write matches nothing.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.queue import events, todos
from agentbus.queue.guarded import GuardedQueue
from agentbus.queue.statements import (
    FAIL_MALFORMED,
    LOCK_PAUSED_POSTGRES,
    POSTPONE,
    POSTPONE_POSTGRES,
    SETTLE,
    in_state,
)
from agentbus.queue.states import TRANSITIONS, TaskStatus
from agentbus.schema import bus_commands as t


@dataclass(frozen=True)
class DuePause:
    """A paused task whose resume time has come (what the sweeper's resume needs)."""

    id: int
    agent: str
    models: tuple[str, ...] | None
    role: str | None
    resume_after: float
    paused_at: float | None
    pause_model: str | None
    reentry_count: int
    expires_at: float | None = None


@dataclass(frozen=True)
class Rescued:
    requeued: list[int]
    poisoned: list[int]


class SweepOps(GuardedQueue):
    # -- what is due (index range scans: cost follows the due rows, not the table) --

    def due_pauses(self, limit: int) -> list[DuePause]:
        """Paused tasks whose ``resume_after`` has passed, the earliest first."""
        query = (
            sa.select(
                t.c.id,
                t.c.agent,
                t.c.models,
                t.c.role,
                t.c.resume_after,
                t.c.paused_at,
                t.c.pause_model,
                t.c.reentry_count,
                t.c.expires_at,
            )
            .where(in_state(TaskStatus.PAUSED), t.c.resume_after <= self.clock())
            .order_by(t.c.resume_after)
            .limit(limit)
        )
        rows = self.db.read(lambda conn: conn.execute(query).all())
        return [
            DuePause(
                r.id,
                r.agent,
                tuple(r.models) if isinstance(r.models, list) and r.models else None,
                r.role,
                r.resume_after,
                r.paused_at,
                r.pause_model,
                r.reentry_count,
                r.expires_at,
            )
            for r in rows
        ]

    def requests(self, ids: Sequence[int]) -> dict[int, tuple[str, Mapping[str, Any]]]:
        """The text and payload of these tasks, by id (what the sweeper estimates their
        calls' tokens by); a row whose payload is not an object is left out."""
        query = sa.select(t.c.id, t.c.command, t.c.payload).where(t.c.id.in_(list(ids)))
        rows = self.db.read(lambda conn: conn.execute(query).all()) if ids else []
        return {
            r.id: (r.command or "", r.payload if isinstance(r.payload, Mapping) else {})
            for r in rows
            if r.payload is None or isinstance(r.payload, Mapping)
        }

    def long_pauses(self, paused_since: float, limit: int) -> dict[int, str]:
        """Task id -> agent of tasks whose pause episode began at or before ``paused_since``."""
        query = (
            sa.select(t.c.id, t.c.agent)
            .where(in_state(TaskStatus.PAUSED), t.c.first_paused_at <= paused_since)
            .limit(limit)
        )
        return {r.id: r.agent for r in self.db.read(lambda conn: conn.execute(query).all())}

    def next_resume_at(self) -> float | None:
        """The earliest pending ``resume_after`` (an index lookup); None: nothing paused."""
        query = sa.select(sa.func.min(t.c.resume_after)).where(in_state(TaskStatus.PAUSED))
        value = self.db.read(lambda conn: conn.execute(query).scalar())
        return float(value) if value is not None else None

    # -- the sweeper's moves ------------------------------------------------
    def rescue(
        self, task_id: int, token: int, *, poison: str | None = None, by: str = "sweeper"
    ) -> None:
        """A claim whose lease expired: back to queued, or failed when ``poison`` says why.

        Guarded by the token and by the lease having expired, so a worker that
        heartbeats in time keeps its task; raises TransitionRejected otherwise.
        """

        def work(conn: Connection) -> None:
            now = self.clock()
            if not self._rescue_one(conn, task_id, token, None, poison, now, by):
                action = "rescue" if poison is None else "rescue_fail"
                self._reject(conn, task_id, action, token, now)

        self.db.write(work)

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
                .where(in_state(TaskStatus.CLAIMED), t.c.lease_until < now)
                .order_by(t.c.lease_until)
                .limit(limit)
            )
            if self.db.dialect == "postgresql":
                pick = pick.with_for_update(skip_locked=True)
            out = Rescued([], [])
            for task_id, token, rescues, holder in conn.execute(pick).all():
                poison = None
                if rescues + 1 >= rescue_limit:
                    poison = (
                        f"lease expired {rescues + 1} times (last held by {holder}): "
                        "the task may be crashing its worker"
                    )
                if self._rescue_one(conn, task_id, token, holder, poison, now, by):
                    (out.requeued if poison is None else out.poisoned).append(int(task_id))
            return out

        return self.db.write(work)

    def _rescue_one(
        self,
        conn: Connection,
        task_id: int,
        token: int,
        holder: str | None,
        poison: str | None,
        now: float,
        by: str,
    ) -> bool:
        """One guarded rescue with its event; False when the write matched nothing (a
        heartbeat arrived in time, or another sweeper got there first)."""
        action = "rescue" if poison is None else "rescue_fail"
        params = {"p_id": task_id, "p_token": token, "p_now": now, "p_error": poison}
        if conn.execute(SETTLE[action], params).rowcount != 1:
            return False
        (source,), target = TRANSITIONS[action]
        detail = {k: v for k, v in (("was_held_by", holder), ("poison", poison)) if v is not None}
        event = events.event(
            int(task_id),
            source.value,
            target.value,
            now,
            reason="lease expired" if poison is None else "poison pill",
            worker=by,
            claim_token=token,
            detail=detail or None,
        )
        events.record(conn, [event])
        return True

    def resume(self, task_ids: Sequence[int], *, by: str = "sweeper") -> list[int]:
        """Paused -> queued; returns the ids that were still paused and moved."""
        return self._move_many("resume", task_ids, by, "resume", {})

    def postpone(self, new_times: Mapping[int, float], reason: str) -> list[int]:
        """Move the resume_after of paused tasks (still paused: no transition, no event);
        returns the ids moved. One statement for each new time (a pass gives most tasks
        one of a few); on PostgreSQL only the tasks it could lock at once, in id order:
        one another sweeper is moving is left to it."""
        postgres = self.db.dialect == "postgresql"

        def work(conn: Connection) -> list[int]:
            ids = sorted(new_times)
            if postgres:
                ids = list(conn.execute(LOCK_PAUSED_POSTGRES, {"p_ids": ids}).scalars())
            at: dict[float, list[int]] = defaultdict(list)
            for task_id in ids:
                at[new_times[task_id]].append(task_id)
            statement = POSTPONE_POSTGRES if postgres else POSTPONE
            moved: list[int] = []
            for when, group in sorted(at.items()):
                params = {"p_ids": group, "p_resume_after": when, "p_reason": reason}
                moved += conn.execute(statement, params).scalars()
            return sorted(moved)

        return self.db.write(work) if new_times else []

    def demote(self, tasks: Mapping[int, str], reason: str, *, by: str = "sweeper") -> list[int]:
        """Paused -> failed (paused too long), filing one ops_todo per task that moved.

        ``tasks`` maps task id -> agent (for the todo).
        """

        def extra(conn: Connection, moved: list[int], now: float) -> None:
            todos.add(
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

    def fail_malformed(
        self, rows: Sequence[Mapping[str, Any]], *, by: str = "sweeper"
    ) -> list[int]:
        """Queued, paused or claimed -> failed, for tasks whose rows were written so that
        no worker can run them (``agentbus.queue.malformed.found``: each row's ``key``,
        ``status``, ``agent`` and ``problem``), filing one ops_todo per task that moved.
        A claimed task's worker finds its claim gone, as after a cancel."""
        source, target = TRANSITIONS["fail_malformed"]

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            moved, moves, filed = [], [], []
            for row in rows:
                why = f"malformed: {row['problem']}"
                params = {
                    "p_id": row["key"],
                    "p_source": row["status"],
                    "p_now": now,
                    "p_error": why,
                }
                if (
                    row["status"] not in source
                    or conn.execute(FAIL_MALFORMED, params).first() is None
                ):
                    continue  # moved meanwhile: the next pass looks again
                moved.append(int(row["key"]))
                moves.append(
                    events.event(
                        int(row["key"]),
                        row["status"],
                        target.value,
                        now,
                        reason="malformed",
                        worker=by,
                        detail={"why": why},
                    )
                )
                filed.append(
                    {
                        "kind": "malformed",
                        "task_id": row["key"],
                        "agent": row["agent"],
                        "why": why,
                        "created_at": now,
                    }
                )
            events.record(conn, moves)
            todos.add(conn, filed)
            return moved

        return self.db.write(work) if rows else []
