"""The same no-op workload through other Python queues, for scripts/bench.py.

Workload, identical for every queue: T no-op tasks are enqueued first (not
timed); then P consumer processes are started and the clock runs from their
spawn until every task has been processed (start-up included on all sides).
Commits are durable on both sides: SQLite with synchronous=FULL (agentbus's
default; huey's fsync=True), PostgreSQL with its defaults (fsync on,
synchronous_commit on). Semantics differ and are stated with each figure:
huey deletes a task when it dequeues it (a crash mid-task loses it); agentbus
claims, then acknowledges (a crash re-runs it); procrastinate and pgqueuer
mark jobs done after running them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import sqlalchemy as sa

PG_URL = os.environ.get(
    "AGENTBUS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


def installed(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


@contextmanager
def pg_database() -> Iterator[str]:
    """A fresh Postgres database (libpq conninfo), dropped afterwards."""
    name = f"agentbus_cmp_{uuid.uuid4().hex[:8]}"
    admin = sa.make_url(PG_URL).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield sa.make_url(admin).set(database=name).render_as_string(False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _module(workdir: Path, source: str) -> Path:
    path = workdir / f"cmp_{uuid.uuid4().hex[:6]}.py"
    path.write_text(textwrap.dedent(source))
    return path


def _timed_consumers(
    argv: list[str], procs: int, cwd: Path, drained: Callable[[], bool] | None = None
) -> float:
    """Start ``procs`` consumers; seconds until they exit (or ``drained()``, then stop them)."""
    began = time.perf_counter()
    children = [
        subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(procs)
    ]
    try:
        if drained is None:
            for child in children:
                child.wait(timeout=600)
        else:
            while not drained():
                time.sleep(0.01)
        return time.perf_counter() - began
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
                child.wait(timeout=30)


def huey_sqlite(tasks: int, procs: int) -> float:
    """huey's SQLite storage, ``huey_consumer -k process -w P`` (fsync=True)."""
    workdir = Path(tempfile.mkdtemp(prefix="cmp-huey-"))
    mod = _module(
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
        for _ in range(tasks):
            app.noop()
        consumer = str(Path(sys.executable).with_name("huey_consumer"))
        seconds = _timed_consumers(
            [consumer, f"{mod.stem}.huey", "-k", "process", "-w", str(procs), "-d", "0.01"],
            1,
            workdir,
            drained=lambda: app.huey.pending_count() == 0,
        )
    finally:
        sys.path.remove(str(workdir))
    return tasks / seconds


def procrastinate_pg(tasks: int, procs: int) -> float:
    """procrastinate with its psycopg connector, P ``run_worker(wait=False)`` processes."""
    workdir = Path(tempfile.mkdtemp(prefix="cmp-procrastinate-"))
    with pg_database() as conninfo:
        mod = _module(
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
                for start in range(0, tasks, 500):
                    app.noop.batch_defer(*({} for _ in range(min(500, tasks - start))))
            seconds = _timed_consumers([sys.executable, str(mod)], procs, workdir)
        finally:
            sys.path.remove(str(workdir))
        _expect_zero(
            conninfo, "SELECT count(*) FROM procrastinate_jobs WHERE status <> 'succeeded'"
        )
    return tasks / seconds


def pgqueuer_pg(tasks: int, procs: int) -> float:
    """pgqueuer with asyncpg (its recommended driver), P processes in drain mode,
    claiming and acknowledging in batches of 10 (its default)."""
    workdir = Path(tempfile.mkdtemp(prefix="cmp-pgqueuer-"))
    with pg_database() as conninfo:
        dsn = sa.make_url(PG_URL).set(drivername="postgresql", database=conninfo.rsplit("/", 1)[1])
        dsn_text = dsn.render_as_string(hide_password=False)
        mod = _module(
            workdir,
            f"""
            import asyncio
            import asyncpg
            from pgqueuer import AsyncpgDriver, Queries, QueueManager
            from pgqueuer.types import QueueExecutionMode

            async def main():
                conn = await asyncpg.connect({dsn_text!r})
                qm = QueueManager(Queries(AsyncpgDriver(conn)))

                @qm.entrypoint("noop")
                async def noop(job):
                    return None

                await qm.run(mode=QueueExecutionMode.drain, batch_size=10)

            async def setup(n):
                conn = await asyncpg.connect({dsn_text!r})
                queries = Queries(AsyncpgDriver(conn))
                await queries.install()
                for start in range(0, n, 500):
                    size = min(500, n - start)
                    await queries.enqueue(["noop"] * size, [None] * size, [0] * size)
                await conn.close()

            if __name__ == "__main__":
                asyncio.run(main())
        """,
        )
        sys.path.insert(0, str(workdir))
        try:
            import asyncio

            asyncio.run(__import__(mod.stem).setup(tasks))
            seconds = _timed_consumers([sys.executable, str(mod)], procs, workdir)
        finally:
            sys.path.remove(str(workdir))
        _expect_zero(conninfo, "SELECT count(*) FROM pgqueuer")
    return tasks / seconds


def _expect_zero(conninfo: str, sql: str) -> None:
    """The run counts only if the queue was really drained."""
    with psycopg.connect(conninfo) as conn:
        row = conn.execute(sql).fetchone()
    if row is None or row[0] != 0:
        raise RuntimeError(f"queue not drained: {sql} -> {row}")


def side_by_side(
    backends: list[str], n: int, procs: int, ours: Callable[[str], dict[int, float]]
) -> list[tuple[str, ...]]:
    """Rows of a table: agentbus's drain rate per batch size (``ours``) beside each peer's
    on the same backend, with the ratios."""
    rows: list[tuple[str, ...]] = []
    others = {
        "sqlite": [("huey", "huey", huey_sqlite)],
        "postgresql": [
            ("procrastinate", "procrastinate", procrastinate_pg),
            ("pgqueuer", "pgqueuer (asyncpg)", pgqueuer_pg),
        ],
    }
    for backend in backends:
        rates = ours(backend)
        for batch, rate in rates.items():
            rows.append((backend, f"agentbus worker, batch {batch}", f"{rate:,.0f}", ""))
        for module, label, run in others.get(backend, []):
            if not (installed(module) and (module != "pgqueuer" or installed("asyncpg"))):
                rows.append((backend, label, "not installed (pip install -e .[bench])", ""))
                continue
            theirs = run(n, procs)
            ratio = " / ".join(f"{rates[b] / theirs:.2f}x (batch {b})" for b in rates)
            rows.append((backend, label, f"{theirs:,.0f}", ratio))
        print(f"# {backend} compared", file=sys.stderr)
    return rows
