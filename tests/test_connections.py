"""PostgreSQL connections at fleet scale, direct and through PgBouncer in transaction mode:
each process holds few, names them, and outlives a server or pooler that is full."""

from __future__ import annotations

import contextlib
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from tests import pgbouncer
from tests.conftest import BACKENDS, PG_URL, Backends, Pooled, _pg_conninfo
from tests.support import Proc, enqueue_held, wait_until, waiting

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]
POSTGRES = BACKENDS[1:]  # direct, and through the session's PgBouncer


def worker_name(proc: Proc, agent: str = "codex") -> str:
    return f"agentbus-worker:{agent}:{socket.gethostname()}:{proc.popen.pid}"


def held_by(backends: Backends, backend: str, url: str, name: str) -> int:
    """Connections named ``name`` open now: on the server (direct), or on the pooler as
    its clients (through PgBouncer, where a server connection serves whoever asks)."""
    if isinstance(backend, Pooled):
        rows = backends.bouncer().admin("SHOW CLIENTS")
        return sum(1 for row in rows if row[-1] == name)
    dbname = sa.make_url(url).database
    with psycopg.connect(_pg_conninfo(), autocommit=True) as conn:
        found = conn.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = %s AND application_name = %s",
            (dbname, name),
        ).fetchone()
    return int(found[0]) if found else 0


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    db = Database(db_url)
    yield TaskQueue(db)
    db.dispose()


