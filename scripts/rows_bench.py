#!/usr/bin/env python3
"""Claim, enqueue and retention on a large table, against the same on a small one.

    python scripts/bench.py rows                                 # both backends, full size
    python scripts/bench.py rows --backends sqlite --tasks 100000 --events 500000

The data is built with SQL (``generate_series`` on PostgreSQL, a recursive CTE on
SQLite), never through the API: ``--tasks`` rows of ``bus_commands`` (PostgreSQL 10 M,
SQLite 1 M by default) of which ``--queued`` are queued and ``--paused`` paused over 40
agents, the rest done (9 in 10) and failed, finished over the last 30 days; and
``--events`` rows of ``task_events`` (50 M, 5 M), five for each task from the first.
The small table is the same shape at 10,000 tasks (2,500 queued, 1,000 paused, 50,000
events), finished at the same rate: the same fleet with less history (the last hour,
which the status document and /metrics read, as busy in both). Both are ANALYZEd, as
autovacuum would have them.

Measured on each:
- claim latency: ``--claims`` claims of one task, each acknowledging the one before
  (a worker's settle-and-claim), round the agents; p50, p99 and the longest;
- enqueue rate: ``--enqueues`` single enqueues, one transaction each;
- what operators read, and the sweeper's pass, on each (``growth_bench``): each path's
  median and its ratio to the small table's, against its target;
- on the large table, one retention pass (``retention.prune``: done tasks older than
  7 days, failed older than 30, in batches of 500, at most 100 batches) while claims run
  beside it: how long the pass took, what it deleted, and the longest claim meanwhile
  (the target: at most 100 ms).

The database is dropped (PostgreSQL) or deleted (SQLite) at the end. Check ``df`` first:
at full size PostgreSQL needs about 15 GB.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from typing import Any

import sqlalchemy as sa
from growth_bench import operator_paths
from growth_bench import table as paths_table
from measure import agentbus_database

from agentbus.db import Database
from agentbus.migrations import migrate
from agentbus.queue import Settlement, TaskQueue, retention
from agentbus.queue.decisions import Complete
from agentbus.queue.tasks import TaskSpec

AGENTS = 40
DAY = 86400.0
DONE_KEEP, FAILED_KEEP = 7 * DAY, 30 * DAY  # the retention settings' defaults

#: The tasks: finished ones first (ids 1 … finished), then paused, then queued.
#: ``:now`` is the build's time; finished tasks spread over the 30 days before it.
TASKS_SQL = """
INSERT INTO bus_commands (agent, command, models, status, priority, run_after, attempts,
    max_attempts, claim_token, pause_count, resume_count, reentry_count, rescue_count,
    created_at, updated_at, result, resume_after, paused_at, first_paused_at)
SELECT 'agent' || (g % {agents}), 'task ' || g, '["sim/noop"]',
    CASE WHEN g <= {finished} THEN CASE WHEN g % 10 = 0 THEN 'failed' ELSE 'done' END
         WHEN g <= {finished} + {paused} THEN 'paused' ELSE 'queued' END,
    0, {now} - {span} * ({tasks} - g) / {tasks}, 1, 3, 1, 0, 0, 0, 0,
    {now} - {span} * ({tasks} - g) / {tasks},
    {now} - {span} * ({tasks} - g) / {tasks},
    CASE WHEN g <= {finished} THEN 'ok' END,
    CASE WHEN g > {finished} AND g <= {finished} + {paused} THEN {now} + 3600 END,
    CASE WHEN g > {finished} AND g <= {finished} + {paused} THEN {now} END,
    CASE WHEN g > {finished} AND g <= {finished} + {paused} THEN {now} END
FROM {series}
"""

#: Five events a task, from task 1 on: enqueued, claimed, and the end, twice over.
EVENTS_SQL = """
INSERT INTO task_events (task_id, from_status, to_status, reason, worker, claim_token, at)
SELECT g / 5 + 1, CASE WHEN g % 5 = 0 THEN NULL ELSE 'queued' END,
    CASE WHEN g % 5 = 0 THEN 'queued' WHEN g % 5 = 4 THEN 'done' ELSE 'claimed' END,
    'built', 'w', 1, {now} - {span} * ({tasks} - g / 5) / {tasks}
