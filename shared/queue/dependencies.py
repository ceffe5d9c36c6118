"""Dependencies: a task enqueued with ``after`` (ids of tasks that exist) waits until
they have ended, then runs with their results as ``payload.inputs``.

A waiting task is ``queued`` with ``run_after`` at 9999-12-31 (``WAITING_DUE``), so
that no claim takes it and the claim statements stay as they are. Each task it waits
for is a row of ``task_dependencies`` and is marked ``awaited``; when an awaited task
reaches an end, a trigger (migration 0030) makes due, at that moment and in that
transaction, each of its waiters whose dependencies have all ended as its policy asks:

- ``all_done`` (the default): every one ``done``. One that ends ``failed``, ``error``
  or ``cancelled`` dooms the waiter: the sweeper cancels it (event reason
  ``dependency``, the note naming the task and how it ended), and the tasks that wait
  for it in turn, in the same pass.
- ``any_end``: every one ended, however.

At enqueue the tasks waited for are locked (PostgreSQL) while they are marked, so one
that ends meanwhile is either seen ended by the enqueue or sees its new waiter. Cycles
cannot be made: a task can only wait for tasks that exist before it. The sweeper also
makes due any waiter whose dependencies have all ended that no trigger released (a
task ended by hand in SQL with the trigger disabled, say): it is never stuck.

At claim the worker reads the results of the tasks waited for, in the order given,
into the payload it runs with (``inputs``: a list of ``{"task", "status", "result"}``);
the stored payload is not changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.errors import InvalidTask
from agentbus.queue import events, wakeups
from agentbus.queue.guarded import GuardedQueue
from agentbus.queue.statements import CANCEL, keyed_in_state
from agentbus.queue.states import TaskStatus
from agentbus.schema import WAITING, WAITING_DUE
from agentbus.schema import bus_commands as t
from agentbus.schema import task_dependencies as deps

ALL_DONE, ANY_END = "all_done", "any_end"
AFTER_POLICIES = (ALL_DONE, ANY_END)
#: The most tasks one task may wait for.
MAX_AFTER = 1000
#: The event reason of a task cancelled because a task it waited for did not succeed.
DEPENDENCY = "dependency"
_BAD_ENDS = (TaskStatus.FAILED.value, TaskStatus.ERROR.value, TaskStatus.CANCELLED.value)
_DONE = TaskStatus.DONE.value
_WAITING = sa.text(WAITING)  # the index's condition, word for word (SQLite needs it)


def check_after(after: Any, policy: Any, delay_sec: float) -> None:
    """Raise InvalidTask with one line when ``after`` / ``policy`` cannot be enqueued."""
    if policy not in AFTER_POLICIES:
        raise InvalidTask(f"after_policy must be one of {', '.join(AFTER_POLICIES)}")
    if not isinstance(after, tuple):
        raise InvalidTask("after must be a list of task ids")
    if not after:
        return
    if len(after) > MAX_AFTER:
        raise InvalidTask(f"after names {len(after)} tasks, more than {MAX_AFTER}")
    for task_id in after:
        if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id <= 0:
            raise InvalidTask(f"after: {task_id!r} is not a task id")
    if len(set(after)) != len(after):
        raise InvalidTask("after names a task twice")
    if delay_sec:
        raise InvalidTask("a task that waits for others runs when they end: give no run-after")


def parse_after(text: str) -> tuple[int, ...]:
    """``--after``: task ids separated by commas."""
    ids = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not part.isascii():
            raise InvalidTask(f"--after: {part!r} is not a task id (give ids like 12,13)")
        ids.append(int(part))
    return tuple(ids)


def satisfied(policy: str, status: str) -> bool:
    """Whether a task waited for that is in ``status`` lets its waiter run."""
    return status == _DONE or (policy == ANY_END and status in _BAD_ENDS)


def cancel_note(after_id: int, status: str) -> str:
    return f"dependency: task {after_id} ended {status}"


class DependencyOps(GuardedQueue):
    def _await(
        self, conn: Connection, after: Sequence[int], policy: str
    ) -> tuple[bool, tuple[int, str] | None]:
        """Mark the tasks ``after`` names as awaited (PostgreSQL: locking them, in the order
        of their ids) and read their states: (whether the waiter must wait, the first one
        that dooms it: (id, state)). InvalidTask when one does not exist."""
        marked = conn.execute(
            sa.update(t)
            .where(t.c.id.in_(sorted(after)))
            .values(awaited=True)
            .returning(t.c.id, t.c.status)
        ).all()
        states = {int(i): str(s) for i, s in marked}
        missing = [i for i in after if i not in states]
        if missing:
            raise InvalidTask(f"after: task {missing[0]} does not exist")
        doomed = next(
            ((i, states[i]) for i in after if policy == ALL_DONE and states[i] in _BAD_ENDS), None
        )
        waits = any(not satisfied(policy, states[i]) for i in after)
        return waits, doomed

    def _wait_for(
        self,
        conn: Connection,
        task_id: int,
        after: Sequence[int],
        doomed: tuple[int, str] | None,
        now: float,
    ) -> None:
        """Write what the new task ``task_id`` waits for; a doomed one is cancelled at once."""
        conn.execute(
            sa.insert(deps),
            [{"task_id": task_id, "position": n, "after_id": a} for n, a in enumerate(after)],
        )
        if doomed is not None:
            self._cancel_waiters(conn, {task_id: doomed}, now, "enqueue")

    def cancel_doomed(self, *, by: str = "sweeper") -> list[int]:
        """Cancel the waiting tasks (policy ``all_done``) a dependency of which ended other
        than done, and the tasks waiting for those in turn; returns their ids."""

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            waiting = sa.select(t.c.id).where(_WAITING, t.c.after_policy == ALL_DONE)
            doomed = _doomed(conn, deps.c.task_id.in_(waiting.scalar_subquery()))
            moved: list[int] = []
            while doomed:
                ended = self._cancel_waiters(conn, doomed, now, by)
                moved += ended
                doomed = _doomed(conn, deps.c.after_id.in_(ended)) if ended else {}
            return moved

        return self.db.write(work)

    def _cancel_waiters(
        self, conn: Connection, doomed: Mapping[int, tuple[int, str]], now: float, by: str
    ) -> list[int]:
        moved, rows = [], []
        for task_id, (after_id, status) in sorted(doomed.items()):
            params = {
                "p_ids": [task_id],
                "p_source": TaskStatus.QUEUED.value,
                "p_now": now,
                "p_note": cancel_note(after_id, status),
            }
            if conn.execute(CANCEL, params).first() is None:
                continue
            moved.append(task_id)
            detail = {"after": after_id, "status": status}
            rows.append(
                events.event(
                    task_id,
                    TaskStatus.QUEUED.value,
                    TaskStatus.CANCELLED.value,
                    now,
                    reason=DEPENDENCY,
                    worker=by,
                    detail=detail,
                )
            )
        events.record(conn, rows)
        return moved

    def release_ready(self) -> list[int]:
        """Make due the waiting tasks whose dependencies have all ended as their policy
        asks (the trigger does it as the last one ends; this finds any it did not)."""

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            d = t.alias("d")
            unmet = (
                sa.select(deps.c.task_id)
                .join(d, d.c.id == deps.c.after_id)
                .where(
                    deps.c.task_id == t.c.id,
                    d.c.status != _DONE,
                    sa.not_(sa.and_(t.c.after_policy == ANY_END, d.c.status.in_(_BAD_ENDS))),
                )
            )
            waiting = conn.execute(sa.select(t.c.id).where(_WAITING)).scalars().all()
            if not waiting:
                return []
            ready = (
                sa.update(t)
                .where(t.c.id.in_(list(waiting)), keyed_in_state(TaskStatus.QUEUED))
                .where(t.c.run_after == WAITING_DUE, ~sa.exists(unmet))
                .values(run_after=now)
                .returning(t.c.id, t.c.agent)
            )
            rows = conn.execute(ready).all()
            wakeups.notify(conn, {r.agent for r in rows})
            return sorted(int(r.id) for r in rows)

        return self.db.write(work)

    def inputs(self, task_ids: Iterable[int]) -> dict[int, list[dict[str, Any]]]:
        """For each of ``task_ids`` that waited for tasks: what they came to, in the order
        given (``{"task", "status", "result"}``; a task since deleted: status None)."""
        ids = list(task_ids)
        if not ids:
            return {}
        query = (
            sa.select(deps.c.task_id, deps.c.after_id, t.c.status, t.c.result)
            .outerjoin(t, t.c.id == deps.c.after_id)
            .where(deps.c.task_id.in_(ids))
            .order_by(deps.c.task_id, deps.c.position)
        )
        out: dict[int, list[dict[str, Any]]] = {}
        for task_id, after_id, status, result in self.db.read(lambda c: c.execute(query).all()):
            entry = {"task": int(after_id), "status": status, "result": result}
            out.setdefault(int(task_id), []).append(entry)
        return out

    def waiting(self) -> dict[str, int]:
        """How many tasks of each agent wait for others."""
        return self.db.read(waiting_by_agent)

    def dependencies_of(self, task_id: int) -> list[int]:
        """The ids ``task_id`` waits (or waited) for, in the order given."""
        query = (
            sa.select(deps.c.after_id).where(deps.c.task_id == task_id).order_by(deps.c.position)
        )
        return [int(i) for i in self.db.read(lambda c: c.execute(query).scalars().all())]


def waiting_by_agent(conn: Connection) -> dict[str, int]:
    """How many tasks of each agent wait for others (through the waiting tasks' index)."""
    query = sa.select(t.c.agent, sa.func.count()).where(_WAITING).group_by(t.c.agent)
    return {str(a): int(n) for a, n in conn.execute(query).all()}


def _doomed(conn: Connection, which: sa.ColumnElement[bool]) -> dict[int, tuple[int, str]]:
    """Waiting tasks (policy ``all_done``) among ``which`` edges with a dependency ended
    other than done: id -> (that dependency, its state), the first in the order given."""
    w, d = t.alias("w"), t.alias("d")
    query = (
        sa.select(deps.c.task_id, deps.c.after_id, d.c.status)
        .join(w, w.c.id == deps.c.task_id)
        .join(d, d.c.id == deps.c.after_id)
        .where(which, d.c.status.in_(_BAD_ENDS))
        .where(w.c.status == TaskStatus.QUEUED.value, w.c.after_policy == ALL_DONE)
        .where(w.c.run_after == WAITING_DUE)
        .order_by(deps.c.task_id, deps.c.position)
    )
    found: dict[int, tuple[int, str]] = {}
    for task_id, after_id, status in conn.execute(query).all():
        found.setdefault(int(task_id), (int(after_id), str(status)))
    return found