@pytest.mark.parametrize("backend", POSTGRES, indirect=True)
def test_a_worker_names_its_connections_and_holds_few_busy_or_idle(
    backends: Backends, backend: str, db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    gates = [tmp_path / f"gate{i}" for i in range(16)]
    ids = enqueue_held(queue, gates)
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--concurrency", "16")
    name = worker_name(proc)
    wait_until(lambda: len(waiting(gates)) == 16, timeout=90)  # 16 calls in flight
    listener = 0 if isinstance(backend, Pooled) else 1  # direct: LISTENs on one more
    busy = held_by(backends, backend, db_url, name)
    assert 1 <= busy <= 4 + listener
    for gate in gates:
        gate.touch()
    wait_until(lambda: all(queue.get(i).status == "done" for i in ids), timeout=90)
    # Idle for wakeups.REST_SEC: the claims' own connections go back, one stays pooled.
    wait_until(lambda: held_by(backends, backend, db_url, name) <= 1 + listener, timeout=60)
    sweeper = spawn("sweeper", "--db", db_url, "--interval", "0.2")
    wait_until(lambda: sweeper.text().count("sweep_pass") >= 3, timeout=60)
    assert held_by(backends, backend, db_url, "agentbus-sweeper") == 1
    assert "sweep_job_failed" not in sweeper.text()
    assert proc.popen.poll() is None and sweeper.popen.poll() is None


@pytest.mark.parametrize("backend", POSTGRES, indirect=True)
def test_busctl_and_the_api_name_their_connections(
    backends: Backends, backend: str, db_url: str, run_busctl: Callable[..., object]
) -> None:
    from agentbus.client import AgentBus

    with AgentBus(db_url) as bus:
        assert held_by(backends, backend, db_url, "agentbus-api") == 0  # none until used
        bus.enqueue("codex", "hello", models=["sim/a"])
        assert held_by(backends, backend, db_url, "agentbus-api") in (1, 2)
        if isinstance(backend, Pooled):  # PgBouncer passes the name on to the server
            direct = sa.make_url(db_url).set(port=sa.make_url(PG_URL).port)
            assert held_by(backends, "postgresql", direct.render_as_string(False), "agentbus-api")
    done = run_busctl("--db", db_url, "status")
    assert done.returncode == 0, done.stderr  # type: ignore[attr-defined]
    # A name of the user's own, in the URL, wins.
    mine = sa.make_url(db_url).update_query_dict({"application_name": "billing-job"})
    with AgentBus(mine.render_as_string(False)) as bus:
        bus.enqueue("codex", "hello", models=["sim/a"])
        assert held_by(backends, backend, db_url, "billing-job") >= 1
        assert held_by(backends, backend, db_url, "agentbus-api") == 0


def test_a_pooler_value_that_is_not_known_is_one_line(
    run_busctl: Callable[..., object], tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'bus.db'}"
    for args, env in (
        (["--pooler", "session", "--db", url, "migrate"], {}),
        (["--db", url, "migrate"], {"AGENTBUS_POOLER": "session"}),
        (["--db", f"{PG_URL}?pooler=session", "migrate"], {}),
    ):
        done = run_busctl(*args, env=env)
        assert done.returncode != 0, args  # type: ignore[attr-defined]
        lines = done.stderr.strip().splitlines()  # type: ignore[attr-defined]
        assert len(lines) == 1 and "session" in lines[0] and "transaction" in lines[0], lines
        assert "Traceback" not in done.stderr  # type: ignore[attr-defined]
    assert not (tmp_path / "bus.db").exists()


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
def test_a_listen_url_that_does_not_connect_stops_the_worker_with_one_line(
    db_url: str, queue: TaskQueue, spawn: Spawn
) -> None:
    task = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",)))
    nowhere = "postgresql+psycopg://postgres:hunter2@127.0.0.1:1/postgres"
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--listen-url", nowhere)
    assert proc.wait() == 3
    lines = proc.text().strip().splitlines()
    assert len(lines) == 1 and "listen_url" in lines[0] and "hunter2" not in lines[0], lines
    assert queue.get(task.id).status == "queued" and queue.get(task.id).attempts == 0


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
def test_a_listen_url_through_the_pooler_is_one_line(
    db_url: str, queue: TaskQueue, spawn: Spawn, run_busctl: Callable[..., object]
) -> None:
    """A listen_url that is the pooled URL itself, or says ?pooler=transaction, would
    never hear a notification: refused at start, and nothing is claimed."""
    task = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",)))
    plain = sa.make_url(db_url).difference_update_query(["pooler"]).render_as_string(False)
    for listen in (db_url, plain):
        proc = spawn("worker", "--agent", "codex", "--db", db_url, "--listen-url", listen)
        assert proc.wait() == 2
        lines = proc.text().strip().splitlines()
        assert len(lines) == 1 and "listen_url must reach PostgreSQL directly" in lines[0]
    done = run_busctl("--db", db_url, "--listen-url", db_url, "status")
    assert done.returncode == 2, done.stderr  # type: ignore[attr-defined]
    assert queue.get(task.id).status == "queued" and queue.get(task.id).attempts == 0


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


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
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


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
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
    assert "query_wait_timeout" in str(said["error"])
    assert len(back_logged(proc)) == 1


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
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
    assert "query_wait_timeout" in str(said["error"])
    assert len(back_logged(sweeper)) == 1
    text = sweeper.text()
    assert "skipped" not in text and "sweep_job_failed" not in text and "Traceback" not in text


def events_of(proc: Proc, event: str) -> int:
    return sum(1 for e in proc.events() if e.get("event") == event)


def passes(proc: Proc) -> int:
    return events_of(proc, "sweep_pass")


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
def test_a_pooler_left_unsaid_is_one_line_and_changes_nothing(
    db_url: str, queue: TaskQueue, run_busctl: Callable[..., object]
) -> None:
    """Through PgBouncer with pooler = none, a statement prepared by one process meets
    another's on the same server connection: a clear line saying what to set, never a
    traceback, and the refused enqueue writes nothing."""
    from agentbus.client import AgentBus
    from agentbus.errors import ConfigError

    unsaid = sa.make_url(db_url).difference_update_query(["pooler"]).render_as_string(False)
    runs = [
        run_busctl("--db", unsaid, "enqueue", "--agent", "codex", "--models", "sim/a", f"t{i}")
        for i in range(3)
    ]
    refused = [done for done in runs if done.returncode != 0]  # type: ignore[attr-defined]
    assert refused, "every enqueue went through a pooler that loses prepared statements"
    for done in refused:
        lines = done.stderr.strip().splitlines()  # type: ignore[attr-defined]
        assert done.returncode == 2 and len(lines) == 1, lines  # type: ignore[attr-defined]
        assert "pooler = transaction" in lines[0] and "Traceback" not in lines[0]
    with AgentBus(unsaid) as bus, pytest.raises(ConfigError, match="pooler = transaction"):
        bus.enqueue("codex", "api", models=["sim/a"])
    commands = [task.command for task in reads.list_tasks(queue.db, agent="codex")]
    assert len(commands) == len(runs) - len(refused) and "api" not in commands


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
def test_busctl_migrates_through_the_pooler(
    empty_db_url: str, run_busctl: Callable[..., object]
) -> None:
    """Alembic's upgrade is one transaction and keeps nothing in the session: it runs
    through a transaction pooler as directly, and the schema is then in use."""
    done = run_busctl("--db", empty_db_url, "migrate")
    assert done.returncode == 0, done.stderr  # type: ignore[attr-defined]
    done = run_busctl("--db", empty_db_url, "migrate")  # at head: nothing to do
    assert done.returncode == 0, done.stderr  # type: ignore[attr-defined]
    enqueued = run_busctl("--db", empty_db_url, "enqueue", "--agent", "a", "--models", "sim/a", "x")
    assert enqueued.returncode == 0, enqueued.stderr  # type: ignore[attr-defined]
    db = Database(empty_db_url)
    try:
        task = TaskQueue(db).get(int(enqueued.stdout.strip()))  # type: ignore[attr-defined]
        assert task.status == "queued"
    finally:
        db.dispose()


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
def test_a_listen_url_lost_mid_run_is_said_once_and_the_worker_polls(
    db_url: str, queue: TaskQueue, spawn: Spawn
) -> None:
    """The worker listens through a route of its own (here a second PgBouncer); when
    that route goes, it says so once however often it tries again, and it finds a task
    queued meanwhile by looking, long before its next claim (--poll 60)."""
    dbname = sa.make_url(db_url).database or ""
    with pgbouncer.pgbouncer(PG_URL) as route:
        listen = route.url(dbname, pooler=False)
        env = {"AGENTBUS_LOG_LEVEL": "DEBUG"}
        args = ("--agent", "codex", "--db", db_url, "--listen-url", listen, "--poll", "60")
        proc = spawn("worker", *args, "--log-json", env=env)
        wait_until(lambda: worker_name(proc) in [row[-1] for row in route.admin("SHOW CLIENTS")])
    # Gone: every try fails; a task queued now is found by the worker's looks.
    task = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/noop",))).id
    wait_until(lambda: queue.get(task).status == "done", timeout=30)

    def unavailable(level: str) -> list[dict[str, object]]:
        said = [e for e in proc.events() if e.get("event") == "wakeups_unavailable"]
        return [e for e in said if e["level"] == level]

    wait_until(lambda: unavailable("debug"), timeout=30)  # it has tried again since
    assert len(unavailable("warning")) == 1
    assert proc.popen.poll() is None
    assert "Traceback" not in proc.text()


@pytest.mark.parametrize("backend", POSTGRES, indirect=True)
def test_serve_names_its_connections(
    backends: Backends, backend: str, db_url: str, spawn: Spawn
) -> None:
    import httpx

    from tests.support import free_port

    port = free_port()
    proc = spawn("busctl", "--db", db_url, "serve", "--port", str(port))

    def answers() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(answers, timeout=30)
    assert held_by(backends, backend, db_url, "agentbus-serve") >= 1
    assert held_by(backends, backend, db_url, "agentbus-busctl") == 0
    assert proc.popen.poll() is None


def test_a_fleet_over_a_small_servers_connections_drains_every_task_once(spawn: Spawn) -> None:
    """The server lets the fleet have 6 connections (max_connections 8, 2 kept for
    superusers) and the fleet asks for more: see ``drain_over_the_limit``."""
    from tests.pg_cluster import throwaway_cluster

    settings = {"max_connections": 8, "superuser_reserved_connections": 2}
    with throwaway_cluster(settings=settings) as (admin_url, _restart):
        with psycopg.connect(_conninfo(admin_url), autocommit=True) as admin:
            admin.execute("CREATE ROLE fleet LOGIN")
            for kind in ("TABLES", "SEQUENCES"):
                admin.execute(f"GRANT ALL ON ALL {kind} IN SCHEMA public TO fleet")
        url = sa.make_url(admin_url).set(username="fleet").render_as_string(False)
        held = [psycopg.connect(_conninfo(url), autocommit=True) for _ in range(5)]
        refused = drain_over_the_limit(spawn, admin_url, url, held)
    assert any("remaining connection slots are reserved" in text for text in refused)


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
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


def _conninfo(url: str) -> str:
    return sa.make_url(url).set(drivername="postgresql").render_as_string(False)


@pytest.mark.parametrize("backend", POSTGRES[1:], indirect=True)
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


@contextlib.contextmanager
def role_allowed(db_url: str, connections: int) -> Iterator[str]:
    """``db_url`` as a role of its own that the server lets open only ``connections``
    at once: a process that ever asks for one more is refused, and logs ``db_retry``."""
    url = sa.make_url(db_url)
    role = f"only{connections}_{url.database}"
    with psycopg.connect(_conninfo(db_url), autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} LOGIN CONNECTION LIMIT {connections}")
        for kind in ("TABLES", "SEQUENCES"):
            admin.execute(f"GRANT ALL ON ALL {kind} IN SCHEMA public TO {role}")
        try:
            yield url.set(username=role).render_as_string(False)
        finally:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,)
            )
            admin.execute(f"DROP OWNED BY {role}")
            admin.execute(f"DROP ROLE {role}")


