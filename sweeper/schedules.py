"""The sweeper's schedules: each ``[schedules.NAME]`` occurrence enqueued once.

At each pass (and at each occurrence: the sweeper's wake-up comes at the next one),
every configured schedule's latest occurrence not yet run is enqueued, keyed by the
schedule and the occurrence (``schedule:NAME:2026-12-08T02:00:00+00:00``), in the
transaction that moves the schedule's ``schedule_runs.last_at`` to it: however many
sweepers run at once, the key gives one task. A schedule first seen now has no past:
occurrences before a sweeper first saw it never run. After downtime only the latest
missed occurrence runs (``catch_up``, the default), or none when ``catch_up = false``
(an occurrence later than one full pass, ``sweep_interval_sec``, is skipped).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.catalog.schedules import ScheduleConfig, spec
from agentbus.db import Database, dialect_insert
from agentbus.logging import get_logger
from agentbus.schema import schedule_runs as runs

if TYPE_CHECKING:
    from agentbus.sweeper.jobs import Sweep

log = get_logger("agentbus.sweeper")


@dataclass(frozen=True)
class Run:
    """A schedule's state as kept in ``schedule_runs``."""

    first_seen: float
    last_at: float | None
    last_task_id: int | None

    def since(self) -> float:
        return self.first_seen if self.last_at is None else max(self.first_seen, self.last_at)


def enqueue_due(s: Sweep) -> dict[str, int]:
    """Enqueue each schedule's due occurrence (once), skip the missed ones that
    ``catch_up = false`` leaves out."""
    schedules = s.config.catalog.schedules
    counts = {"scheduled": 0, "schedules_missed": 0}
    if not schedules:
        return counts
    now = s.clock()
    kept = seen(s.db, schedules, now)
    for schedule in schedules.values():
        at = schedule.latest(kept[schedule.name].since(), now)
        if at is None:
            continue
        if not schedule.catch_up and now - at > s.settings.sweep_interval_sec:
            if _move(s.db, schedule.name, at, None):
                log.warning("schedule_missed", schedule=schedule.name, occurrence=at)
                counts["schedules_missed"] += 1
            continue
        task_id = _enqueue(s, schedule, at)
        if task_id is not None:
            log.info("schedule_enqueued", schedule=schedule.name, task_id=task_id, occurrence=at)
            counts["scheduled"] += 1
    return counts


def next_at(s: Sweep) -> float | None:
    """The next occurrence of any schedule (computed, no read)."""
    now = s.clock()
    return min((c.next_after(now) for c in s.config.catalog.schedules.values()), default=None)


def seen(db: Database, schedules: Iterable[str], now: float) -> dict[str, Run]:
    """Each schedule's row, made (first seen ``now``) for those that have none."""
    names = sorted(schedules)
    upsert = dialect_insert(db.dialect)

    def work(conn: Connection) -> dict[str, Run]:
        known = _rows(conn, names)
        new = [{"name": n, "first_seen": now} for n in names if n not in known]
        if new:
            conn.execute(upsert(runs).on_conflict_do_nothing(index_elements=["name"]), new)
            known = _rows(conn, names)
        return known

    return db.write(work)


def read(db: Database, names: Iterable[str]) -> dict[str, Run]:
    """The rows of these schedules that exist (none for a schedule no sweeper saw yet)."""
    return db.read(lambda conn: _rows(conn, sorted(names)))


def _rows(conn: Connection, names: list[str]) -> dict[str, Run]:
    query = sa.select(runs).where(runs.c.name.in_(names))
    return {
        r.name: Run(float(r.first_seen), r.last_at, r.last_task_id)
        for r in conn.execute(query).all()
    }


def _enqueue(s: Sweep, schedule: ScheduleConfig, at: float) -> int | None:
    """Enqueue the occurrence ``at`` and move ``last_at`` to it, in one transaction; the
    new task's id, or None when another sweeper enqueued it first."""

    def work(conn: Connection) -> int | None:
        (done,) = s.queue.enqueue_on(conn, [spec(schedule, at=at)])
        _move_on(conn, schedule.name, at, done.id)
        return done.id if done.created else None

    return s.db.write(work)


def _move(db: Database, name: str, at: float, task_id: int | None) -> bool:
    return db.write(lambda conn: _move_on(conn, name, at, task_id))


def _move_on(conn: Connection, name: str, at: float, task_id: int | None) -> bool:
    """``last_at`` to ``at`` where it is earlier (guarded: never backwards)."""
    values: Mapping[str, Any] = {"last_at": at}
    if task_id is not None:
        values = {**values, "last_task_id": task_id}
    moved = conn.execute(
        sa.update(runs)
        .where(runs.c.name == name, sa.or_(runs.c.last_at.is_(None), runs.c.last_at < at))
        .values(**values)
    )
    return moved.rowcount == 1
