"""A server or a pooler with every connection taken, directly and through PgBouncer in
transaction mode: refused connections are waited out, said once, and nothing is lost."""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from tests import pgbouncer
from tests.conftest import BACKENDS, PG_URL
from tests.support import Proc, conninfo, enqueue_held, wait_until, waiting

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]
POOLED = BACKENDS[2:]  # through the session's PgBouncer


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    db = Database(db_url)
    yield TaskQueue(db)
    db.dispose()


@contextlib.contextmanager
def hogs(bouncer: pgbouncer.PgBouncer, dbname: str, n: int) -> Iterator[list[psycopg.Connection]]:
    conns = [
        psycopg.connect(
            f"host=127.0.0.1 port={bouncer.port} user={bouncer.user} dbname={dbname}",
            autocommit=True,
            prepare_threshold=None,
        )
        for _ in range(n)
    ]
    try:
        yield conns
    finally:
        for conn in conns:
            conn.close()


def retries_logged(proc: Proc) -> list[dict[str, object]]:
    return [e for e in proc.events() if e.get("event") == "db_retry" and e["level"] == "warning"]


def back_logged(proc: Proc) -> list[dict[str, object]]:
    return [e for e in proc.events() if e.get("event") == "db_back"]


@pytest.mark.parametrize("backend", POOLED, indirect=True)
def test_a_worker_waits_for_a_full_pooler_at_start_and_runs_each_task_once(
    db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    """Every client slot of the pooler (max_client_conn) is taken when the worker starts:
    it says so once, waits, and drains every task once as soon as the slots free."""
    dbname = sa.make_url(db_url).database or ""
    ids = [
        queue.enqueue(TaskSpec(agent="codex", command=f"t{i}", models=("sim/a",))).id
        for i in range(5)
    ]
    with pgbouncer.pgbouncer(PG_URL, max_client_conn=3) as bouncer:
        url = bouncer.url(dbname)
        with hogs(bouncer, dbname, 3):
            proc = spawn("worker", "--agent", "codex", "--db", url, "--drain", "--log-json")
            wait_until(lambda: retries_logged(proc), timeout=60)
        assert proc.wait(90) == 0
    assert "Traceback" not in proc.text()
    assert [(queue.get(i).status, queue.get(i).attempts) for i in ids] == [("done", 1)] * 5
    (said,) = retries_logged(proc)
    assert "no more connections allowed" in str(said["error"])
    assert len(back_logged(proc)) == 1  # the episode's end, said once


@pytest.mark.parametrize("backend", POOLED, indirect=True)
def test_a_pooler_that_makes_queries_wait_too_long_is_survived_mid_run(
    db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    """The pooler's one server connection is held by another client while the worker's
    call runs: settling waits in the pooler until query_wait_timeout ends it; the worker
    says so once, retries with backoff, and every task ends done once."""
    dbname = sa.make_url(db_url).database or ""
    gates = [tmp_path / f"gate{i}" for i in range(3)]
    ids = enqueue_held(queue, gates)
    with pgbouncer.pgbouncer(PG_URL, default_pool_size=1, query_wait_timeout=1) as bouncer:
        url = bouncer.url(dbname)
        proc = spawn("worker", "--agent", "codex", "--db", url, "--drain", "--log-json")
        wait_until(lambda: waiting(gates[:1]), timeout=60)  # the first call runs
        with hogs(bouncer, dbname, 1) as (hog,):
            hog.execute("BEGIN")
            hog.execute("SELECT 1")  # holds the pool's one server connection
            gates[0].touch()  # the call ends: settling it waits for a server connection
            wait_until(lambda: retries_logged(proc), timeout=60)
            hog.execute("COMMIT")
        for gate in gates[1:]:
            gate.touch()
        assert proc.wait(90) == 0
    assert "Traceback" not in proc.text()
    assert [(queue.get(i).status, queue.get(i).attempts) for i in ids] == [("done", 1)] * 3
    (said,) = retries_logged(proc)
    # PgBouncer sends query_wait_timeout and closes the connection; a client busy
    # elsewhere (a loaded machine) may find it closed before it reads the message.
    assert any(
        why in str(said["error"])
        for why in ("query_wait_timeout", "server closed the connection unexpectedly")
    ), said
    assert len(back_logged(proc)) == 1


@pytest.mark.parametrize("backend", POOLED, indirect=True)
def test_a_sweeper_kept_waiting_mid_pass_says_so_once_and_sweeps_on(
    db_url: str, spawn: Spawn
) -> None:
    """The pooler's one server connection is held while the sweeper passes and peeks
    five times a second: its pass waits (query_wait_timeout, again and again) and the
    runs that come due meanwhile are skipped, and all that is two lines, one when the
    wait begins and one when it ends."""
    dbname = sa.make_url(db_url).database or ""
    env = {"AGENTBUS_SWEEP_PEEK_SEC": "0.2", "AGENTBUS_LOG_LEVEL": "debug"}
    with pgbouncer.pgbouncer(PG_URL, default_pool_size=1, query_wait_timeout=1) as bouncer:
        url = bouncer.url(dbname)
        sweeper = spawn("sweeper", "--db", url, "--interval", "0.5", "--log-json", env=env)
        wait_until(lambda: passes(sweeper) >= 1, timeout=60)
        with hogs(bouncer, dbname, 1) as (hog,):
            hog.execute("BEGIN")
            hog.execute("SELECT 1")  # holds the pool's one server connection
            # The warning, then debug lines: it has tried again, and again
            wait_until(lambda: events_of(sweeper, "db_retry") >= 3, timeout=60)
            hog.execute("COMMIT")
        before = passes(sweeper)
        wait_until(lambda: passes(sweeper) > before + 2, timeout=60)
        sweeper.signal(signal.SIGTERM)
        assert sweeper.wait(30) == 0
    (said,) = retries_logged(sweeper)
    # PgBouncer sends query_wait_timeout and closes the connection; a client busy
    # elsewhere (a loaded machine) may find it closed before it reads the message.
    assert any(
        why in str(said["error"])
        for why in ("query_wait_timeout", "server closed the connection unexpectedly")
    ), said
    assert len(back_logged(sweeper)) == 1
    text = sweeper.text()
    assert "skipped" not in text and "sweep_job_failed" not in text and "Traceback" not in text


def events_of(proc: Proc, event: str) -> int:
    return sum(1 for e in proc.events() if e.get("event") == event)


def passes(proc: Proc) -> int:
    return events_of(proc, "sweep_pass")


def test_a_fleet_over_a_small_servers_connections_drains_every_task_once(spawn: Spawn) -> None:
    """The server lets the fleet have 6 connections (max_connections 8, 2 kept for
    superusers) and the fleet asks for more: see ``drain_over_the_limit``."""
    from tests.pg_cluster import throwaway_cluster

    settings = {"max_connections": 8, "superuser_reserved_connections": 2}
    with throwaway_cluster(settings=settings) as (admin_url, _restart):
        with psycopg.connect(conninfo(admin_url), autocommit=True) as admin:
            admin.execute("CREATE ROLE fleet LOGIN")
            for kind in ("TABLES", "SEQUENCES"):
                admin.execute(f"GRANT ALL ON ALL {kind} IN SCHEMA public TO fleet")
        url = sa.make_url(admin_url).set(username="fleet").render_as_string(False)
        held = [psycopg.connect(conninfo(url), autocommit=True) for _ in range(5)]
        refused = drain_over_the_limit(spawn, admin_url, url, held)
    assert any("remaining connection slots are reserved" in text for text in refused)


@pytest.mark.parametrize("backend", POOLED, indirect=True)
def test_a_fleet_over_a_small_poolers_clients_drains_every_task_once(
    db_url: str, spawn: Spawn
) -> None:
    """PgBouncer takes 6 clients (max_client_conn) and lends them 2 server connections
    (max_db_connections) while the fleet asks for more: see ``drain_over_the_limit``."""
    dbname = sa.make_url(db_url).database or ""
    with (
        pgbouncer.pgbouncer(PG_URL, max_client_conn=6, max_db_connections=2) as bouncer,
        hogs(bouncer, dbname, 5) as held,
    ):
        refused = drain_over_the_limit(spawn, db_url, bouncer.url(dbname), held)
    assert any("no more connections allowed" in text for text in refused)


def drain_over_the_limit(
    spawn: Spawn, admin_url: str, url: str, held: list[psycopg.Connection]
) -> list[str]:
    """200 tasks; 5 draining workers, two of them --concurrency 4, and a sweeper start
    at once on ``url``, asking for more connections than it gives, while ``held`` takes
    all but one of them until a process has been refused (however slowly they start).
    The refused wait their turn: all 200 tasks are done once, every worker exits 0, the
    sweeper sweeps on, and no log holds a traceback. Returns the logs of the refused."""
    db = Database(admin_url)
    queue = TaskQueue(db)
    ids = queue.enqueue_many(
        [TaskSpec(agent="codex", command=f"t{i}", models=("sim/noop",)) for i in range(200)]
    )
    try:
        workers = [
            spawn("worker", "--agent", "codex", "--db", url, "--drain", *more)
            for more in ([], [], [], ["--concurrency", "4"], ["--concurrency", "4"])
        ]
        sweeper = spawn("sweeper", "--db", url, "--interval", "0.5")
        wait_until(lambda: any("db_retry" in p.text() for p in [*workers, sweeper]))
        for conn in held:
            conn.close()
        assert [proc.wait(120) for proc in workers] == [0] * 5
        # Alive and sweeping, however long its start waited for a connection.
        passes = sweeper.text().count("sweep_pass")
        wait_until(lambda: sweeper.text().count("sweep_pass") > passes, timeout=60)
        counts = reads.counts(db)
        events = db.read(
            lambda conn: conn.exec_driver_sql(
                "SELECT task_id, count(*) FROM task_events WHERE reason = 'claim' GROUP BY task_id"
            ).all()
        )
    finally:
        db.dispose()
    assert counts == {("done", "codex"): 200}
    assert sorted(task for task, _ in events) == sorted(ids)
    assert {n for _, n in events} == {1}  # none claimed twice
    for proc in [*workers, sweeper]:
        assert "Traceback" not in proc.text()
        # Each time it was refused is said twice, when it began and when it ended,
        # not at each retry.
        assert proc.text().count("] db_retry ") == proc.text().count("] db_back "), proc.text()
    sweeper.signal(signal.SIGTERM)
    assert sweeper.wait(30) == 0
    refused = [p.text() for p in [*workers, sweeper] if "db_retry" in p.text()]
    assert refused, "no process was refused: the fleet did not go over the limit"
    return refused


@pytest.mark.parametrize("backend", POOLED, indirect=True)
def test_busctl_and_the_api_wait_for_a_full_pooler_only_so_long(
    db_url: str, queue: TaskQueue, run_busctl: Callable[..., object]
) -> None:
    """Every client slot taken for longer than db_full_wait_sec: busctl gives one line
    and exit 3, the API raises DatabaseUnavailable (a BusError), and nothing is
    written. A wait that is not a positive number is refused before anything."""
    from agentbus.client import AgentBus
    from agentbus.config import Settings
    from agentbus.errors import DatabaseUnavailable

    dbname = sa.make_url(db_url).database or ""
    with pgbouncer.pgbouncer(PG_URL, max_client_conn=2) as bouncer:
        url = bouncer.url(dbname)
        with hogs(bouncer, dbname, 2):
            wait = {"AGENTBUS_DB_FULL_WAIT_SEC": "1"}
            args = ("enqueue", "--agent", "codex", "--models", "sim/a", "x")
            done = run_busctl("--db", url, *args, env=wait)
            lines = done.stderr.strip().splitlines()  # type: ignore[attr-defined]
            assert done.returncode == 3, lines  # type: ignore[attr-defined]
            assert len(lines) == 1 and "db_full_wait_sec" in lines[0], lines
            assert "no more connections allowed" in lines[0]
            settings = Settings(database_url=url, db_full_wait_sec=1.0)
            with (
                pytest.raises(DatabaseUnavailable, match="db_full_wait_sec"),
                AgentBus(settings=settings) as bus,
            ):
                bus.enqueue("codex", "y", models=["sim/a"])
            for bad in ("soon", "0", "-1"):
                done = run_busctl("--db", url, *args, env={"AGENTBUS_DB_FULL_WAIT_SEC": bad})
                lines = done.stderr.strip().splitlines()  # type: ignore[attr-defined]
                assert done.returncode == 2 and len(lines) == 1, lines  # type: ignore[attr-defined]
                assert "db_full_wait_sec" in lines[0].lower(), lines
    assert reads.list_tasks(queue.db, agent="codex") == []