@pytest.mark.parametrize("backend", POSTGRES[:1], indirect=True)
def test_a_sweeper_never_opens_a_second_connection(db_url: str, spawn: Spawn) -> None:
    """The sweeper, as a role the server allows one connection, resumes due pauses,
    rescues expired claims and demotes old pauses pass after pass, never refused."""
    db = Database(db_url)
    queue = TaskQueue(db)
    long_ago = time.time() - 49 * 3600
    specs = [TaskSpec(agent="codex", command=str(i), models=("sim/a",)) for i in range(60)]
    ids = queue.enqueue_many(specs)
    claimed = queue.claim("codex", "w", 60, limit=60)
    for task in claimed[:20]:  # due now
        queue.pause(task.id, task.claim_token, time.time() - 1, "cooldown", model="sim/a")
    for task in claimed[20:40]:  # paused 49 h ago, not due again for an hour
        TaskQueue(db, clock=lambda: long_ago).pause(
            task.id, task.claim_token, time.time() + 3600, "cooldown", model="sim/a"
        )
    expired = [t.id for t in claimed[40:]]
    db.write(
        lambda conn: conn.exec_driver_sql(
            "UPDATE bus_commands SET lease_until = 0 WHERE id = ANY(%(ids)s)", {"ids": expired}
        )
    )
    try:
        with role_allowed(db_url, 1) as url:
            sweeper = spawn("sweeper", "--db", url, "--interval", "0.2")
            wait_until(lambda: sweeper.text().count("sweep_pass") >= 5, timeout=60)
            sweeper.signal(signal.SIGTERM)
            assert sweeper.wait(30) == 0
        statuses = Counter(queue.get(i).status for i in ids)
    finally:
        db.dispose()
    assert statuses == {"queued": 40, "failed": 20}, statuses
    for unwanted in ("db_retry", "sweep_job_failed", "clock_unmeasured", "Traceback"):
        assert unwanted not in sweeper.text()


