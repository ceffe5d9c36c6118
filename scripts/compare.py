"""agentbus beside other Python queues: the same no-op workload, one sitting.

Per queue, in each of ``cycles`` interleaved cycles (queue A, B, C, then A,
B, C again …; the medians are printed):
- drain: T no-op tasks are enqueued first (not timed); then P consumer
  processes are started and the clock runs from their spawn until every task
  is processed (start-up included on all sides).
- CPU per task: user + system CPU of the consumer processes (and their
  children), from the kernel's accounting of reaped children, over T.
- machine CPU per task: what the whole machine spent busy meanwhile (every
  core's user, system and interrupt time from /proc/stat), over T: the
  consumers, the database server's work for them, and anything else running,
  so a queue that moves work into the server is charged for it; on PostgreSQL
  with the server's processes' share of it in brackets (their CPU from
  /proc, when the server runs on this machine).
- RSS: the peak resident memory of one consumer process, sampled every 50 ms.
- single enqueue: N enqueues, one call (one transaction) each.
- batch enqueue: T tasks enqueued 500 per call, where the queue has such a call.

Commits are durable on both sides: SQLite with synchronous=FULL (agentbus's
default; huey's fsync=True), PostgreSQL with its defaults (fsync on,
synchronous_commit on). Semantics differ and are stated with each queue:
huey deletes a task when it dequeues it (a crash mid-task loses it);
agentbus claims, then acknowledges, and writes an event and a routing row for
every transition; procrastinate, pgqueuer and oban mark jobs done after
running them. oban requires Python 3.12: it runs from a virtualenv of its own
made with ``python3.12`` (in ``~/.cache/agentbus-bench``) when that
interpreter is on the PATH.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from measure import (
    Figures,
    agentbus_database,
    consume,
    count_rows,
    execute,
    expect_zero,
    installed,
    module,
    pg_database,
    rate,
)

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Peer:
    backend: str
    label: str
    cycle: Callable[[int, int, int], Figures]  # (tasks, processes, single enqueues)
    missing: str | None = None  # why it cannot run here


# -- agentbus ------------------------------------------------------------------


def agentbus(backend: str, batch: int) -> Callable[[int, int, int], Figures]:
    def cycle(tasks: int, procs: int, single: int) -> Figures:
        from agentbus import AgentBus
        from agentbus.db import Database
        from agentbus.migrations import migrate
        from agentbus.queue import TaskQueue
        from agentbus.queue.tasks import TaskSpec

        with agentbus_database(backend) as url:
            db = Database(url)
            migrate(db)
            agent = f"cmp{uuid.uuid4().hex[:6]}"
            with AgentBus(url) as bus:  # under an agent of their own: not part of the drain
                one = rate(
                    single,
                    lambda: [
                        bus.enqueue(f"{agent}-single", "t", models=["sim/noop"])
                        for _ in range(single)
                    ],
                )
            queue = TaskQueue(db)
            specs = [TaskSpec(agent=agent, command="t", models=("sim/noop",))] * 500
            many = rate(tasks, lambda: [queue.enqueue_many(specs) for _ in range(tasks // 500)])
            db.dispose()
            argv = [str(BIN / "worker"), "--agent", agent, "--db", url, "--drain"]
            figures = consume([*argv, "--batch", str(batch)], procs, tasks)
        return replace(figures, single=one, batch=many)

    return cycle


# -- huey (SQLite) ---------------------------------------------------------------


def huey_sqlite(tasks: int, procs: int, single: int) -> Figures:
    """huey's SQLite storage, ``huey_consumer -k process -w P`` (fsync=True)."""
    workdir = Path(tempfile.mkdtemp(prefix="cmp-huey-"))
    mod = module(
        workdir,
        f"""
        from huey import SqliteHuey
        huey = SqliteHuey("bench", filename={str(workdir / "huey.db")!r}, fsync=True)

        @huey.task()
        def noop():
            return None
    """,
    )
    sys.path.insert(0, str(workdir))
    try:
        app = __import__(mod.stem)
        one = rate(single, lambda: [app.noop() for _ in range(single)])
        app.huey.flush()
        for _ in range(tasks):
            app.noop()
        argv = [str(BIN / "huey_consumer"), f"{mod.stem}.huey", "-k", "process"]
        figures = consume(
            [*argv, "-w", str(procs), "-d", "0.01"],
            1,
            tasks,
            cwd=workdir,
            drained=lambda: app.huey.pending_count() == 0,
        )
    finally:
        sys.path.remove(str(workdir))
        shutil.rmtree(workdir, ignore_errors=True)
    return replace(figures, single=one)