FROM {series}
"""


def series(dialect: str, first: int, last: int) -> str:
    """SQL rows ``g`` = ``first`` … ``last``."""
    if dialect == "postgresql":
        return f"generate_series({first}, {last}) AS g"
    recursive = f"SELECT {first} UNION ALL SELECT g + 1 FROM s WHERE g < {last}"
    return f"(WITH RECURSIVE s(g) AS ({recursive}) SELECT g FROM s) AS numbers"


def build(
    db: Database, tasks: int, events: int, queued: int, paused: int, span: float = 30 * DAY
) -> float:
    """Fill the tables, the tasks finished over the ``span`` seconds before now; returns
    the seconds it took."""
    began = time.perf_counter()
    now = time.time()
    shape = {"agents": AGENTS, "tasks": tasks, "paused": paused, "now": now, "span": span}
    sql_tasks = TASKS_SQL.format(
        **shape, finished=tasks - queued - paused, series=series(db.dialect, 1, tasks)
    )
    sql_events = EVENTS_SQL.format(**shape, series=series(db.dialect, 0, events - 1))
    db.write(lambda conn: conn.execute(sa.text(sql_tasks)))  # text(): its % escaped
    db.write(lambda conn: conn.execute(sa.text(sql_events)))
    db.write(lambda conn: conn.exec_driver_sql("ANALYZE"))
    return time.perf_counter() - began


def claims(queue: TaskQueue, n: int, offset: int = 0) -> list[float]:
    """``n`` claims of one task each, acknowledging the one before; their latencies."""
    took = []
    acks: list[Settlement] = []
    for i in range(n):
        agent = f"agent{(i + offset) % AGENTS}"
        started = time.perf_counter()
        _, got = queue.settle_and_claim(acks, agent, "bench", 60, 1)
        took.append(time.perf_counter() - started)
        acks = [Settlement(t.id, t.claim_token, Complete("ok")) for t in got]
    queue.settle_and_claim(acks, "agent0", "bench", 60, 0)
    return took


def enqueues(queue: TaskQueue, n: int) -> float:
    spec = TaskSpec(agent="fresh", command="x", models=("sim/noop",))
    started = time.perf_counter()
    for _ in range(n):
        queue.enqueue(spec)
    return n / (time.perf_counter() - started)


def quantiles(took: list[float]) -> tuple[float, float, float]:
    ordered = sorted(took)
    p = lambda q: ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000  # noqa: E731
    return p(0.5), p(0.99), ordered[-1] * 1000


def retention_beside_claims(
    db: Database, queue: TaskQueue, batch: int
) -> tuple[float, int, list[float]]:
    """One retention pass in a thread; claims meanwhile. The pass's seconds, the tasks it
    deleted, and the claims' latencies while it ran."""
    result: dict[str, float] = {}

    def prune() -> None:
        began = time.perf_counter()
        result["gone"] = retention.prune(
            db, time.time(), done_sec=DONE_KEEP, failed_sec=FAILED_KEEP, batch=batch
        )
        result["secs"] = time.perf_counter() - began

    thread = threading.Thread(target=prune)
    took: list[float] = []
    thread.start()
    i = 0
    while thread.is_alive():
        took += claims(queue, 10, offset=i)
        i += 10
    thread.join()
    return result["secs"], int(result["gone"]), took


