"""Real ``worker`` processes, for scripts/bench.py: drains of no-op tasks (rate, peak
RSS, the workers' CPU per task) and an idle worker's RSS beside the floor of the
libraries it imports."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import uuid
from pathlib import Path

import measure
import turns

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec


def worker_drain(
    url: str, synchronous: str, processes: int, tasks: int, batch: int, analyze: bool = False
) -> measure.Figures:
    """``processes`` real ``worker --drain --batch B`` processes over ``tasks`` no-op tasks
    (none: how much a worker with nothing to do spends), timed from spawn to exit. With
    ``analyze`` the tasks table's statistics are taken once the tasks are queued, as a
    database in service has them (a fresh one has none, and plans by default guesses)."""
    exe = str(Path(sys.executable).with_name("worker"))
    return _drain([exe], url, synchronous, processes, tasks, batch, analyze)


def worker_turns(url: str, synchronous: str, processes: int, tasks: int) -> str:
    """SQLite: ``processes`` ``worker --drain`` commands over ``tasks`` no-op tasks, one at
    a time, with their writers' turns timed in place (``turns.py`` run as a script: the
    command in a process of its own with a ``TurnClock`` around it): their rate, and
    their turns as ``turns.figures`` shows them."""
    with tempfile.TemporaryDirectory() as out:
        wrapped = [sys.executable, str(Path(turns.__file__)), out]
        run = _drain(wrapped, url, synchronous, processes, tasks, 1)
        records = [json.loads(p.read_text()) for p in Path(out).glob("*.json")]
    assert len(records) == processes, records
    taken, held, committing = (sum(r[k] for r in records) for k in turns.TOTALS)
    return f"{run.drain:,.0f} tasks/s; {turns.figures(taken, held, committing)}"


def _drain(
    command: list[str],
    url: str,
    synchronous: str,
    processes: int,
    tasks: int,
    batch: int,
    analyze: bool = False,
) -> measure.Figures:
    agent = f"wbench{uuid.uuid4().hex[:6]}"
    db = Database(url, sqlite_synchronous=synchronous)
    queue = TaskQueue(db)
    for start in range(0, tasks, 500):
        queue.enqueue_many(
            [
                TaskSpec(agent=agent, command=f"task {i}", models=("sim/noop",))
                for i in range(start, min(tasks, start + 500))
            ]
        )
    if analyze:
        db.write(lambda conn: conn.exec_driver_sql("ANALYZE bus_commands"))
    db.dispose()
    env = {**os.environ, "AGENTBUS_SQLITE_SYNCHRONOUS": synchronous}
    argv = [*command, "--agent", agent, "--db", url, "--drain", "--batch", str(batch)]
    return measure.consume(argv, processes, max(tasks, 1), env=env)


def bench_workers(url: str, synchronous: str, tasks: int) -> list[tuple[str, str]]:
    """Real worker processes over no-op simulated tasks: one worker, then two, one task at
    a time; two in batches of 10. Their CPU per task with their start-up, and without
    it (what a worker that finds nothing to do spends, taken off once per process), and
    the whole machine's (``measure.machine_bound``)."""
    started = worker_drain(url, synchronous, 1, 0, 1).cpu_ms  # per process, in ms
    sqlite = url.startswith("sqlite")
    rows, peak = [], 0.0
    # Each 2-process drain again with the tasks table's statistics taken, as in service:
    # the planner then knows how many tasks are queued (a fresh database has none).
    runs = ((1, 1, False), (2, 1, False), (2, 1, True), (2, 10, False), (2, 10, True))
    for processes, batch, analyze in runs:
        run = worker_drain(url, synchronous, processes, tasks, batch, analyze)
        peak = max(peak, run.rss_mib)
        start_up = processes * started / tasks
        label = f"worker processes, {processes} x drain {tasks:,} tasks, batch {batch}"
        if analyze:
            label += ", the table's statistics taken with them queued"
        figures = f"{run.drain:,.0f} tasks/s, {run.cpu_ms:.2f} ms CPU per task " + (
            f"({run.cpu_ms - start_up:.2f} without the start-up)"
            # Over a short drain the start-up is most of it, and what taking it off
            # leaves is mostly the start-ups' difference from one run to the next.
            if start_up < run.cpu_ms / 2
            else "(the start-up most of it: too few tasks to take it off)"
        )
        server = None if sqlite else run.server_ms
        rows.append((label, measure.joined(figures, measure.machine_bound(run.machine_ms, server))))
        if batch == 1 and sqlite and not analyze:  # what bounds it: its own turns, one a task
            timed = worker_turns(url, synchronous, processes, tasks)
            rows.append((f"{label}, turns timed in place", timed))
    rows.append(("worker RSS, peak", f"{peak:,.1f} MiB"))
    rows.append(("worker start-up and exit with nothing to do, CPU", f"{started:,.0f} ms"))
    return rows + bench_memory(url, synchronous)


def bench_memory(url: str, synchronous: str) -> list[tuple[str, str]]:
    """An idle worker's RSS (up, its first claim found nothing, waiting), beside the RSS
    of an interpreter that imports only the libraries a worker cannot do without
    (SQLAlchemy and the database's driver): the floor under any worker of ours."""
    agent = f"idle{uuid.uuid4().hex[:6]}"
    db = Database(url, sqlite_synchronous=synchronous)
    env = {**os.environ, "AGENTBUS_SQLITE_SYNCHRONOUS": synchronous}
    argv = [str(Path(sys.executable).with_name("worker")), "--agent", agent, "--db", url]
    try:
        idle = measure.idle_rss_kib(argv, env, lambda: agent in reads.live_agents(db))
    finally:
        db.dispose()
    driver = (
        ["sqlite3", "sqlalchemy.dialects.sqlite"]
        if db.dialect == "sqlite"
        else ["psycopg", "sqlalchemy.dialects.postgresql.psycopg"]
    )
    # SQLAlchemy and psycopg imported as our processes import them (agentbus.lean_imports:
    # without ssl).
    lean = "from agentbus.lean_imports import import_sqlalchemy; import_sqlalchemy()"
    if db.dialect == "postgresql":
        lean += "; from agentbus.lean_imports import import_psycopg; import_psycopg()"
    floor = measure.import_floor_kib(["sqlalchemy", *driver], first=lean)
    return [
        ("worker RSS, idle", f"{idle / 1024:,.1f} MiB ({idle * 1024 / 1e6:,.1f} MB)"),
        (
            "RSS of the interpreter importing SQLAlchemy and the driver alone",
            f"{floor / 1024:,.1f} MiB ({floor * 1024 / 1e6:,.1f} MB)",
        ),
    ]
