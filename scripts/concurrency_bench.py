#!/usr/bin/env python3
"""Many model calls from one worker process (``--concurrency N``), against N processes.

T tasks whose call waits ``latency`` (the simulated provider sleeps, as a call
waits on the network) are drained by one ``worker --drain --concurrency N``
for each N, and by P single-slot processes for comparison. For each run:
wall time from spawn to exit (start-up included), tasks per second, and the
share of the best possible wall time — every call in a full round of N, so
ceil(T / N) rounds of ``latency`` — peak RSS of the process (of all of them,
for P processes)
and the peak number of database connections held (PostgreSQL: backends of the
database; SQLite: the processes' open handles on the database file).

    python scripts/concurrency_bench.py                     # SQLite, 200 tasks of 2 s
    python scripts/concurrency_bench.py --backend postgresql --levels 16,64
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import measure
import psycopg
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec

HEADERS = ["run", "wall", "tasks/s", "of the best possible", "peak RSS", "connections"]


def run(url: str, tasks: int, latency_ms: int, concurrency: int, processes: int) -> list[str]:
    """One drain: ``processes`` workers of ``concurrency`` slots each over ``tasks`` tasks."""
    agent = f"conc{uuid.uuid4().hex[:6]}"
    db = Database(url)
    script = {"simulate": {"sim/a": {"latency_ms": latency_ms}}}
    TaskQueue(db).enqueue_many(
        [
            TaskSpec(agent=agent, command=f"task {i}", models=("sim/a",), payload=script)
            for i in range(tasks)
        ]
    )
    db.dispose()
    exe = str(Path(sys.executable).with_name("worker"))
    argv = [exe, "--agent", agent, "--db", url, "--drain", "--concurrency", str(concurrency)]
    began = time.perf_counter()
    procs = [subprocess.Popen(argv, stderr=subprocess.DEVNULL) for _ in range(processes)]
    peak_kib = peak_conns = 0
    while any(p.poll() is None for p in procs):
        peak_kib = max(peak_kib, sum(measure.rss_kib(p.pid) for p in procs))
        peak_conns = max(peak_conns, connections(url, [p.pid for p in procs]))
        time.sleep(0.05)
    wall = time.perf_counter() - began
    if any(p.returncode for p in procs):
        raise RuntimeError("a worker failed")
    in_flight = concurrency * processes
    best = math.ceil(tasks / in_flight) * latency_ms / 1000  # every call in a full round
    label = (
        f"1 process, --concurrency {concurrency}"
        if processes == 1
        else f"{processes} processes, --concurrency {concurrency}"
    )
    return [
        label,
        f"{wall:,.1f} s",
        f"{tasks / wall:,.1f}",
        f"{best / wall:.0%} ({best:g} s)",
        f"{peak_kib / 1024:,.1f} MiB",
        str(peak_conns),
    ]


def connections(url: str, pids: list[int]) -> int:
    """Database connections held now by ``pids`` (PostgreSQL: the database's backends
    but this one; SQLite: open handles on the database file)."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        path = os.path.realpath(str(parsed.database))
        count = 0
        for pid in pids:
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                with contextlib.suppress(OSError):  # closed meanwhile
                    count += os.readlink(f"/proc/{pid}/fd/{fd}") == path
        return count
    conninfo = parsed.set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
    return int(row[0]) if row else 0


def rows(
    url: str, tasks: int, latency_ms: int, levels: list[int], processes: int
) -> list[list[str]]:
    out = [run(url, tasks, latency_ms, n, 1) for n in levels]
    if processes:
        out.append(run(url, tasks, latency_ms, 1, processes))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="sqlite", choices=["sqlite", "postgresql"])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--latency-ms", type=int, default=2000)
    parser.add_argument("--levels", default="1,16,64", help="--concurrency of the one process")
    parser.add_argument("--processes", type=int, default=16, help="single-slot processes")
    args = parser.parse_args()
    import bench

    with bench.database(args.backend, "FULL") as url:
        table = rows(
            url,
            args.tasks,
            args.latency_ms,
            [int(n) for n in args.levels.split(",")],
            args.processes,
        )
    print(f"# {args.backend}: {args.tasks} tasks, each call {args.latency_ms} ms")
    bench.print_table(HEADERS, [tuple(r) for r in table])


if __name__ == "__main__":
    main()