@pytest.mark.parametrize("backend", POSTGRES, indirect=True)
def test_db_connections_bounds_a_busy_worker(
    backends: Backends, backend: str, db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    """db_connections = 1: a worker running 4 calls at once shares one connection among
    its slots and its watchdog, and drains them all."""
    gates = [tmp_path / f"gate{i}" for i in range(4)]
    ids = enqueue_held(queue, gates)
    env = {"AGENTBUS_DB_CONNECTIONS": "1"}
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--concurrency", "4", env=env)
    wait_until(lambda: len(waiting(gates)) == 4, timeout=60)
    listener = 0 if isinstance(backend, Pooled) else 1
    assert held_by(backends, backend, db_url, worker_name(proc)) <= 1 + listener
    for gate in gates:
        gate.touch()
    wait_until(lambda: all(queue.get(i).status == "done" for i in ids), timeout=60)
    assert held_by(backends, backend, db_url, worker_name(proc)) <= 1 + listener
    proc.signal(signal.SIGTERM)
    assert proc.wait() == 0


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("0", "whole number of 1 or more"),
        ("-2", "whole number of 1 or more"),
        ("many", "whole number of 1 or more"),
        ("1.5", "whole number of 1 or more"),
        ("7", "more than a worker with concurrency 4 can use (6)"),
    ],
)
def test_a_db_connections_that_cannot_be_is_one_line(
    db_url: str, queue: TaskQueue, spawn: Spawn, value: str, said: str
) -> None:
    task = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",)))
    env = {"AGENTBUS_DB_CONNECTIONS": value}
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--concurrency", "4", env=env)
    assert proc.wait() == 2
    lines = proc.text().strip().splitlines()
    assert len(lines) == 1 and said in lines[0] and "db_connections" in lines[0], lines
    assert queue.get(task.id).status == "queued" and queue.get(task.id).attempts == 0


@pytest.mark.parametrize("backend", POSTGRES[:1], indirect=True)
def test_a_connect_timeout_that_is_not_a_number_is_one_line(
    db_url: str, queue: TaskQueue, run_busctl: Callable[..., object]
) -> None:
    """In the URL (libpq's connect_timeout) or as the setting: one line, exit 2, and the
    enqueue writes nothing."""
    args = ("enqueue", "--agent", "codex", "--models", "sim/a", "x")
    bad_url = sa.make_url(db_url).update_query_dict({"connect_timeout": "soon"})
    for url, env in (
        (bad_url.render_as_string(False), {}),
        (db_url, {"AGENTBUS_DB_CONNECT_TIMEOUT_SEC": "soon"}),
        (db_url, {"AGENTBUS_DB_CONNECT_TIMEOUT_SEC": "0"}),
    ):
        done = run_busctl("--db", url, *args, env=env)
        lines = done.stderr.strip().splitlines()  # type: ignore[attr-defined]
        assert done.returncode == 2 and len(lines) == 1, lines  # type: ignore[attr-defined]
        assert "connect_timeout" in lines[0], lines
    assert reads.list_tasks(queue.db, agent="codex") == []
    good = sa.make_url(db_url).update_query_dict({"connect_timeout": "3"})
    done = run_busctl("--db", good.render_as_string(False), *args)
    assert done.returncode == 0, done.stderr  # type: ignore[attr-defined]
