#!/usr/bin/env python3
"""agentbus benchmark: prints a table of figures; asserts nothing.

Workload (per backend):
- enqueue, single: N calls of ``TaskQueue.enqueue`` (one transaction each); on
  SQLite also the same calls with each ``TaskSpec`` made, so validated, before
  the clock starts: what the task's validation costs in place; and the writers'
  turn each enqueue held, timed in place (scripts/turns.py).
- enqueue, batch: ``TaskQueue.enqueue_many`` in batches of 500.
- cooldown check: ``CooldownStore.cooling`` of a 3-model chain with 50 active
  cooldowns, through the 1 s cache and with no cache (one read each time).
- admission: ``Admission.admit`` + ``finish`` of one candidate, N times, with
  every gate configured (global, provider and bulkhead concurrency, rpm, agent
  rate, daily token and cost budget, circuit: one transaction each way) and
  with none (cached reads only).
- worker processes: 1, then 2 real ``worker --drain`` processes run T/2
  simulated no-op tasks one at a time (claim, call, complete: one transaction
  a task), then 2 in batches of 10, measured from spawn to exit; their CPU per
  task with their start-up and, over a drain long enough for the start-up not to
  be most of it, without it; peak RSS of one worker
  (scripts/worker_bench.py). On SQLite each batch-1 drain runs again with the
  workers' own writers' turns timed in place (scripts/turns.py run as a script):
  the rate beside 1 / the mean turn, the most any worker taking those turns
  could settle. Each 2-process drain runs again with the tasks table's
  statistics taken once its tasks are queued (``ANALYZE``, as autovacuum does in
  service; the fresh database of the other rows has none).
- memory: one idle worker's RSS (up, nothing to claim), and the RSS of an
  interpreter that only imports SQLAlchemy and the database's driver.
- sweeper resume pass: N paused tasks (1 % due) inserted directly; one
  ``jobs.resume`` pass, timed.
- resume latency: a worker pauses 20 tasks on a 2 s cooldown; a sweeper
  service resumes them; resume event time minus the pause's resume_after.
- enqueue-to-claim latency: one idle worker (default poll_sec); 20 tasks
  enqueued 0.2-1.5 s apart; claim event time minus enqueue event time.
- settle-to-wait latency: ``AgentBus.wait`` on a task that another connection
  completes; the wait's return minus the completion's commit (scripts/latency.py).
- steady state per task: statements, round trips and commits of a worker's
  settle-and-claim, counted where the database sees them (scripts/counting.py).
- claim+complete: T no-op tasks are enqueued first; then P processes
  (spawned, connected and warmed up before the clock starts) claim and
  complete through ``settle_and_claim`` until the queue is empty, each
  completion with the routing row of its call: a worker's write set, with no
  worker around it. ``batch`` is how many tasks one claim takes; a claim's
  completions ride in the next claim's transaction, as a worker's do.
  The rate is T divided by the time from "go" to the last process finishing;
  the CPU is the processes' own (user + system) per task. Bounds on any worker
  with this write set: the machine's busy CPU per task (server and kernel too)
  against its cores; on SQLite the writers' turns, timed in place (one writer
  commits at a time: B / the mean turn; scripts/turns.py). Once more with 2T
  tasks of the agent queued a day ahead (the due ones must not wait on them).

- many calls from one process: 200 tasks whose call takes 2 s, drained by one
  worker with --concurrency 1, 16 and 64, and by 16 single-slot workers: wall
  time against the best possible, peak RSS, connections held
  (scripts/concurrency_bench.py).

- through a transaction pooler (``--backends pgbouncer``): a PgBouncer of the
  run's own in front of the server; 2 ``worker --drain`` processes at batch 1
  and 10, directly and through it, alternated, best of 2 each; the
  enqueue-to-claim latency above through it, polling and with a direct
  ``listen_url``; the statements an idle worker sends through it a second, from
  PgBouncer's SHOW STATS (scripts/pooler_bench.py).

- start-up: each console command run 10 times from exec to exit (--help,
  --version, an enqueue and a status on SQLite); median and max.

Durability: SQLite in WAL mode with synchronous=FULL (every commit survives
power loss) unless --sqlite-synchronous says otherwise; Postgres with its
defaults (fsync on, synchronous_commit on).

    python scripts/bench.py                       # both backends, and the comparison
    python scripts/bench.py --backends sqlite --tasks 2000 --compare-tasks 0
    python scripts/bench.py fleet --workers 200 --tasks 20000   # scripts/fleet.py
    python scripts/bench.py rows                    # 10 M rows: scripts/rows_bench.py
    python scripts/bench.py rows --paths-only       # what operators read: growth_bench.py
    python scripts/bench.py tokens --ranks o200k_base.json  # token estimates: token_bench.py
    python scripts/bench.py shares --backend postgresql     # fair shares: share_bench.py

With ``pip install -e .[bench]`` the same no-op drain also runs through huey
(SQLite), procrastinate and pgqueuer (PostgreSQL); see scripts/compare.py for
the exact workload. Our figure is printed as a ratio to each.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.synchronize import Event

import compare
import concurrency_bench
import counting
import fleet
import latency
import measure
import pooler_bench
import psycopg
import rows_bench
import share_bench
import sqlalchemy as sa
import startup
import token_bench
import turns
from admission_bench import bench_admission, bench_fleet_admission, bench_mcp, bench_permits
from processes import together
from worker_bench import bench_workers

from agentbus.admission.cooldowns import CooldownStore
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.logging import configure
from agentbus.migrations import migrate
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands
from agentbus.sweeper import jobs

PG_URL = os.environ.get(
    "AGENTBUS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@contextmanager
def database(backend: str, synchronous: str) -> Iterator[str]:
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            url = f"sqlite:///{tmp}/bench.db"
            db = Database(url, sqlite_synchronous=synchronous)
            migrate(db)
            db.dispose()
            yield url
        return
    name = f"agentbus_bench_{uuid.uuid4().hex[:8]}"
    admin = sa.make_url(PG_URL).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    url = sa.make_url(PG_URL).set(database=name).render_as_string(False)
    try:
        db = Database(url)
        migrate(db)
        db.dispose()
        if backend != "pgbouncer":
            yield url
            return
        bouncer = pooler_bench.start(PG_URL)
        try:
            yield bouncer.url(name)  # ?pooler=transaction
        finally:
            bouncer.stop()
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def spec(i: int, agent: str = "bench") -> TaskSpec:
    return TaskSpec(agent=agent, command=f"task {i}", models=("sim/noop",))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drain(
    url: str, synchronous: str, agent: str, batch: int, ready: Event, go: Event
) -> tuple[
    int, float, tuple[int, float, float], tuple[float, float], tuple[measure.Spent, measure.Spent]
]:
    """Claim and complete until the queue is empty, each completion with the routing row
    of its call (a worker's write set); returns (tasks completed, CPU seconds spent,
    the writers' turns taken on SQLite: ``TurnClock.totals``, the machine's busy CPU
    seconds at the start and at the end: ``measure.machine_busy``, and the PostgreSQL
    server's processes' at the start and at the end, its connection still open:
    ``measure.server_cpu``)."""
    db = Database(url, sqlite_synchronous=synchronous)
    queue = TaskQueue(db)
    queue.claim("nobody", "warmup", 1)  # connect and compile before the clock starts
    ready.set()
    go.wait()
    busy, server, cpu = measure.machine_busy(), measure.server_cpu(), time.process_time()
    with turns.TurnClock() as clock:
        done = counting.steady_loop(queue, agent, f"w{os.getpid()}", batch)
    cpu = time.process_time() - cpu
    machine_spent = (busy, measure.machine_busy())
    server_spent = (server, measure.server_cpu())  # read before its connection closes
    db.dispose()
    return done, cpu, clock.totals(), machine_spent, server_spent


def throughput(
    url: str, synchronous: str, processes: int, batch: int, tasks: int, ahead: int = 0
) -> tuple[float, float, str]:
    """Tasks per second, the processes' CPU milliseconds per task (theirs alone: on
    PostgreSQL the server's is not counted, as in the workers' figures) and what bounds
    the rate: the whole machine's busy CPU per task (the processes, the database
    server, the kernel's work for them; on PostgreSQL with the server's processes'
    share of it, when they run here) against its cores and, on SQLite, their
    writers' turns (``turns.figures``); with ``ahead`` tasks of the agent queued a day
    ahead first (they stay queued)."""
    db = Database(url, sqlite_synchronous=synchronous)
    agent = f"drain{uuid.uuid4().hex[:6]}"
    queue = TaskQueue(db)
    later = [TaskSpec(agent=agent, command="later", models=("sim/noop",), delay_sec=86400)]
    for start in range(0, ahead, 500):
        queue.enqueue_many(later * min(500, ahead - start))
    for start in range(0, tasks, 500):
        queue.enqueue_many([spec(i, agent) for i in range(start, min(tasks, start + 500))])
    db.dispose()
    results, elapsed = together(processes, drain, lambda n: (url, synchronous, agent, batch))
    done, cpu = sum(r[0] for r in results), sum(r[1] for r in results)
    assert done == tasks, (done, tasks)
    taken = [sum(r[2][i] for r in results) for i in range(3)]
    busy = max(r[3][1] for r in results) - min(r[3][0] for r in results)
    server = measure.server_spent_over([r[4] for r in results]) if db.dialect != "sqlite" else None
    bounds = measure.joined(
        measure.machine_bound(
            busy / tasks * 1000, None if server is None else server / tasks * 1000
        ),
        turns.figures(int(taken[0]), *taken[1:], batch),
    )
    return tasks / elapsed, cpu / tasks * 1000, bounds


def bench_enqueue(queue: TaskQueue, single: int, batched: int) -> list[tuple[str, str]]:
    with turns.TurnClock() as clock:
        secs = timed(lambda: [queue.enqueue(spec(i)) for i in range(single)])
    turned = turns.figures(*clock.totals())
    rows = [("enqueue, single", measure.joined(f"{single / secs:,.0f} tasks/s", turned))]
    if queue.db.dialect == "sqlite":
        made = [spec(i) for i in range(single)]  # each validated here, off the clock
        secs = timed(lambda: [queue.enqueue(s) for s in made])
        label = "enqueue, single, each task made and validated ahead"
        rows.append((label, f"{single / secs:,.0f} tasks/s"))
    secs = timed(
        lambda: [
            queue.enqueue_many([spec(i) for i in range(s, s + 500)]) for s in range(0, batched, 500)
        ]
    )
    rows.append(("enqueue, batch of 500", f"{batched / secs:,.0f} tasks/s"))
    return rows


def bench_cooldowns(db: Database) -> list[tuple[str, str]]:
    """Eligibility check of a 3-model chain against 50 active cooldowns."""
    writer = CooldownStore(db)
    for i in range(50):
        writer.set(f"sim/m{i}", time.time() + 3600, reason="bench")
    chain = ["sim/m1", "sim/free", "sim/m7"]
    rows = []
    for label, ttl, n in (("cached (1 s TTL)", 1.0, 20_000), ("uncached", 1e-9, 2_000)):
        store = CooldownStore(db, cache_sec=ttl)
        store.cooling(chain)
        secs = timed(lambda store=store, n=n: [store.cooling(chain) for _ in range(n)])
        rows.append((f"cooldown check, {label}", f"{secs / n * 1e6:,.1f} µs"))
    return rows


def bench_sweeper(url: str, synchronous: str, sizes: list[int]) -> list[tuple[str, str]]:
    """One resume pass over N paused tasks of which 1 % are due."""
    rows = []
    for n in sizes:
        db = Database(url, sqlite_synchronous=synchronous)
        now = time.time()
        agent = f"sweep{n}"
        paused = [
            {
                "agent": agent,
                "command": "x",
                "models": ["sim/a"],
                "status": "paused",
                "priority": 0,
                "run_after": now,
                "attempts": 0,
                "max_attempts": 3,
                "claim_token": 1,
                "pause_count": 1,
                "resume_count": 0,
                "reentry_count": 0,
                "rescue_count": 0,
                "created_at": now,
                "updated_at": now,
                "paused_at": now,
                "first_paused_at": now,
                "resume_after": now - 1 if i % 100 == 0 else now + 3600,
            }
            for i in range(n)
        ]
        for start in range(0, n, 5000):
            db.write(
                lambda conn, chunk=paused[start : start + 5000]: conn.execute(
                    sa.insert(bus_commands), chunk
                )
            )
        sweep = jobs.Sweep(db, LiveConfig.fixed(Settings()))
        started = time.perf_counter()
        counts = jobs.resume(sweep)
        secs = time.perf_counter() - started
        rows.append(
            (
                f"sweeper resume pass, {n:,} paused / {counts['resumed']:,} due",
                f"{secs * 1000:,.0f} ms",
            )
        )
        db.write(
            lambda conn, agent=agent: conn.execute(
                sa.delete(bus_commands).where(bus_commands.c.agent == agent)
            )
        )
        db.dispose()
    return rows


def bench_backend(url: str, args: argparse.Namespace) -> list[tuple[str, str]]:
    db = Database(url, sqlite_synchronous=args.sqlite_synchronous)
    rows = bench_enqueue(TaskQueue(db), args.single, args.tasks * 2)
    rows += bench_cooldowns(db)
    rows += bench_admission(db, args.admissions)
    rows += bench_permits(db, args.admissions)
    db.dispose()
    rows += bench_mcp(url, args.admissions)
    rows += bench_workers(url, args.sqlite_synchronous, args.tasks // 2)
    rows += bench_sweeper(url, args.sqlite_synchronous, [int(n) for n in args.paused.split(",")])
    rows += latency.resume(url, args.sqlite_synchronous, args.latency_tasks)
    rows += latency.wakeup(url, args.sqlite_synchronous, args.latency_tasks)
    rows += latency.wait(url, args.sqlite_synchronous, args.latency_tasks)
    rows += bench_fleet_admission(url)
    rows += counting.rows(url)
    if args.concurrency_tasks:
        levels = [int(n) for n in args.concurrency_levels.split(",")]
        for label, *figures in concurrency_bench.rows(
            url, args.concurrency_tasks, 2000, levels, 16
        ):
            measure_ = f"{args.concurrency_tasks} calls of 2 s: {label}"
            figure = "wall {}, {} tasks/s, {} of the best possible, RSS {}, {} connections"
            rows.append((measure_, figure.format(*figures)))
    for batch in (int(b) for b in args.batches.split(",")):
        for procs in (int(p) for p in args.processes.split(",")):
            rate, cpu, bounds = throughput(url, args.sqlite_synchronous, procs, batch, args.tasks)
            rows.append(
                (
                    f"claim+complete, {procs} proc, batch {batch}",
                    measure.joined(f"{rate:,.0f} tasks/s, {cpu:.2f} ms CPU per task", bounds),
                )
            )
    ahead = 2 * args.tasks
    rate, cpu, _ = throughput(url, args.sqlite_synchronous, 1, 1, args.tasks, ahead)
    rows.append(
        (
            f"claim+complete, 1 proc, batch 1, {ahead:,} tasks queued a day ahead",
            f"{rate:,.0f} tasks/s, {cpu:.2f} ms CPU per task",
        )
    )
    return rows


def main() -> None:
    if sys.argv[1:2] == ["fleet"]:  # a fleet on PostgreSQL through PgBouncer: fleet.py
        sys.exit(fleet.main(sys.argv[2:]))
    if sys.argv[1:2] == ["rows"]:  # claim and retention on millions of rows: rows_bench.py
        sys.exit(rows_bench.main(sys.argv[2:]))
    if sys.argv[1:2] == ["tokens"]:  # the token estimate's error: token_bench.py
        sys.exit(token_bench.main(sys.argv[2:]))
    if sys.argv[1:2] == ["shares"]:  # fair shares under a flood: share_bench.py
        sys.exit(share_bench.main(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backends",
        default="sqlite,postgresql",
        help="of sqlite, postgresql, pgbouncer (what a transaction pooler costs)",
    )
    parser.add_argument(
        "--idle-sec", type=float, default=20.0, help="pgbouncer: idle statements counted so long"
    )
    parser.add_argument("--tasks", type=int, default=10_000, help="tasks per drain run")
    parser.add_argument("--single", type=int, default=2_000, help="single enqueues")
    parser.add_argument("--processes", default="1,2,4")
    parser.add_argument("--batches", default="1,10", help="claim batch sizes")
    parser.add_argument("--paused", default="10000,100000", help="paused tasks per sweep pass")
    parser.add_argument("--admissions", type=int, default=1000, help="admissions timed")
    parser.add_argument(
        "--latency-tasks", type=int, default=20, help="tasks per latency figure (each waits)"
    )
    parser.add_argument("--sqlite-synchronous", default="FULL")
    parser.add_argument(
        "--concurrency-tasks", type=int, default=200, help="tasks of 2 s per run (0 skips)"
    )
    parser.add_argument("--concurrency-levels", default="1,16,64", help="--concurrency runs")
    parser.add_argument("--startup-runs", type=int, default=10, help="runs per start-up figure")
    parser.add_argument("--startup-only", action="store_true", help="only the start-up table")
    parser.add_argument(
        "--compare-tasks",
        type=int,
        default=10_000,
        help="tasks per run of the side-by-side comparison (0 skips it)",
    )
    parser.add_argument(
        "--compare-cycles", type=int, default=3, help="interleaved cycles (medians printed)"
    )
    parser.add_argument(
        "--compare-only", action="store_true", help="only the side-by-side comparison"
    )
    args = parser.parse_args()
    measure.compile_agentbus()
    configure(level="WARNING")  # the figures, not the jobs' chatter
    if args.compare_only:
        with measure.Stolen() as stolen:
            compared = compare_rows(args)
        print_table(compare.HEADERS, compared)
        print(stolen.line())
        return
    print_table(
        [f"command (start to exit, {args.startup_runs} runs)", "median", "max"],
        startup.bench(args.startup_runs),
    )
    print()
    if args.startup_only:
        return
    rows: list[tuple[str, str, str]] = []
    with measure.Stolen() as stolen:
        backends = args.backends.split(",")
        for backend in backends:
            with database(backend, args.sqlite_synchronous) as url:
                if backend == "pgbouncer":  # beside the same database reached directly
                    direct = sa.make_url(PG_URL).set(database=sa.make_url(url).database)
                    pooled = pooler_bench.rows(
                        url,
                        direct.render_as_string(False),
                        args.tasks // 2,
                        args.idle_sec,
                        args.latency_tasks,
                    )
                    rows += [(backend, *row) for row in pooled]
                else:
                    rows += [(backend, *row) for row in bench_backend(url, args)]
                print(f"# {backend} done", file=sys.stderr)

    print_table(["backend", "measure", "figure"], rows)
    print(stolen.line())
    if args.compare_tasks:
        print()
        with measure.Stolen() as stolen:
            compared = compare_rows(args)
        print_table(compare.HEADERS, compared)
        print(stolen.line())


def compare_rows(args: argparse.Namespace) -> list[tuple[str, ...]]:
    """The same drain through other queues, when installed (pip install -e .[bench])."""
    return compare.side_by_side(
        args.backends.split(","), args.compare_tasks, 2, args.single, args.compare_cycles
    )


def print_table(headers: list[str], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(str(r[i])) for r in [tuple(headers), *rows]) for i in range(len(headers))]
    for row in [tuple(headers), tuple("-" * w for w in widths), *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


if __name__ == "__main__":
    main()
