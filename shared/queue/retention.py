"""Retention: finished tasks, their events and routes are deleted once old enough.

Done tasks go after ``done_retention_sec`` (7 days); failed and errored ones
after ``failed_retention_sec`` (30 days) so operators can still retry them.
Idempotency keys live ``key_retention_sec`` (30 days) from their enqueue, in
their own table, whatever became of the task: a key enqueued again within
that time names its first task and runs nothing.
0 keeps them forever. Routing history and workspace events (``bus_events``) older
than ``route_retention_sec`` go too (what the events counted stays in
``bus_counters``). Deletes go in batches so no transaction grows large.

Tasks that were in the older system's bus_commands when agentbus adopted it
(ids up to ``adopted_tables.max_id``) are the operators' history, not
agentbus's: they are kept unless ``adopted`` is True (``prune_adopted_tasks``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.db import Database
from agentbus.queue.statements import in_state
from agentbus.queue.states import TaskStatus
from agentbus.schema import adopted_tables, bus_events, cooldown_history, route_log
from agentbus.schema import bus_commands as t
from agentbus.schema import idempotency_keys as keys
from agentbus.schema import task_dependencies as deps
from agentbus.schema import task_events as ev

DONE, FAILED, ERROR, CANCELLED = (
    TaskStatus.DONE,
    TaskStatus.FAILED,
    TaskStatus.ERROR,
    TaskStatus.CANCELLED,
)


def prune(
    db: Database,
    now: float,
    *,
    done_sec: float,
    failed_sec: float,
    batch: int,
    routes_sec: float = 0.0,
    keys_sec: float = 0.0,
    adopted: bool = False,
    max_batches: int = 100,
) -> int:
    """Delete old finished tasks (and their events); returns how many tasks went."""
    total = 0
    # Each group is the condition of a partial index on updated_at (migration 0021).
    finished = ((DONE,), done_sec), ((FAILED, ERROR), failed_sec), ((CANCELLED,), failed_sec)
    first_own = 0 if adopted else adopted_through(db) + 1
    for statuses, keep in finished:
        if keep <= 0:
            continue
        cutoff = now - keep
        for _ in range(max_batches):
            gone = db.write(_delete_batch(statuses, cutoff, batch, first_own))
            total += gone
            if gone < batch:
                break
    old: list[tuple[sa.Column[Any], sa.ColumnElement[bool]]] = []
    if routes_sec > 0:  # the routing history of tasks still kept goes too, once old,
        old.append((route_log.c.id, route_log.c.at < now - routes_sec))
        old.append((bus_events.c.id, bus_events.c.at < now - routes_sec))  # and events
    if keys_sec > 0:  # idempotency keys: kept longer than the tasks they named
        old.append((keys.c.key, keys.c.created_at < now - keys_sec))
    kept = [keep for keep in (done_sec, failed_sec) if keep > 0]
    if kept:  # cooldown history lives as long as the shortest task retention
        old.append((cooldown_history.c.id, cooldown_history.c.set_at < now - min(kept)))
    for key, condition in old:
        _delete_in_batches(db, key, condition, batch, max_batches)
    return total


def _delete_in_batches(
    db: Database,
    key: sa.Column[Any],
    condition: sa.ColumnElement[bool],
    batch: int,
    max_batches: int,
) -> int:
    """Delete the rows of ``key``'s table that meet ``condition``, ``batch`` to a
    transaction and at most ``max_batches`` of them (the rest at the next pass): a table
    of millions of old rows is never one long transaction."""
    picked = sa.select(key).where(condition).limit(batch)
    delete = sa.delete(key.table).where(key.in_(picked))
    total = 0
    for _ in range(max_batches):
        gone = int(db.write(lambda conn: conn.execute(delete).rowcount))
        total += gone
        if gone < batch:
            break
    return total


def adopted_through(db: Database) -> int:
    """The highest task id the older system's bus_commands held when adopted (0: none)."""
    query = sa.select(adopted_tables.c.max_id).where(adopted_tables.c.name == "bus_commands")
    return int(db.read(lambda conn: conn.execute(query).scalar()) or 0)


def finished_before(
    statuses: tuple[TaskStatus, ...], cutoff: float, batch: int, first_id: int = 0
) -> sa.Select[tuple[int]]:
    """Up to ``batch`` ids of tasks in ``statuses`` that finished before ``cutoff``: a
    range of the partial index of those states on updated_at, however many finished."""
    query = sa.select(t.c.id).where(in_state(*statuses), t.c.updated_at < cutoff)
    if first_id > 0:  # ``id + 0``: by the index on time still, not a range of ids
        query = query.where(t.c.id + 0 >= first_id)
    return query.limit(batch)


def _delete_batch(
    statuses: tuple[TaskStatus, ...], cutoff: float, batch: int, first_id: int
) -> Callable[[Connection], int]:
    def work(conn: Connection) -> int:
        ids = conn.execute(finished_before(statuses, cutoff, batch, first_id)).scalars().all()
        if not ids:
            return 0
        conn.execute(sa.delete(ev).where(ev.c.task_id.in_(ids)))
        conn.execute(sa.delete(route_log).where(route_log.c.task_id.in_(ids)))
        conn.execute(sa.delete(deps).where(deps.c.task_id.in_(ids)))  # what they waited for
        # Guarded like every write: a task retried meanwhile is no longer finished.
        return int(
            conn.execute(sa.delete(t).where(t.c.id.in_(ids), t.c.status.in_(statuses))).rowcount
        )

    return work
