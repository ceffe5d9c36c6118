"""The task queue: the only code that writes ``bus_commands.status``.

Every operation is one guarded conditional UPDATE (``WHERE id = … AND status
= … [AND claim_token = …]``) plus its event row, in one transaction. A
guarded write that matches no row raises ``TransitionRejected``: the task was
not where the caller thought (another claim owns it, someone else moved it).

Claiming is one statement: Postgres picks rows with ``FOR UPDATE SKIP
LOCKED``; SQLite runs ``UPDATE … WHERE id IN (SELECT …) RETURNING`` inside
``BEGIN IMMEDIATE``, which serializes writers. Each claim bumps the task's
``claim_token``, a fencing number: a worker whose lease was taken over holds
an old token and none of its writes can land.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from shared import events, reads
from shared.db import Database
from shared.errors import TaskNotFound, TransitionRejected
from shared.schema import bus_commands as t
from shared.states import TRANSITIONS, TaskStatus
from shared.tasks import Task, TaskSpec

Clock = Callable[[], float]


@dataclass(frozen=True)
class Enqueued:
    id: int
    created: bool  # False: the idempotency key named an existing task


class TaskQueue:
    """Queue operations over one database, with an injectable clock."""

    def __init__(self, db: Database, *, clock: Clock = time.time, max_attempts: int = 3) -> None:
        self.db = db
        self.clock = clock
        self.max_attempts = max_attempts

    # -- producers -----------------------------------------------------------

    def enqueue(self, spec: TaskSpec) -> Enqueued:
        """Insert a queued task; with an idempotency key, return the task that has it."""

        def work(conn: Connection) -> Enqueued:
            now = self.clock()
            values = self._row(spec, now)
            if spec.key is None:
                new_id = conn.execute(sa.insert(t).values(values).returning(t.c.id)).scalar_one()
            else:
                new_id = conn.execute(
                    self._insert()
                    .values(values)
                    .on_conflict_do_nothing(index_elements=["idempotency_key"])
                    .returning(t.c.id)
                ).scalar()
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

    def _insert(self) -> Any:
        dialect = postgresql if self.db.dialect == "postgresql" else sqlite
        return dialect.insert(t)

    # -- workers -------------------------------------------------------------

    def claim(self, agent: str, worker: str, lease_sec: float, limit: int = 1) -> list[Task]:
        """Claim up to ``limit`` due queued tasks of ``agent``: priority first, then age."""

        def work(conn: Connection) -> list[Task]:
            now = self.clock()
            picked = (
                sa.select(t.c.id)
                .where(t.c.status == "queued", t.c.agent == agent, t.c.run_after <= now)
                .order_by(t.c.priority.desc(), t.c.id)
                .limit(limit)
            )
            if self.db.dialect == "postgresql":
                # A CTE runs once; an IN (subquery … FOR UPDATE) may be re-run per row.
                cte = picked.with_for_update(skip_locked=True).cte("picked")
                match = t.c.id == cte.c.id
            else:
                match = t.c.id.in_(picked.scalar_subquery())
            stmt = (
                sa.update(t)
                .where(match, t.c.status == "queued")
                .values(
                    status="claimed",
                    claim_token=t.c.claim_token + 1,
                    claimed_by=worker,
                    claimed_at=now,
                    lease_until=now + lease_sec,
                    updated_at=now,
                )
                .returning(*t.c)
            )
            tasks = sorted(
                (Task.from_row(r._mapping) for r in conn.execute(stmt)),
                key=lambda task: (-task.priority, task.id),
            )
            events.record(
                conn,
                (
                    events.event(
                        task.id,
                        "queued",
                        "claimed",
                        now,
                        worker=worker,
                        claim_token=task.claim_token,
                        reason="claim",
                    )
                    for task in tasks
                ),
            )
            return tasks

        return self.db.write(work)

    def heartbeat(self, task_id: int, token: int, lease_sec: float) -> float:
        """Extend the lease of a claim we hold; returns the new lease end."""

        def work(conn: Connection) -> float:
            lease_until = self.clock() + lease_sec
            res = conn.execute(
                sa.update(t)
                .where(t.c.id == task_id, t.c.status == "claimed", t.c.claim_token == token)
                .values(lease_until=lease_until)
            )
            if res.rowcount != 1:
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
    ) -> None:
        self._settle(
            "complete",
            task_id,
            token,
            worker,
            reason="done",
            values={
                "result": result,
                "result_note": note,
                "attempts": t.c.attempts + 1,
                "lease_until": None,
                "first_paused_at": None,
                "reentry_count": 0,
            },
        )

    def fail(
        self,
        task_id: int,
        token: int,
        reason: str,
        *,
        worker: str | None = None,
        spend_attempt: bool = True,
    ) -> None:
        """Permanent failure: the work cannot succeed."""
        self._settle(
            "fail",
            task_id,
            token,
            worker,
            reason=reason,
            values={
                "result_note": reason,
                "last_error": reason,
                "attempts": t.c.attempts + 1 if spend_attempt else t.c.attempts,
                "lease_until": None,
            },
        )

    def error(self, task_id: int, token: int, error: str, *, worker: str | None = None) -> None:
        """An unexpected exception in handler or worker code."""
        self._settle(
            "error",
            task_id,
            token,
            worker,
            reason="error",
            values={
                "result_note": error,
                "last_error": error,
                "attempts": t.c.attempts + 1,
                "lease_until": None,
            },
            detail={"error": error},
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
    ) -> None:
        """Every candidate is refused for a temporary reason: park the task.

        No attempt is spent. ``first_paused_at`` marks the start of the pause
        episode (kept across resume/re-pause). If a resumed task pauses again
        on the same model its ``reentry_count`` rises; another model resets it.
        """

        def values(now: float) -> dict[str, Any]:
            return {
                "resume_after": resume_after,
                "pause_reason": reason,
                "pause_model": model,
                "pause_count": t.c.pause_count + 1,
                "first_paused_at": sa.func.coalesce(t.c.first_paused_at, now),
                "reentry_count": sa.case(
                    (
                        sa.and_(t.c.resume_count > 0, t.c.pause_model == model),
                        t.c.reentry_count + 1,
                    ),
                    else_=0,
                ),
                "lease_until": None,
            }

        self._settle(
            "pause",
            task_id,
            token,
            worker,
            reason=reason,
            values=values,
            detail={"resume_after": resume_after, "model": model, **(detail or {})},
        )

    def release(
        self, task_id: int, token: int, reason: str = "shutdown", *, worker: str | None = None
    ) -> None:
        """Give a claimed task back untouched (no attempt spent)."""
        self._settle(
            "release",
            task_id,
            token,
            worker,
            reason=reason,
            values={"lease_until": None, "claimed_by": None},
        )

    def requeue(
        self, task_id: int, token: int, run_after: float, error: str, *, worker: str | None = None
    ) -> None:
        """A retryable failure: the attempt is spent and the task waits until ``run_after``."""
        self._settle(
            "requeue",
            task_id,
            token,
            worker,
            reason="retry",
            values={
                "attempts": t.c.attempts + 1,
                "run_after": run_after,
                "last_error": error,
                "lease_until": None,
                "claimed_by": None,
            },
            detail={"error": error, "run_after": run_after},
        )

    # -- the sweeper ---------------------------------------------------------

    def resume(self, task_ids: Sequence[int], *, by: str = "sweeper") -> list[int]:
        """Paused -> queued; returns the ids that were still paused and moved."""
        return self._move_many(
            "resume",
            task_ids,
            by,
            reason="resume",
            values=lambda now: {
                "resume_after": None,
                "resume_count": t.c.resume_count + 1,
                "run_after": now,
            },
        )

    def demote(self, task_ids: Sequence[int], reason: str, *, by: str = "sweeper") -> list[int]:
        """Paused -> failed (paused too long); returns the ids that moved."""
        return self._move_many(
            "demote",
            task_ids,
            by,
            reason="demoted",
            values=lambda now: {"result_note": reason, "last_error": reason, "resume_after": None},
            detail={"why": reason},
        )

    def rescue(
        self, task_id: int, token: int, *, poison: str | None = None, by: str = "sweeper"
    ) -> None:
        """A claim whose lease expired: back to queued, or failed when ``poison`` says why.

        Guarded by the token and by the lease having expired, so a worker that
        heartbeats in time keeps its task.
        """
        action = "rescue" if poison is None else "rescue_fail"
        values: dict[str, Any] = {
            "rescue_count": t.c.rescue_count + 1,
            "lease_until": None,
            "claimed_by": None,
        }
        if poison is not None:
            values.update(result_note=poison, last_error=poison)
        self._settle(
            action,
            task_id,
            token,
            by,
            reason="lease expired" if poison is None else "poison pill",
            values=values,
            detail={"poison": poison} if poison else None,
            lease_expired=True,
        )

    def _move_many(
        self,
        action: str,
        task_ids: Sequence[int],
        by: str,
        *,
        reason: str,
        values: Callable[[float], Mapping[str, Any]],
        detail: Mapping[str, Any] | None = None,
    ) -> list[int]:
        (source,), target = TRANSITIONS[action]
        if not task_ids:
            return []

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            moved = (
                conn.execute(
                    sa.update(t)
                    .where(t.c.id.in_(list(task_ids)), t.c.status == source.value)
                    .values(status=target.value, updated_at=now, **values(now))
                    .returning(t.c.id)
                )
                .scalars()
                .all()
            )
            events.record(
                conn,
                (
                    events.event(
                        int(i),
                        source.value,
                        target.value,
                        now,
                        reason=reason,
                        worker=by,
                        detail=detail,
                    )
                    for i in moved
                ),
            )
            return sorted(int(i) for i in moved)

        return self.db.write(work)

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

    # -- reading back -------------------------------------------------------

    def get(self, task_id: int) -> Task:
        """The task as stored now (raises TaskNotFound)."""
        return reads.get_task(self.db, task_id)

    # -- the guarded write ---------------------------------------------------

    def _settle(
        self,
        action: str,
        task_id: int,
        token: int,
        worker: str | None,
        *,
        reason: str,
        values: Mapping[str, Any] | Callable[[float], Mapping[str, Any]],
        detail: Mapping[str, Any] | None = None,
        lease_expired: bool = False,
    ) -> None:
        (source,), target = TRANSITIONS[action]

        def work(conn: Connection) -> None:
            now = self.clock()
            changes = values(now) if callable(values) else values
            stmt = (
                sa.update(t)
                .where(t.c.id == task_id, t.c.status == source.value, t.c.claim_token == token)
                .values(status=target.value, updated_at=now, **changes)
            )
            if lease_expired:
                stmt = stmt.where(t.c.lease_until < now)
            if conn.execute(stmt).rowcount != 1:
                self._reject(conn, task_id, action, token, now if lease_expired else None)
            events.record(
                conn,
                [
                    events.event(
                        task_id,
                        source.value,
                        target.value,
                        now,
                        reason=reason,
                        worker=worker,
                        claim_token=token,
                        detail=detail,
                    )
                ],
            )

        self.db.write(work)

    @staticmethod
    def _reject(
        conn: Connection,
        task_id: int,
        action: str,
        token: int | None,
        lease_checked_at: float | None = None,
    ) -> None:
        row = conn.execute(
            sa.select(t.c.status, t.c.claim_token, t.c.lease_until).where(t.c.id == task_id)
        ).first()
        sources, _ = TRANSITIONS.get(action, (frozenset({TaskStatus.CLAIMED}), None))
        expected = " or ".join(sorted(s.value for s in sources))
        if row is None:
            raise TransitionRejected(task_id, action, expected, None, token)
        actual = row.status
        if token is not None and row.status == "claimed" and row.claim_token != token:
            actual = f"claimed under token {row.claim_token}"
        elif lease_checked_at is not None and row.status == "claimed":
            left = (row.lease_until or 0) - lease_checked_at
            actual = f"claimed with {left:.1f}s of lease left"
        raise TransitionRejected(task_id, action, expected, actual, token)
