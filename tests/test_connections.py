"""PostgreSQL connections at fleet scale, direct and through PgBouncer in transaction mode:
each process holds few and names them (a full one: test_full_server.py)."""

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

from agentbus.db import Database, pooled_name
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from tests import pgbouncer
from tests.conftest import BACKENDS, PG_URL, Backends, Pooled, _pg_conninfo
from tests.support import Proc, conninfo, enqueue_held, wait_until, waiting

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]
POSTGRES = BACKENDS[1:]  # direct, and through the session's PgBouncer


def worker_name(proc: Proc, agent: str = "codex") -> str:
    return f"agentbus-worker:{agent}:{socket.gethostname()}:{proc.popen.pid}"


def held_by(backends: Backends, backend: str, url: str, name: str) -> int:
    """Connections named ``name`` open now to the database of ``url``: on the server
    (direct), or on the pooler as its clients (through PgBouncer, where a server
    connection serves whoever asks, and a process is named by its kind alone)."""
    dbname = sa.make_url(url).database
    if isinstance(backend, Pooled):
        rows = backends.bouncer().admin("SHOW CLIENTS")
        kind = pooled_name(name, "transaction")
        return sum(1 for row in rows if row[2] == dbname and row[-1] == kind)
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


@contextlib.contextmanager
def role_allowed(db_url: str, connections: int) -> Iterator[str]:
    """``db_url`` as a role of its own that the server lets open only ``connections``
    at once: a process that ever asks for one more is refused, and logs ``db_retry``."""
    url = sa.make_url(db_url)
    role = f"only{connections}_{url.database}"
    with psycopg.connect(conninfo(db_url), autocommit=True) as admin:
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


def test_behind_a_pooler_a_connection_is_named_by_its_kind_alone() -> None:
    """PgBouncer sets a server connection's name to its client's before the transaction
    whenever they differ: one name per kind spares a fleet that statement."""
    full = "agentbus-worker:codex:host:123"
    assert pooled_name(full, "transaction") == "agentbus-worker"
    assert pooled_name(full, "none") == full
    assert pooled_name("agentbus-sweeper", "transaction") == "agentbus-sweeper"
    db = Database(f"{PG_URL}?pooler=transaction", application_name=full)
    assert db.application_name == full  # a LISTEN on a direct listen_url keeps it whole
    db.dispose()
