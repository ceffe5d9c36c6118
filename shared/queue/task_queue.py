"""The task queue: the only code that writes ``bus_commands.status``.

Every operation is one guarded conditional UPDATE (``WHERE id = … AND status
= … [AND claim_token = …]``, see ``agentbus.queue.statements``) plus its event row,
in one transaction. A guarded write that matches no row is a
``TransitionRejected`` (raised, or returned by ``settle``): the
task was not where the caller thought — another claim owns it, or someone
else moved it. A worker hands over a ``Settlement`` (``decisions``): the claim
and what becomes of it.

Claiming is one statement: Postgres picks rows with ``FOR UPDATE SKIP
LOCKED``; SQLite runs ``UPDATE … WHERE id IN (SELECT …) RETURNING`` inside
``BEGIN IMMEDIATE``, which serializes writers. Each claim bumps the task's
``claim_token``, a fencing number: a worker whose lease was taken over holds
an old token and none of its writes can land.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission.routing import Route
from agentbus.errors import TaskNotFound, TransitionRejected
from agentbus.queue import events, reads, wakeups
from agentbus.queue.by_hand import ByHandOps
from agentbus.queue.deadlines import DeadlineOps
from agentbus.queue.decisions import (
    Complete,
    Crash,
    Expire,
    Fail,
    Pause,
    Release,
    Requeue,
    Settlement,
)
from agentbus.queue.dependencies import DependencyOps
from agentbus.queue.groups import GroupRule, mode_of
from agentbus.queue.guarded import Clock, text_safe
from agentbus.queue.inserts import (
    ENQUEUE_ARRAYS,
    ENQUEUE_MANY_POSTGRES,
    ENQUEUE_ONE,
    ENQUEUE_ONE_BINDS,
    ENQUEUE_ONE_POSTGRES,
    INSERT_EVENT,
)
from agentbus.queue.statements import HEARTBEAT, SETTLE, action_of, has_due, next_due, settle_params
from agentbus.queue.states import TRANSITIONS, TaskStatus
from agentbus.queue.sweeps import SweepOps
from agentbus.queue.tasks import Task, TaskSpec, check_payload, expires_at
from agentbus.schema import WAITING_DUE
from agentbus.schema import bus_commands as t
from agentbus.schema import idempotency_keys as keys

QUEUED = TaskStatus.QUEUED
_QUEUED_TEXT = QUEUED.value


def _binds(row: dict[str, Any]) -> dict[str, Any]:
    """``ENQUEUE_ONE``'s parameters from a task's row (``TaskQueue.stored_row``)."""
    return {name: row[column] for name, column in ENQUEUE_ONE_BINDS}


__all__ = ["Clock", "Enqueued", "Settlement", "TaskQueue"]


@dataclass(frozen=True)
class Enqueued:
    id: int
    created: bool  # False: the idempotency key named an existing task


class TaskQueue(SweepOps, ByHandOps, DeadlineOps, DependencyOps):
    """Queue operations over one database, with an injectable clock."""

    # -- producers -----------------------------------------------------------

    def enqueue(self, spec: TaskSpec) -> Enqueued:
        """Insert a queued task; with an idempotency key, return the task that has it."""
        if spec.key is None:
            return Enqueued(self.enqueue_many([spec])[0], created=True)
        return self.db.write(lambda conn: self.enqueue_on(conn, [spec])[0])

    def enqueue_on(self, conn: Connection, specs: Sequence[TaskSpec]) -> list[Enqueued]:
        """Insert tasks through ``conn``, in its transaction (the caller's, which commits
        or rolls back); keys are honoured. The workers hear of them on commit."""
        now = self.clock()
        out = [self._insert_on(conn, spec, now) for spec in specs]
        wakeups.notify(conn, {spec.agent for spec in specs})
        return out

    def _insert_on(self, conn: Connection, spec: TaskSpec, now: float) -> Enqueued:
        models = None if spec.models is None else list(spec.models)
        row = self._row(spec, now, dict(spec.payload), models)  # for SQLAlchemy's JSON type
        if spec.key is not None:
            # The key table outlives the task (retention keeps keys longer).
            known = conn.execute(sa.select(keys.c.task_id).where(keys.c.key == spec.key)).scalar()
            if known is not None:
                return Enqueued(int(known), created=False)
        doomed = None
        if spec.after:
            waits, doomed = self._await(conn, spec.after, spec.after_policy)
            row.update(after_policy=spec.after_policy, run_after=WAITING_DUE if waits else now)
        new_id = conn.execute(self._insert_keyed, row).scalar()
        if new_id is None:  # the key was enqueued meanwhile by another producer
            existing = conn.execute(
                sa.select(t.c.id).where(t.c.idempotency_key == spec.key)
            ).scalar_one()
            return Enqueued(int(existing), created=False)
        if spec.key is not None:
            conn.execute(self._insert_key, {"key": spec.key, "task_id": new_id, "created_at": now})
        events.record(conn, [events.event(new_id, None, QUEUED, now, reason="enqueue")])
        if spec.after:
            self._wait_for(conn, int(new_id), spec.after, doomed, now)
        return Enqueued(int(new_id), created=True)

    def enqueue_many(self, specs: Sequence[TaskSpec]) -> list[int]:
        """Insert many tasks in one transaction; returns their ids in order.

        With idempotency keys, a key already known gives its task's id. Without:
        on PostgreSQL one statement (the tasks, their events and the workers'
        wake-up) in autocommit; on SQLite one transaction of compiled inserts.
        """
        if any(s.key is not None or s.after for s in specs):
            return [e.id for e in self.db.write(lambda conn: self.enqueue_on(conn, specs))]
        if not specs:
            return []
        now = self.clock()
        rows = [self.stored_row(s, now) for s in specs]
        if self.db.dialect == "postgresql":
            params: dict[str, Any]
            if len(rows) == 1:
                statement = self.db.prepared(ENQUEUE_ONE_POSTGRES)
                params = {f"p_{n}": rows[0][n] for n in ENQUEUE_ARRAYS}
            else:
                statement = self.db.prepared(ENQUEUE_MANY_POSTGRES)
                params = {f"p_{n}": [r[n] for r in rows] for n in ENQUEUE_ARRAYS}
            params["p_now"] = now

            def one_statement(conn: Connection) -> list[int]:
                return [int(row[0]) for row in statement.execute(conn, params).fetchall()]

            return self.db.pinned.write_one(one_statement)
        insert, event = self.db.prepared(ENQUEUE_ONE), self.db.prepared(INSERT_EVENT)
        queued = events.event(0, None, QUEUED, now, reason="enqueue")  # each task's, by id

        def work(conn: Connection) -> list[int]:
            ids = [int(insert.execute(conn, _binds(row)).lastrowid) for row in rows]
            if len(ids) == 1:
                event.execute(conn, {**queued, "task_id": ids[0]})
            else:
                event.execute_many(conn, [{**queued, "task_id": i} for i in ids])
            return ids

        return self.db.pinned.write(work)

    def stored_row(self, spec: TaskSpec, now: float) -> dict[str, Any]:
        """The task's row for the compiled inserts: payload and models as the JSON text
        stored (the payload as its validation encoded it; a chain's text made once per
        chain)."""
        models = None if spec.models is None else _chain_json(tuple(spec.models))
        return self._row(spec, now, spec.payload_json(), models)

    def _row(self, spec: TaskSpec, now: float, payload: Any, models: Any) -> dict[str, Any]:
        check_payload(spec, self.payload_limits)
        return {
            "agent": spec.agent,
            "command": spec.command,
            "payload": payload,
            "models": models,
            "role": spec.role,
            "status": _QUEUED_TEXT,
            "priority": spec.priority,
            "run_after": now + spec.delay_sec,
            "max_attempts": spec.max_attempts or self.max_attempts,
            "idempotency_key": spec.key,
            "expires_at": expires_at(spec, now),
            "group_key": spec.group,
            "created_at": now,
            "updated_at": now,
        }

    # -- workers -------------------------------------------------------------

    def claim(
        self,
        agent: str,
        worker: str,
        lease_sec: float,
        limit: int = 1,
        *,
        groups: GroupRule | None = None,
    ) -> list[Task]:
        """Claim up to ``limit`` due queued tasks of ``agent``: priority first, then age
        (``groups``: the agent's rule for its tasks' groups)."""
        return self.settle_and_claim((), agent, worker, lease_sec, limit, groups=groups)[1]

    def settle_and_claim(
        self,
        items: Sequence[Settlement],
        agent: str,
        worker: str | None,
        lease_sec: float,
        limit: int,
        *,
        groups: GroupRule | None = None,
    ) -> tuple[list[TransitionRejected], list[Task]]:
        """Settle ``items`` (as ``settle``) and claim up to ``limit`` next tasks (as
        ``claim``): a worker's steady state. Completions and the claim are one
        transaction (``agentbus.queue.settle_and_claim``: one statement on PostgreSQL), so a
        worker pays one commit per claim. ``limit`` 0 only settles."""
        acks = [i for i in items if isinstance(i.decision, Complete)]
        others = [i for i in items if not isinstance(i.decision, Complete)]
        lost = self._move_claims(others, worker) if others else []
        if not acks and limit <= 0:
            return lost, []
        acked, rows = self._steady.run(
            acks,
            agent=agent,
            worker=worker,
            now=self.clock(),
            lease_sec=lease_sec,
            limit=limit,
            groups=groups,
        )
        lost += self._rejections([a for a in acks if a.task_id not in acked])
        tasks = [Task.from_row(row) for row in rows]
        waited = [task for task in tasks if task.after_policy is not None]
        if waited:  # the results of the tasks they waited for, as their inputs
            inputs = self.inputs(task.id for task in waited)
            for task in waited:
                task.payload["inputs"] = inputs.get(task.id, [])
        return lost, sorted(tasks, key=lambda task: (-task.priority, task.run_after, task.id))

    def has_due(self, agent: str, *, groups: GroupRule | None = None) -> bool:
        """Whether a task of ``agent`` is queued and due, and its group has a turn free
        (a read: no write lock taken)."""
        params = {"p_agent": agent, "p_now": self.clock(), **(groups.params if groups else {})}
        query = has_due(mode_of(groups))
        return self.db.read(lambda conn: conn.execute(query, params).first() is not None)

    def due_in(self, agent: str, *, groups: GroupRule | None = None) -> float | None:
        """Seconds until the earliest queued task of ``agent`` is due (0 or less: due now;
        None: none is queued, or none has a turn free in its group). A read of the agent's
        queued tasks."""
        now = self.clock()
        params = {"p_agent": agent, "p_now": now, **(groups.params if groups else {})}
        query = next_due(mode_of(groups))
        at = self.db.read(lambda conn: conn.execute(query, params).scalar())
        return None if at is None else float(at) - now

    def heartbeat(self, task_id: int, token: int, lease_sec: float) -> float:
        """Extend the lease of a claim we hold; returns the new lease end."""

        def work(conn: Connection) -> float:
            lease_until = self.clock() + lease_sec
            params = {"p_id": task_id, "p_token": token, "p_lease_until": lease_until}
            if conn.execute(HEARTBEAT, params).rowcount != 1:
                self._reject(conn, task_id, "heartbeat", token)
            return lease_until

        return self.db.write(work)

    # -- settling a claim ----------------------------------------------------

    def settle(
        self, items: Sequence[Settlement], *, worker: str | None = None
    ) -> list[TransitionRejected]:
        """Make the change each item's decision names (a batch's acknowledgement: the
        completions in one transaction, the other decisions in another).

        Each item whose guarded write matched no row (the claim was lost: its lease
        ran out and another claim owns the task, or someone moved it) changes nothing
        and comes back as a ``TransitionRejected`` saying where the task is; the
        others are made with their events and routes.
        """
        return self.settle_and_claim(items, "", worker, 0, 0)[0]

    def _move_claims(
        self, items: Sequence[Settlement], worker: str | None
    ) -> list[TransitionRejected]:
        """Make decisions other than completions, in one transaction, with their event
        rows and routes."""

        def work(conn: Connection) -> list[TransitionRejected]:
            now = self.clock()
            moved: set[int] = set()
            for item in items:
                action, params = settle_params(item.decision)
                full = {"p_id": item.task_id, "p_token": item.token, "p_now": now, **params}
                if conn.execute(SETTLE[action], text_safe(full)).rowcount == 1:
                    moved.add(item.task_id)
            done = [i for i in items if i.task_id in moved]
            events.record(conn, [events.for_settlement(i, worker, now) for i in done])
            events.record_routes(conn, [route for i in done for route in i.routes])
            return [
                self._rejection(conn, i.task_id, action_of(i.decision), i.token)
                for i in items
                if i.task_id not in moved
            ]

        return self.db.write(work)

    def _rejections(self, items: Sequence[Settlement]) -> list[TransitionRejected]:
        """Why each of these completions matched no row (read after the fact)."""
        if not items:
            return []

        def work(conn: Connection) -> list[TransitionRejected]:
            return [self._rejection(conn, i.task_id, "complete", i.token) for i in items]

        return self.db.read(work)

    # Named shorthands of ``settle`` (tests, scripts, operators): each raises
    # TransitionRejected when the claim was lost.

    def complete(
        self,
        task_id: int,
        token: int,
        result: str | None = None,
        *,
        model: str | None = None,
        worker: str | None = None,
        routes: Sequence[Route] = (),
    ) -> None:
        self._raise_lost(Settlement(task_id, token, Complete(result, model), routes), worker)

    def fail(
        self,
        task_id: int,
        token: int,
        reason: str,
        *,
        worker: str | None = None,
        spend_attempt: bool = True,
        routes: Sequence[Route] = (),
    ) -> None:
        """Permanent failure: the work cannot succeed."""
        decision = Fail(reason, spend_attempt)
        self._raise_lost(Settlement(task_id, token, decision, routes), worker)

    def error(self, task_id: int, token: int, error: str, *, worker: str | None = None) -> None:
        """An unexpected exception in handler or worker code."""
        self._raise_lost(Settlement(task_id, token, Crash(error)), worker)

    def pause(
        self,
        task_id: int,
        token: int,
        resume_after: float,
        reason: str,
        *,
        model: str | None = None,
        worker: str | None = None,
        routes: Sequence[Route] = (),
        cooldown: bool = True,
    ) -> None:
        """Every candidate is refused for a temporary reason: park the task (no attempt spent).

        ``cooldown`` False (a gate refused: a rate window, a circuit, slots) does not
        count as re-entering ``model``'s cooldown (the sweeper's re-entry rule)."""
        decision = Pause(resume_after, model, reason, cooldown=cooldown)
        self._raise_lost(Settlement(task_id, token, decision, routes), worker)

    def release(
        self, task_id: int, token: int, reason: str = "shutdown", *, worker: str | None = None
    ) -> None:
        """Give a claimed task back untouched (no attempt spent)."""
        self._raise_lost(Settlement(task_id, token, Release(reason)), worker)

    def requeue(
        self,
        task_id: int,
        token: int,
        run_after: float,
        error: str,
        *,
        worker: str | None = None,
        routes: Sequence[Route] = (),
    ) -> None:
        """A retryable failure: the attempt is spent and the task waits until ``run_after``."""
        decision = Requeue(run_after, error)
        self._raise_lost(Settlement(task_id, token, decision, routes), worker)

    def expire(self, task_id: int, token: int, reason: str, *, worker: str | None = None) -> None:
        """Its deadline came before the task started: end it (cancelled), never run."""
        self._raise_lost(Settlement(task_id, token, Expire(reason)), worker)

    def _raise_lost(self, item: Settlement, worker: str | None) -> None:
        """Settle one claim; raise its ``TransitionRejected`` when it was lost."""
        lost = self.settle([item], worker=worker)
        if lost:
            raise lost[0]

    # -- operators -----------------------------------------------------------

    def retry(self, task_id: int, *, by: str | None = "operator") -> None:
        """Put a failed, errored or cancelled task back on the queue with fresh attempts."""

        def work(conn: Connection) -> None:
            found = conn.execute(sa.select(t.c.status, t.c.agent).where(t.c.id == task_id)).first()
            if found is None:
                raise TaskNotFound(f"task {task_id} does not exist")
            status, agent = found
            sources, target = TRANSITIONS["retry"]
            if status not in sources:
                expected = " or ".join(sorted(s.value for s in sources))
                raise TransitionRejected(task_id, "retry", expected, status)
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
                    # A deadline already past is dropped: the operator runs the task anyway.
                    expires_at=sa.case((t.c.expires_at <= now, sa.null()), else_=t.c.expires_at),
                )
            )
            if res.rowcount != 1:
                self._reject(conn, task_id, "retry", None)
            events.record(
                conn, [events.event(task_id, status, target.value, now, reason="retry", worker=by)]
            )
            wakeups.notify(conn, (agent,))

        self.db.write(work)

    def get(self, task_id: int) -> Task:
        """The task as stored now (raises TaskNotFound)."""
        return reads.get_task(self.db, task_id)


@functools.lru_cache(maxsize=1024)
def _chain_json(models: tuple[str, ...]) -> str:
    """A model chain as stored (producers enqueue few distinct chains)."""
    return json.dumps(list(models))
