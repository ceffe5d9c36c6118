"""Database faults are survived: lock contention on SQLite, dropped connections and a
restart on PostgreSQL. Nothing is lost and no process crashes."""

from __future__ import annotations

import multiprocessing as mp
import signal
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import psycopg
import pytest

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec
from tests.conftest import Backends
from tests.pg_cluster import throwaway_cluster
from tests.procs import hammer
from tests.support import Proc, wait_until

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]
FAST = {
    "AGENTBUS_LEASE_SEC": "2",
    "AGENTBUS_SWEEP_INTERVAL_SEC": "1",
    "AGENTBUS_POLL_SEC": "0.1",
    "AGENTBUS_DB_RETRY_SEC": "60",
}


def test_eight_processes_hammering_one_sqlite_file(backends: Backends) -> None:
    url, handle = backends.new("sqlite")
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(8, mp_context=ctx) as pool:
        start = manager.Event()
        futures = [pool.submit(hammer, url, f"agent{i}", 150, 20, start) for i in range(8)]
        start.set()
        done = [f.result(timeout=300) for f in futures]  # an escaped "database is locked" raises
    assert done == [150] * 8
    db = Database(url)
    assert reads.counts(db) == {("done", f"agent{i}"): 150 for i in range(8)}
    db.dispose()
    backends.drop(handle)


def _run_and_disrupt(
    url: str, spawn: Spawn, disrupt: Callable[[], None], held: Path, tasks: int = 120
) -> None:
    """Ten tasks run freely; the rest wait on the file ``held`` until the disruption is
    over, so both workers are in the middle of a call (and then settle) across it."""
    db = Database(url)
    queue = TaskQueue(db)
    script = {"simulate": {"sim/a": {"wait_for": str(held)}}}
    ids = queue.enqueue_many(
        [
            TaskSpec(
                agent="codex",
                command=str(i),
                models=("sim/a",),
                payload=script if i >= 10 else {},
                priority=1 if i < 10 else 0,
            )
            for i in range(tasks)
        ]
    )
    procs = [spawn("worker", "--agent", "codex", "--db", url, env=FAST) for _ in range(2)]
    procs.append(spawn("sweeper", "--db", url, env=FAST))
    started = ("worker_started", "worker_started", "sweeper_started")
    wait_until(lambda: all(line in p.text() for p, line in zip(procs, started, strict=True)))
    done = TaskStatus.DONE
    wait_until(lambda: sum(n for (s, _), n in reads.counts(db).items() if s == done) >= 10)
    wait_until(lambda: held.with_name(held.name + ".waiting").exists())  # a call is held
    disrupt()
    held.touch()
    wait_until(lambda: all(queue.get(i).status is TaskStatus.DONE for i in ids), timeout=180)
    assert [p.popen.poll() for p in procs] == [None, None, None], "a process died"
    for proc in procs:
        proc.signal(signal.SIGTERM)
    assert [p.wait() for p in procs] == [0, 0, 0]
    for proc in procs:
        assert "Traceback" not in proc.text()
    assert any("db_retry" in p.text() for p in procs), "the fault was never felt"
    db.dispose()


def test_postgres_connections_terminated_mid_run(
    backends: Backends, spawn: Spawn, tmp_path: Path
) -> None:
    url, name = backends.new("postgresql")
    admin = Database(url.rsplit("/", 1)[0] + "/postgres")

    conninfo = admin.url.set(drivername="postgresql").render_as_string(False)
    sql = (
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
        "WHERE datname = %s AND pid <> pg_backend_pid()"
    )

    def kill_backends() -> int:
        with psycopg.connect(conninfo, autocommit=True) as conn:
            row = conn.execute(sql, (str(name),)).fetchone()
            return int(row[0]) if row else 0

    def terminate_all() -> None:
        assert kill_backends() > 0
        wait_until(kill_backends)  # and again, once they have reconnected

    _run_and_disrupt(url, spawn, terminate_all, tmp_path / "release")
    admin.dispose()
    backends.drop(name)


@pytest.fixture
def throwaway_postgres() -> Iterator[tuple[str, Callable[[], None]]]:
    """A PostgreSQL cluster of the test's own, and a way to restart it."""
    with throwaway_cluster() as cluster:
        yield cluster


def test_postgres_restart_mid_run(
    throwaway_postgres: tuple[str, Callable[[], None]], spawn: Spawn, tmp_path: Path
) -> None:
    url, restart = throwaway_postgres
    _run_and_disrupt(url, spawn, restart, tmp_path / "release")
