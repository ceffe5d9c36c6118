"""A worker survives what production throws at it: the database away for longer than
its retries while a call runs, and SIGTERM while its log output is back-pressured."""

from __future__ import annotations

import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

import psycopg
import pytest
import sqlalchemy as sa

from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from agentbus.worker.loop import Options, Worker
from agentbus.worker.watchdog import Watchdog
from tests.conftest import _pg_conninfo
from tests.support import Proc, clean_env, wait_until

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]


@contextmanager
def database_away(url: str) -> Iterator[None]:
    """Nobody can write (SQLite: another connection holds the write lock) or even
    connect (PostgreSQL: connections refused and the open ones terminated)."""
    parsed = sa.make_url(url)
    if parsed.get_backend_name() == "sqlite":
        holder = sqlite3.connect(str(parsed.database), timeout=10, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")
        try:
            yield
        finally:
            holder.rollback()
            holder.close()
        return
    name = parsed.database
    with psycopg.connect(_pg_conninfo(), autocommit=True) as admin:
        admin.execute(f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS false")
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,)
        )
        try:
            yield
        finally:
            admin.execute(f"ALTER DATABASE {name} WITH ALLOW_CONNECTIONS true")


def journal_calls(path: Path) -> dict[int, int]:
    import json

    calls: dict[int, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            task = json.loads(line)["task_id"]
            calls[task] = calls.get(task, 0) + 1
    return calls


def test_the_watchdog_outlives_a_database_outage_and_nothing_runs_twice(
    db_url: str, spawn: Spawn, tmp_path: Path
) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    journal = tmp_path / "journal"
    lease = 2.0

    def enqueue(gate: Path) -> int:
        payload = {"simulate": {"sim/a": {"wait_for": str(gate)}}}
        spec = TaskSpec(agent="codex", command="x", models=("sim/a",), payload=payload)
        return queue.enqueue(spec).id

    # Through PgBouncer the outage lasts its server_login_retry (1 s in the tests) longer
    # than the server's: a worker that gave up sooner would exit just after it.
    retry_sec = "3" if "pooler=transaction" in db_url else "0.5"
    env = {
        "AGENTBUS_SIM_JOURNAL": str(journal),
        "AGENTBUS_DB_RETRY_SEC": retry_sec,
        "AGENTBUS_SQLITE_BUSY_TIMEOUT_MS": "100",
    }
    args = ("--agent", "codex", "--db", db_url, "--lease", str(lease), "--poll", "0.05")
    worker = spawn("worker", *args, "--log-json", env=env)
    first = enqueue(tmp_path / "first")
    wait_until(lambda: (tmp_path / "first.waiting").exists())  # the call is in flight
    with database_away(db_url):
        # Held until the watchdog has failed to renew past db_retry_sec, and said so.
        wait_until(lambda: any(e["event"] == "watchdog_error" for e in worker.events()), timeout=60)
    (tmp_path / "first").touch()
    wait_until(lambda: queue.get(first).status == "done", timeout=60)

    # After the outage the watchdog still renews: a call much longer than the lease,
    # with a sweeper rescuing expired leases, is neither rescued nor run twice.
    sweeper = spawn("sweeper", "--db", db_url, "--interval", "0.2", env=env)
    later = [enqueue(tmp_path / f"later{i}") for i in range(2)]
    for i, task_id in enumerate(later):
        wait_until(lambda i=i: (tmp_path / f"later{i}.waiting").exists())
        claimed = queue.get(task_id)
        assert claimed.lease_until is not None and claimed.updated_at is not None
        renewed_past = claimed.updated_at + 3 * lease
        wait_until(lambda t=task_id, r=renewed_past: (queue.get(t).lease_until or 0) > r)
        (tmp_path / f"later{i}").touch()
        wait_until(lambda t=task_id: queue.get(t).status == "done")

    calls = journal_calls(journal)
    assert [calls.get(t) for t in (first, *later)] == [1, 1, 1]
    assert reads.counts(db) == {("done", "codex"): 3}
    for task_id in later:
        reasons = [e["reason"] for e in reads.task_events(db, task_id)]
        assert reasons == ["enqueue", "claim", "done"]
    worker.signal(signal.SIGTERM)
    sweeper.signal(signal.SIGTERM)
    assert worker.wait(timeout=30) == 0
    assert sweeper.wait(timeout=30) == 0
    db.dispose()


def test_a_worker_whose_watchdog_ends_stops_and_exits_non_zero(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(self: Watchdog) -> None:
        raise RuntimeError("the watchdog's rounds ended")

    monkeypatch.setattr(Watchdog, "_rounds", broken)
    options = Options("codex", lease_sec=30, poll_sec=0.05, grace_sec=1)
    worker = Worker(LiveConfig.fixed(Settings()), db, options)
    assert worker.run() == 1


def test_a_stop_request_takes_no_lock_the_logger_may_hold(db: Database) -> None:
    """The SIGTERM handler runs in the main thread, possibly in the middle of writing a
    log line: asking to stop must not wait for the log's write lock."""
    import structlog._output

    from agentbus.logging import configure

    configure(level="INFO")
    try:
        worker = Worker(LiveConfig.fixed(Settings()), db, Options("codex", 30, 0.05, 1))
        worker.log.info("first_line")  # the logger exists and has its lock
        lock = structlog._output.WRITE_LOCKS[sys.stderr]
        with lock:  # as if the main thread were inside a write when the signal came
            asking = threading.Thread(target=worker.request_stop, args=("SIGTERM",), daemon=True)
            asking.start()
            asking.join(timeout=10)
            assert not asking.is_alive(), "request_stop waited for the log's lock"
        assert worker.stopping.is_set()
    finally:  # the next tests of this process log (and capture) as configured by default
        structlog.reset_defaults()


def writing_to_a_full_pipe(pid: int) -> bool:
    """Whether a thread of ``pid`` is blocked writing into a full pipe (Linux /proc)."""
    for wchan in Path(f"/proc/{pid}/task").glob("*/wchan"):
        try:
            if wchan.read_text().endswith("pipe_write"):  # pipe_write, anon_pipe_write
                return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def read_once_released(pipe: IO[bytes], released: threading.Event) -> None:
    """A reader that is stuck (a hung journald, a paused terminal) until ``released``:
    the pipe fills and the worker's log writes block; then it reads everything."""
    released.wait()
    while pipe.read(65536):
        pass


def test_sigterm_always_stops_a_worker_whose_stderr_is_read_slowly(
    db_url: str, tmp_path: Path
) -> None:
    """The signal arrives while the main thread writes a log line into a full pipe."""
    db = Database(db_url)
    queue = TaskQueue(db)
    exe = str(Path(sys.executable).with_name("worker"))
    env = clean_env()
    env["AGENTBUS_LOG_LEVEL"] = "DEBUG"  # several lines per task: the pipe stays full
    for _ in range(5):
        before = reads.counts(db).get(("done", "codex"), 0)
        queue.enqueue_many(
            [TaskSpec(agent="codex", command="x" * 200, models=("sim/a",)) for _ in range(400)]
        )
        proc = subprocess.Popen(
            [exe, "--agent", "codex", "--db", db_url, "--grace", "5"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert proc.stderr is not None
        stderr = proc.stderr

        released = threading.Event()
        reader = threading.Thread(target=read_once_released, args=(stderr, released), daemon=True)
        reader.start()
        # Held: the worker blocks writing a log line into the full pipe, mid-work.
        wait_until(lambda p=proc.pid: writing_to_a_full_pipe(p), timeout=60)
        assert reads.counts(db).get(("done", "codex"), 0) > before  # it was working
        proc.send_signal(signal.SIGTERM)
        released.set()  # the reader comes back: the write completes, the signal is seen
        try:
            code = proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert code == 0
        reader.join(timeout=30)
        assert not reader.is_alive()
        stderr.close()
        assert reads.counts(db).get(("claimed", "codex"), 0) == 0
    db.dispose()