def drain_windows(db: Database, queue: TaskQueue, n: int, scale: float | None) -> str:
    """``n`` claims and completions in a row, as a worker's, the claim's p99 per fifth of
    them: what the dead entries a drain leaves in the queued tasks' index cost while
    autovacuum lets them be (its default: when a fifth of the table changed), or with the
    table's ``autovacuum_vacuum_scale_factor`` set to ``scale`` (PostgreSQL)."""
    if scale is not None and db.dialect == "postgresql":
        db.write(
            lambda conn: conn.exec_driver_sql(
                f"ALTER TABLE bus_commands SET (autovacuum_vacuum_scale_factor = {scale})"
            )
        )
    fifth = max(n // 5, 1)
    p99s = []
    for k in range(5):
        _, p99, _ = quantiles(claims(queue, fifth, offset=k * fifth))
        p99s.append(f"{p99:.2f}")
    said = "default" if scale is None else f"scale factor {scale}"
    return f"claim p99 per {fifth:,} claims, autovacuum {said}: {' / '.join(p99s)} ms"


def measure(
    backend: str, tasks: int, events: int, args: argparse.Namespace, span: float = 30 * DAY
) -> dict[str, Any]:
    """One table's figures."""
    big = tasks > 10_000
    queued = args.queued if big else 2_500
    paused = args.paused if big else 1_000
    out: dict[str, Any] = {}
    with agentbus_database(backend) as url:
        db = Database(url)
        migrate(db)
        secs = build(db, tasks, events, queued, paused, span)
        out["build"] = f"{secs:,.0f} s"
        if args.paths:
            out["paths"] = operator_paths(url)
        if args.paths_only:
            db.dispose()
            return out
        queue = TaskQueue(db)
        claims(queue, 50)  # warm
        p50, p99, most = quantiles(claims(queue, args.claims, offset=50))
        out["claim"] = f"p50 {p50:.2f} ms, p99 {p99:.2f} ms, max {most:.1f} ms"
        out["enqueue"] = f"{enqueues(queue, args.enqueues):,.0f} /s"
        if big and args.drain:
            out["drain"] = drain_windows(db, queue, args.drain, args.vacuum_scale)
        if big:
            pass_secs, gone, took = retention_beside_claims(db, queue, args.retention_batch)
            _, p99, most = quantiles(took)
            verdict = "met" if most <= 100 else "NOT met"
            out["retention"] = (
                f"{gone:,} tasks in {pass_secs:,.1f} s; {len(took):,} claims meanwhile, "
                f"p99 {p99:.1f} ms, longest {most:.1f} ms (target 100 ms: {verdict})"
            )
        db.dispose()
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench.py rows", description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="postgresql,sqlite")
    p.add_argument("--tasks", type=int, help="default: 10 M PostgreSQL, 1 M SQLite")
    p.add_argument("--events", type=int, help="default: 5 a task")
    p.add_argument("--queued", type=int, default=100_000)
    p.add_argument("--paused", type=int, default=100_000)
    p.add_argument("--claims", type=int, default=2_000)
    p.add_argument("--enqueues", type=int, default=2_000)
    p.add_argument("--retention-batch", type=int, default=500, help="sweep_batch: 500")
    p.add_argument("--drain", type=int, default=0, help="claims in a row on the large table")
    p.add_argument("--vacuum-scale", type=float, help="bus_commands' autovacuum scale factor")
    p.add_argument(
        "--no-paths", dest="paths", action="store_false", help="skip what operators read"
    )
    p.add_argument("--paths-only", action="store_true", help="only what operators read")
    args = p.parse_args(argv)
    for backend in args.backends.split(","):
        tasks = args.tasks or (10_000_000 if backend == "postgresql" else 1_000_000)
        events = args.events or tasks * 5
        # The small table is the same fleet younger: its tasks came at the large one's
        # rate (the last hour as busy), so only the history differs.
        small = measure(backend, 10_000, 50_000, args, span=30 * DAY * 10_000 / tasks)
        large = measure(backend, tasks, events, args)
        for key in ("build", "claim", "enqueue"):
            if key in large:
                print(f"{backend}, {key}: 10,000 tasks {small[key]}; {tasks:,} tasks {large[key]}")
        if "drain" in large:
            print(f"{backend}, {args.drain:,} claims in a row: {large['drain']}")
        if "retention" in large:
            print(f"{backend}, retention pass at {tasks:,} tasks: {large['retention']}")
        if "paths" in large:
            print(f"{backend}, what operators read (median ms):")
            print("\n".join(paths_table(small["paths"], large["paths"], f"{tasks:,}")))
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