# -- procrastinate, pgqueuer, oban (PostgreSQL) ------------------------------------


def procrastinate_pg(tasks: int, procs: int, single: int) -> Figures:
    """procrastinate with its psycopg connector, P ``run_worker(wait=False)`` processes."""
    workdir = Path(tempfile.mkdtemp(prefix="cmp-procrastinate-"))
    with pg_database() as conninfo:
        mod = module(
            workdir,
            f"""
            from procrastinate import App, PsycopgConnector
            app = App(connector=PsycopgConnector(conninfo={conninfo!r}))

            @app.task(name="noop")
            def noop():
                return None

            if __name__ == "__main__":
                with app.open():
                    app.run_worker(wait=False, concurrency=1, install_signal_handlers=False)
        """,
        )
        sys.path.insert(0, str(workdir))
        try:
            app = __import__(mod.stem)
            with app.app.open():
                app.app.schema_manager.apply_schema()
                one = rate(single, lambda: [app.noop.defer() for _ in range(single)])
                execute(conninfo, "DELETE FROM procrastinate_jobs")
                batch = [{}] * 500
                many = rate(
                    tasks, lambda: [app.noop.batch_defer(*batch) for _ in range(tasks // 500)]
                )
            figures = consume([sys.executable, str(mod)], procs, tasks, cwd=workdir)
        finally:
            sys.path.remove(str(workdir))
            shutil.rmtree(workdir, ignore_errors=True)
        expect_zero(conninfo, "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'")
    return replace(figures, single=one, batch=many)


def pgqueuer_pg(tasks: int, procs: int, single: int) -> Figures:
    """pgqueuer with asyncpg (its recommended driver), P processes in drain mode,
    claiming and acknowledging in batches of 10 (its default)."""
    workdir = Path(tempfile.mkdtemp(prefix="cmp-pgqueuer-"))
    with pg_database() as conninfo:
        mod = module(
            workdir,
            f"""
            import asyncio, json, sys, time
            import asyncpg
            from pgqueuer import AsyncpgDriver, Queries, QueueManager
            from pgqueuer.types import QueueExecutionMode

            async def main():
                conn = await asyncpg.connect({conninfo!r})
                qm = QueueManager(Queries(AsyncpgDriver(conn)))

                @qm.entrypoint("noop")
                async def noop(job):
                    return None

                await qm.run(mode=QueueExecutionMode.drain, batch_size=10)

            async def setup(n, single):
                conn = await asyncpg.connect({conninfo!r})
                queries = Queries(AsyncpgDriver(conn))
                await queries.install()
                began = time.perf_counter()
                for _ in range(single):
                    await queries.enqueue(["noop"], [None], [0])
                one = single / (time.perf_counter() - began)
                await conn.execute("DELETE FROM pgqueuer")
                began = time.perf_counter()
                for start in range(0, n, 500):
                    await queries.enqueue(["noop"] * 500, [None] * 500, [0] * 500)
                many = n / (time.perf_counter() - began)
                await conn.close()
                return one, many
        """,
        )
        sys.path.insert(0, str(workdir))
        try:
            import asyncio

            one, many = asyncio.run(__import__(mod.stem).setup(tasks, single))
            main = f"import asyncio, {mod.stem}; asyncio.run({mod.stem}.main())"
            argv = [sys.executable, "-c", main]
            figures = consume(argv, procs, tasks, cwd=workdir)
        finally:
            sys.path.remove(str(workdir))
            shutil.rmtree(workdir, ignore_errors=True)
        expect_zero(conninfo, "SELECT count(*) FROM pgqueuer")
    return replace(figures, single=one, batch=many)


OBAN_LEFT = "SELECT count(*) FROM oban_jobs WHERE state <> 'completed'"
OBAN_VENV = Path.home() / ".cache" / "agentbus-bench" / "oban"


def oban_python() -> tuple[Path | None, str | None]:
    """oban's interpreter (a Python 3.12 virtualenv made on first use), or why not."""
    python = OBAN_VENV / "bin" / "python"
    if python.exists():
        return python, None
    base = _python312()
    if base is None:
        return None, "needs a Python 3.12 (python3.12 on the PATH, or AGENTBUS_BENCH_PYTHON312)"
    try:
        subprocess.run([base, "-m", "venv", str(OBAN_VENV)], check=True, capture_output=True)
        subprocess.run(
            [str(python), "-m", "pip", "install", "-q", "oban>=0.6,<1"],
            check=True,
            capture_output=True,
        )
    except subprocess.CalledProcessError as exc:
        shutil.rmtree(OBAN_VENV, ignore_errors=True)
        why = (exc.stderr or b"").decode().strip().splitlines()
        return None, f"could not install oban: {why[-1] if why else exc}"
    return python, None


def _python312() -> str | None:
    """A Python 3.12 that runs: named by AGENTBUS_BENCH_PYTHON312, on the PATH, or pyenv's."""
    named = os.environ.get("AGENTBUS_BENCH_PYTHON312")
    candidates = [named] if named else []
    candidates.append(shutil.which("python3.12"))
    candidates += sorted(str(p) for p in Path.home().glob(".pyenv/versions/3.12*/bin/python3.12"))
    for candidate in candidates:
        if candidate is None:
            continue
        try:
            subprocess.run([candidate, "--version"], check=True, capture_output=True)
        except (OSError, subprocess.CalledProcessError):
            continue
        return candidate
    return None


def oban_pg(tasks: int, procs: int, single: int) -> Figures:
    """oban (oban-py), P processes each running queue ``default`` with limit 10."""
    python, _ = oban_python()
    assert python is not None
    workdir = Path(tempfile.mkdtemp(prefix="cmp-oban-"))
    with pg_database() as conninfo:
        mod = module(
            workdir,
            f"""
            import asyncio, json, sys, time
            from oban import Oban, worker
            from oban.schema import install

            DSN = {conninfo!r}

            @worker(queue="default")
            class Noop:
                async def process(self, job):
                    return None

            async def consume():
                pool = await Oban.create_pool(DSN)
                async with Oban(pool=pool, queues={{"default": 10}}):
                    await asyncio.Event().wait()

            async def setup(n, single):
                pool = await Oban.create_pool(DSN)
                await install(pool)
                async with Oban(pool=pool) as oban:
                    began = time.perf_counter()
                    for _ in range(single):
                        await Noop.enqueue()
                    one = single / (time.perf_counter() - began)
                    async with pool.connection() as conn:
                        await conn.execute("DELETE FROM oban_jobs")
                    began = time.perf_counter()
                    for _ in range(n // 500):
                        await oban.enqueue_many([Noop.new() for _ in range(500)])
                    many = n / (time.perf_counter() - began)
                await pool.close()
                print(json.dumps([one, many]))

            if __name__ == "__main__":
                if sys.argv[1] == "setup":
                    asyncio.run(setup(int(sys.argv[2]), int(sys.argv[3])))
                else:
                    asyncio.run(consume())
        """,
        )
        runner = (
            "import runpy, sys; sys.path.insert(0, '.'); "
            f"runpy.run_module({mod.stem!r}, run_name='__main__')"
        )
        out = subprocess.run(
            [str(python), "-c", runner, "setup", str(tasks), str(single)],
            cwd=workdir,
            check=True,
            capture_output=True,
            text=True,
        )
        one, many = json.loads(out.stdout.strip().splitlines()[-1])
        figures = consume(
            [str(python), "-c", runner, "consume"],
            procs,
            tasks,
            cwd=workdir,
            drained=lambda: count_rows(conninfo, OBAN_LEFT) == 0,
        )
        shutil.rmtree(workdir, ignore_errors=True)
    return replace(figures, single=one, batch=many)


# -- side by side --------------------------------------------------------------


def peers(backends: list[str]) -> list[Peer]:
    """The queues to run, agentbus first on each backend."""
    bench_extra = "pip install -e .[bench]"

    def needs(*modules: str) -> str | None:
        return None if installed(*modules) else bench_extra

    table: dict[str, list[tuple[str, Callable[[int, int, int], Figures], str | None]]] = {
        "sqlite": [("huey (SqliteHuey, 2 process workers)", huey_sqlite, needs("huey"))],
        "postgresql": [
            ("pgqueuer (asyncpg, batch 10)", pgqueuer_pg, needs("pgqueuer", "asyncpg")),
            ("oban-py (queue limit 10)", oban_pg, oban_python()[1]),
            ("procrastinate (concurrency 1)", procrastinate_pg, needs("procrastinate")),
        ],
    }
    out: list[Peer] = []
    for backend in (b for b in ("sqlite", "postgresql") if b in backends):
        out += [
            Peer(backend, "agentbus worker, batch 1 (default)", agentbus(backend, 1)),
            Peer(backend, "agentbus worker, --batch 10", agentbus(backend, 10)),
        ]
        out += [Peer(backend, label, run, missing) for label, run, missing in table[backend]]
    return out


def side_by_side(
    backends: list[str], tasks: int, procs: int, single: int, cycles: int
) -> list[tuple[str, ...]]:
    """Rows of the comparison table: each queue's medians over ``cycles`` interleaved
    cycles, and agentbus's drain rate (batch 1 / batch 10) over each peer's."""
    runnable = [p for p in peers(backends) if p.missing is None]
    runs: dict[str, list[Figures]] = {p.label + p.backend: [] for p in runnable}
    for n in range(cycles):
        for peer in runnable:
            runs[peer.label + peer.backend].append(peer.cycle(tasks, procs, single))
        print(f"# cycle {n + 1} of {cycles} done", file=sys.stderr)
    rows: list[tuple[str, ...]] = []
    for backend in backends:
        ours = [
            median(runs[p.label + p.backend])
            for p in runnable
            if p.backend == backend and p.label.startswith("agentbus")
        ]
        for peer in peers([backend]):
            if peer.missing is not None:
                rows.append((backend, peer.label, f"not run: {peer.missing}", *[""] * 6))
                continue
            f = median(runs[peer.label + peer.backend])
            ratio = (
                ""
                if peer.label.startswith("agentbus")
                else (" / ".join(f"{o.drain / f.drain:.2f}x" for o in ours))
            )
            rows.append(
                (
                    backend,
                    peer.label,
                    f"{f.drain:,.0f}",
                    f"{f.cpu_ms:.2f}",
                    _machine(f, backend),
                    f"{f.rss_mib:.1f}",
                    f"{f.single:,.0f}" if f.single is not None else "n/a",
                    f"{f.batch:,.0f}" if f.batch is not None else "n/a",
                    ratio,
                )
            )
    return rows


def _machine(f: Figures, backend: str) -> str:
    """The machine's CPU per task and, on PostgreSQL, the server's share of it."""
    if f.machine_ms is None:
        return "n/a"
    if backend != "postgresql" or f.server_ms is None:
        return f"{f.machine_ms:.2f}"
    return f"{f.machine_ms:.2f} ({f.server_ms:.2f})"


HEADERS = [
    "backend",
    "queue (2 consumer processes, no-op tasks)",
    "drain tasks/s",
    "CPU ms/task",
    "machine CPU ms/task (server's)",
    "RSS MiB",
    "enqueue 1/call /s",
    "enqueue 500/call /s",
    "agentbus b1 / b10 =",
]


def median(figures: list[Figures]) -> Figures:
    def mid(values: list[float | None]) -> float | None:
        known = [v for v in values if v is not None]
        return statistics.median(known) if known else None

    return Figures(
        statistics.median(f.drain for f in figures),
        statistics.median(f.cpu_ms for f in figures),
        statistics.median(f.rss_mib for f in figures),
        mid([f.single for f in figures]),
        mid([f.batch for f in figures]),
        mid([f.machine_ms for f in figures]),
        mid([f.server_ms for f in figures]),
    )
