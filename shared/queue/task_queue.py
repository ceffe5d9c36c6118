"""The task queue: the only code that writes ``bus_commands.status``.

Every operation is one guarded conditional UPDATE (``WHERE id = … AND status
= … [AND claim_token = …]``, see ``agentbus.queue.statements``) plus its event row,
in one transaction. A guarded write that matches no row raises
``TransitionRejected`` (batch operations return the ids that did not match):
the task was not where the caller thought — another claim owns it, or
someone else moved it.

Claiming is one statement: Postgres picks rows with ``FOR UPDATE SKIP
LOCKED``; SQLite runs ``UPDATE … WHERE id IN (SELECT …) RETURNING`` inside
``BEGIN IMMEDIATE``, which serializes writers. Each claim bumps the task's
``claim_token``, a fencing number: a worker whose lease was taken over holds
an old token and none of its writes can land.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.errors import TaskNotFound, TransitionRejected
from agentbus.queue import events, reads
from agentbus.queue.base import Clock
from agentbus.queue.statements import COMPLETE_MANY_POSTGRES, HEARTBEAT, SETTLE
from agentbus.queue.states import TRANSITIONS, TaskStatus
from agentbus.queue.sweeps import SweepOps
from agentbus.queue.tasks import Task, TaskSpec
from agentbus.schema import bus_commands as t

__all__ = ["Clock", "Completion", "Enqueued", "TaskQueue"]

#: Routing decisions (rows of ``route_log``) recorded with the settle they led to.
Routes = Sequence[Mapping[str, Any]]


@dataclass(frozen=True)
class Completion:
    """One claim to acknowledge as done (see ``TaskQueue.complete_many``)."""

    task_id: int
    token: int
    result: str | None = None
    note: str | None = None
    detail: Mapping[str, Any] | None = None
    routes: Routes = ()


@dataclass(frozen=True)
class Enqueued:
    id: int
    created: bool  # False: the idempotency key named an existing task


class TaskQueue(SweepOps):
    """Queue operations over one database, with an injectable clock."""

    # -- producers -----------------------------------------------------------

    def enqueue(self, spec: TaskSpec) -> Enqueued:
        """Insert a queued task; with an idempotency key, return the task that has it."""

        def work(conn: Connection) -> Enqueued:
            now = self.clock()
            row = self._row(spec, now)
            if spec.key is None:
                new_id = conn.execute(sa.insert(t).returning(t.c.id), row).scalar_one()
            else:
                new_id = conn.execute(self._insert_keyed, row).scalar()
                if new_id is None:
                    existing = conn.execute(
                        sa.select(t.c.id).where(t.c.idempotency_key == spec.key)
                    ).scalar_one()
                    return Enqueued(int(existing), created=False)
            events.record(conn, [events.event(new_id, None, "queued", now, reason="enqueue")])
            return Enqueued(int(new_id), created=True)

        return self.db.write(work)

    def enqueue_many(self, specs: Sequence[TaskSpec]) -> list[int]:
        """Insert many tasks in one transaction; returns their ids in order.

        Tasks with an idempotency key are enqueued one by one (their ids may
        name existing tasks); the rest go in one multi-row INSERT.
        """
        if any(s.key is not None for s in specs):
            return [self.enqueue(s).id for s in specs]

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            rows = [self._row(s, now) for s in specs]
            result = conn.execute(
                sa.insert(t).returning(t.c.id, sort_by_parameter_order=True), rows
            )
            ids = [int(i) for i in result.scalars()]
            events.record(
                conn, (events.event(i, None, "queued", now, reason="enqueue") for i in ids)
            )
            return ids

        return self.db.write(work) if specs else []

    def _row(self, spec: TaskSpec, now: float) -> dict[str, Any]:
        return {
            "agent": spec.agent,
            "command": spec.command,
            "payload": dict(spec.payload),
            "models": list(spec.models) if spec.models is not None else None,
            "role": spec.role,
            "status": TaskStatus.QUEUED.value,
            "priority": spec.priority,
            "run_after": now + spec.delay_sec,
            "max_attempts": spec.max_attempts or self.max_attempts,
            "idempotency_key": spec.key,
            "created_at": now,
            "updated_at": now,
        }

    # -- workers -------------------------------------------------------------

    def claim(self, agent: str, worker: str, lease_sec: float, limit: int = 1) -> list[Task]:
        """Claim up to ``limit`` due queued tasks of ``agent``: priority first, then age."""

        def work(conn: Connection) -> list[sa.RowMapping]:
            # Keep the write transaction short (SQLite serializes writers on it):
            # the rows become Task objects after the commit.
            now = self.clock()
            params = {
                "p_agent": agent,
                "p_worker": worker,
                "p_now": now,
                "p_lease_until": now + lease_sec,
                "p_limit": limit,
            }
            rows = conn.execute(self._claim, params).mappings().all()
            events.record(
                conn,
                [
                    events.event(
                        row["id"],
                        "queued",
                        "claimed",
                        now,
                        worker=worker,
                        claim_token=row["claim_token"],
                        reason="claim",
                    )
                    for row in rows
                ],
            )
            return list(rows)

        tasks = [Task.from_row(row) for row in self.db.write(work)]
        return sorted(tasks, key=lambda task: (-task.priority, task.id))

    def heartbeat(self, task_id: int, token: int, lease_sec: float) -> float:
        """Extend the lease of a claim we hold; returns the new lease end."""

        def work(conn: Connection) -> float:
            lease_until = self.clock() + lease_sec
            params = {"p_id": task_id, "p_token": token, "p_lease_until": lease_until}
            if conn.execute(HEARTBEAT, params).rowcount != 1:
                self._reject(conn, task_id, "heartbeat", token)
            return lease_until

        return self.db.write(work)

    def complete(
        self,
        task_id: int,
        token: int,
        result: str | None = None,
        *,
        worker: str | None = None,
        note: str | None = None,
        detail: Mapping[str, Any] | None = None,
        routes: Routes = (),
    ) -> None:
        self._settle(
            "complete",
            task_id,
            token,
            worker,
            "done",
            {"p_result": result, "p_note": note},
            detail=detail,
            routes=routes,
        )

    def complete_many(self, items: Sequence[Completion], *, worker: str | None = None) -> list[int]:
        """Complete several claims in one transaction (acknowledging a batch).

        Returns the ids whose guarded write matched nothing (claim superseded);
        the others are done, with their events and routes. On Postgres the batch
        is one UPDATE over unnest()ed arrays; on SQLite one UPDATE per task.
        """

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            if self.db.dialect == "postgresql":
                params = {
                    "p_ids": [c.task_id for c in items],
                    "p_tokens": [c.token for c in items],
                    "p_results": [events.storable(c.result) for c in items],
                    "p_notes": [events.storable(c.note) for c in items],
                    "p_now": now,
                }
                moved = set(conn.execute(COMPLETE_MANY_POSTGRES, params).scalars())
            else:
                batch = [
                    {
                        "p_id": c.task_id,
                        "p_token": c.token,
                        "p_now": now,
                        "p_result": events.storable(c.result),
                        "p_note": c.note,
                    }
                    for c in items
                ]
                if conn.execute(SETTLE["complete"], batch).rowcount == len(items):
                    moved = {c.task_id for c in items}  # one executemany: every claim held
                else:  # some claim was superseded: the rows this statement finished
                    tokens = {c.task_id: c.token for c in items}
                    finished = conn.execute(
                        sa.select(t.c.id, t.c.claim_token).where(
                            t.c.id.in_(list(tokens)), t.c.status == "done", t.c.updated_at == now
                        )
                    ).all()
                    moved = {i for i, token in finished if tokens[i] == token}
            done = [c for c in items if c.task_id in moved]
            events.record(
                conn,
                [
                    events.event(
                        c.task_id,
                        "claimed",
                        "done",
                        now,
                        reason="done",
                        worker=worker,
                        claim_token=c.token,
                        detail=c.detail,
                    )
                    for c in done
                ],
            )
            events.record_routes(conn, [route for c in done for route in c.routes])
            return [c.task_id for c in items if c.task_id not in moved]

        return self.db.write(work) if items else []

    def fail(
        self,
        task_id: int,
        token: int,
        reason: str,
        *,
        worker: str | None = None,
        spend_attempt: bool = True,
        routes: Routes = (),
    ) -> None:
        """Permanent failure: the work cannot succeed."""
        self._settle(
            "fail",
            task_id,
            token,
            worker,
            reason,
            {"p_error": reason, "p_spend": int(spend_attempt)},
            routes=routes,
        )

    def error(self, task_id: int, token: int, error: str, *, worker: str | None = None) -> None:
        """An unexpected exception in handler or worker code."""
        self._settle(
            "error", task_id, token, worker, "error", {"p_error": error}, detail={"error": error}
        )

    def pause(
        self,
        task_id: int,
        token: int,
        resume_after: float,
        reason: str,
        *,
        model: str | None = None,
        worker: str | None = None,
        detail: Mapping[str, Any] | None = None,
        routes: Routes = (),
        cooldown: bool = True,
    ) -> None:
        """Every candidate is refused for a temporary reason: park the task (no attempt spent).

        ``cooldown`` False (a gate refused: a rate window, a circuit, slots) does not
        count as re-entering ``model``'s cooldown (the sweeper's re-entry rule)."""
        self._settle(
            "pause",
            task_id,
            token,
            worker,
            reason,
            {
                "p_resume_after": resume_after,
                "p_reason": reason,
                "p_model": model,
                "p_reentry": cooldown,
            },
            detail={"resume_after": resume_after, "model": model, **(detail or {})},
            routes=routes,
        )

    def release(
        self, task_id: int, token: int, reason: str = "shutdown", *, worker: str | None = None
    ) -> None:
        """Give a claimed task back untouched (no attempt spent)."""
        self._settle("release", task_id, token, worker, reason, {})

    def requeue(
        self,
        task_id: int,
        token: int,
        run_after: float,
        error: str,
        *,
        worker: str | None = None,
        routes: Routes = (),
    ) -> None:
        """A retryable failure: the attempt is spent and the task waits until ``run_after``."""
        self._settle(
            "requeue",
            task_id,
            token,
            worker,
            "retry",
            {"p_run_after": run_after, "p_error": error},
            detail={"error": error, "run_after": run_after},
            routes=routes,
        )

    # -- operators -----------------------------------------------------------

    def retry(self, task_id: int, *, by: str | None = "operator") -> None:
        """Put a failed or errored task back on the queue with fresh attempts."""

        def work(conn: Connection) -> None:
            status = conn.execute(sa.select(t.c.status).where(t.c.id == task_id)).scalar()
            if status is None:
                raise TaskNotFound(f"task {task_id} does not exist")
            sources, target = TRANSITIONS["retry"]
            if status not in sources:
                raise TransitionRejected(task_id, "retry", "failed or error", status)
            now = self.clock()
            res = conn.execute(
                sa.update(t)
                .where(t.c.id == task_id, t.c.status == status)
                .values(
                    status=target.value,
                    attempts=0,
                    rescue_count=0,
                    reentry_count=0,
                    run_after=now,
                    resume_after=None,
                    first_paused_at=None,
                    lease_until=None,
                    claimed_by=None,
                    updated_at=now,
                )
            )
            if res.rowcount != 1:
                self._reject(conn, task_id, "retry", None)
            events.record(
                conn, [events.event(task_id, status, target.value, now, reason="retry", worker=by)]
            )

        self.db.write(work)

    def get(self, task_id: int) -> Task:
        """The task as stored now (raises TaskNotFound)."""
        return reads.get_task(self.db, task_id)
