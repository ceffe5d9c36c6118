"""Transient database errors are retried in one place; others are not."""

from __future__ import annotations

import sqlite3
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa
from structlog.testing import capture_logs

from agentbus.db import Database, parse_url, redact
from agentbus.db.compiled import Prepared
from agentbus.db.errors import Episode, is_transient
from agentbus.errors import BusError
from agentbus.migrations import migrate
from agentbus.queue import TaskQueue
from agentbus.queue.decisions import Complete, Settlement
from agentbus.queue.tasks import TaskSpec
from tests.conftest import PG_URL, Backends
from tests.support import FakeClock


def spec() -> TaskSpec:
    return TaskSpec(agent="codex", command="x", models=("sim/a",))


def test_sqlite_lock_contention_is_retried_not_raised(backends: Backends) -> None:
    url, handle = backends.new("sqlite")
    db = Database(url, sqlite_busy_timeout_ms=0, retry_for=30)
    holder = sqlite3.connect(str(handle), isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # another process holds the write lock
    released = threading.Event()

    def release_soon() -> None:
        released.wait(0.3)
        holder.execute("COMMIT")

    thread = threading.Thread(target=release_soon)
    thread.start()
    try:
        task_id = TaskQueue(db).enqueue(spec()).id
    finally:
        released.set()
        thread.join()
        holder.close()
    assert TaskQueue(db).get(task_id).command == "x"
    db.dispose()
    backends.drop(handle)


def test_postgres_connection_killed_between_calls_is_survived(backends: Backends) -> None:
    url, handle = backends.new("postgresql")
    db = Database(url)
    queue = TaskQueue(db)
    queue.enqueue(spec())
    with psycopg.connect(
        sa.make_url(PG_URL).set(drivername="postgresql").render_as_string(False), autocommit=True
    ) as admin:
        killed = admin.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (str(handle),),
        ).fetchone()
    assert killed is not None and killed[0] >= 1
    assert queue.enqueue(spec()).id == 2
    assert [task.id for task in queue.claim("codex", "w1", 60, limit=2)] == [1, 2]
    db.dispose()
    backends.drop(handle)


def admin_kill(database: object) -> None:
    with psycopg.connect(
        sa.make_url(PG_URL).set(drivername="postgresql").render_as_string(False), autocommit=True
    ) as admin:
        admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
            " WHERE datname = %s AND pid <> pg_backend_pid()",
            (str(database),),
        )


def test_a_prepared_statement_on_a_lost_connection_is_a_transient_error(backends: Backends) -> None:
    """The worker's prepared statements run on the driver's cursor: a lost connection
    still comes out as SQLAlchemy's error, invalidated, which the retry knows."""
    url, handle = backends.new("postgresql")
    db = Database(url)
    statement = Prepared(sa.select(sa.literal(1).label("one")), db.engine.dialect)
    with db.engine.connect() as conn:
        assert statement.rows(statement.execute(conn, {})) == [{"one": 1}]
        admin_kill(handle)
        with pytest.raises(sa.exc.DBAPIError) as raised:
            statement.execute(conn, {})
    assert raised.value.connection_invalidated and is_transient(raised.value)
    # The retry's connection (the pool's fresh one) runs it: nothing of the lost one is used.
    with db.engine.connect() as conn:
        assert statement.rows(statement.execute(conn, {})) == [{"one": 1}]
    db.dispose()
    backends.drop(handle)


def test_prepared_statements_take_turns_on_one_connection(db: Database) -> None:
    """Statements run one after another on the same connection each answer their own rows
    (on PostgreSQL they share the connection's cursor; each is read before the next)."""
    ints = Prepared(sa.select(sa.bindparam("p_n", type_=sa.Integer).label("n")), db.engine.dialect)
    texts = Prepared(sa.select(sa.bindparam("p_s", type_=sa.Text).label("s")), db.engine.dialect)
    with db.engine.connect() as conn:
        for i in range(3):
            assert ints.tuples(ints.execute(conn, {"p_n": i})) == [(i,)]
            assert texts.rows(texts.execute(conn, {"p_s": f"t{i}"})) == [{"s": f"t{i}"}]


def test_a_prepared_statement_writes_none_as_sqlalchemy_does(db: Database) -> None:
    """A None through a prepared statement's processors is stored as SQLAlchemy's own
    insert stores it: JSON ``null`` text in a JSON column, SQL NULL where the column says
    so (``none_as_null``) and in a number's; values still go through the processors."""
    table = sa.Table(
        "nones",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("doc", sa.JSON),
        sa.Column("doc_or_null", sa.JSON(none_as_null=True)),
        sa.Column("at", sa.Float),
    )
    table.create(db.engine)
    insert = Prepared(
        sa.insert(table).values(
            id=sa.bindparam("id"),
            doc=sa.bindparam("doc", type_=sa.JSON),
            doc_or_null=sa.bindparam("doc_or_null", type_=sa.JSON(none_as_null=True)),
            at=sa.bindparam("at", type_=sa.Float),
        ),
        db.engine.dialect,
    )
    rows = [
        {"id": 1, "doc": None, "doc_or_null": None, "at": None},
        {"id": 2, "doc": {"a": 1}, "doc_or_null": [1], "at": 1.5},
    ]

    def work(conn: sa.Connection) -> None:
        insert.execute_many(conn, rows)
        conn.execute(sa.insert(table), [{**r, "id": r["id"] + 10} for r in rows])

    db.write(work)
    as_text = sa.select(
        table.c.id, sa.cast(table.c.doc, sa.Text), sa.cast(table.c.doc_or_null, sa.Text), table.c.at
    ).order_by(table.c.id)
    with db.engine.connect() as conn:
        stored = [tuple(r) for r in conn.execute(as_text)]
    ours, theirs = stored[:2], [(i - 10, *rest) for i, *rest in stored[2:]]
    assert ours == theirs
    assert ours[0][1:] == ("null", None, None)
    assert ours[1][3] == 1.5


def test_transient_classification() -> None:
    locked = sa.exc.OperationalError("x", {}, sqlite3.OperationalError("database is locked"))
    syntax = sa.exc.OperationalError("x", {}, sqlite3.OperationalError("near 'x': syntax error"))
    dropped = sa.exc.OperationalError("x", {}, psycopg.OperationalError("server closed"))
    integrity = sa.exc.IntegrityError("x", {}, sqlite3.IntegrityError("UNIQUE"))
    assert is_transient(locked)
    assert is_transient(dropped)
    assert not is_transient(syntax)
    assert not is_transient(integrity)
    assert not is_transient(ValueError("x"))


def test_a_database_failing_is_said_once_when_it_begins_and_once_when_it_ends() -> None:
    """Ten minutes of retries from several threads are one warning and one line when
    the database answers again; the next outage is a new episode."""
    clock = FakeClock()
    episode = Episode(clock=clock)
    refused = sa.exc.OperationalError("SELECT 1", {}, Exception("too many clients already"))
    with capture_logs() as logs:
        for attempt in range(200):
            clock.advance(3)
            episode.failed(attempt, refused)
        episode.answered()
        episode.answered()  # a read in good times says nothing
        episode.failed(0, refused)
        episode.answered()
    said = [(e["event"], e["log_level"]) for e in logs if e["log_level"] != "debug"]
    assert said == [("db_retry", "warning"), ("db_back", "info")] * 2
    first_back = next(e for e in logs if e["event"] == "db_back")
    assert first_back["after_sec"] == 597 and first_back["failures"] == 200
    assert "too many clients already" in logs[0]["error"]


def test_urls() -> None:
    assert parse_url("postgresql://u@h/d").drivername == "postgresql+psycopg"
    assert parse_url("postgres://u@h/d").drivername == "postgresql+psycopg"
    assert redact("postgresql+psycopg://u:secret@h/d") == "postgresql+psycopg://u:***@h/d"
    with pytest.raises(BusError, match="psycopg 3"):
        parse_url("postgresql+psycopg2://u@h/d")
    with pytest.raises(BusError, match="invalid database URL"):
        parse_url("::")


def test_a_postgres_url_without_psycopg_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "psycopg", None)  # as if the extra were not installed
    with pytest.raises(BusError, match=r"pip install 'agentbus\[postgres\]'"):
        parse_url("postgresql+psycopg://u@h/d")
    assert parse_url("sqlite:///x.db").get_backend_name() == "sqlite"


def test_sqlite_runs_in_wal_mode(tmp_path: Path) -> None:
    db = Database(f"sqlite:///{tmp_path / 'x.db'}")
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA busy_timeout").scalar() == 5000
    db.dispose()


def test_sqlite_writers_take_turns_through_a_lock_file(tmp_path: Path) -> None:
    """A write waits while another process holds the writers' turn, and goes on the
    moment it is released (no sleep-and-retry of SQLite's busy handler)."""
    import fcntl
    import os

    path = tmp_path / "x.db"
    db = Database(f"sqlite:///{path}")
    migrate(db)
    queue = TaskQueue(db)
    fd = os.open(f"{path}-writer", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another writer's turn
    done = threading.Event()
    writer = threading.Thread(target=lambda: (queue.enqueue(spec()), done.set()))
    writer.start()
    try:
        assert not done.wait(0.3)  # held back by the turn, not by SQLite's lock
        assert TaskQueue(db).has_due("codex") is False
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    writer.join(timeout=30)
    assert done.is_set()
    assert TaskQueue(db).has_due("codex") is True
    db.dispose()


def test_a_write_that_need_not_be_durable_commits_without_waiting_for_the_disk(
    db: Database,
) -> None:
    """SQLite: ``durable=False`` runs that transaction at ``synchronous`` NORMAL and sets the
    configured level back after it, also when its work fails, on a pooled connection as on
    the kept one; every other write commits at the configured level. PostgreSQL leaves
    the setting alone (the statements of such a transaction say so themselves)."""

    def level(conn: sa.Connection) -> Any:
        if db.dialect == "sqlite":
            return conn.exec_driver_sql("PRAGMA synchronous").scalar()
        return conn.exec_driver_sql("SHOW synchronous_commit").scalar()

    def fails(conn: sa.Connection) -> None:
        raise RuntimeError("the unit of work fails")

    configured, relaxed = (2, 1) if db.dialect == "sqlite" else ("on", "on")  # FULL, NORMAL
    for write in (db.write, db.pinned.write):
        assert write(level) == configured
        assert write(level, durable=False) == relaxed
        assert write(level) == configured
        with pytest.raises(RuntimeError):
            write(fails, durable=False)
        assert write(level) == configured


def test_pinned_writes_are_transactions_and_single_statements_commit_alone(db: Database) -> None:
    """The kept connections: a ``write`` is one transaction (a failure undoes all of it)
    even after an autocommitted ``write_one`` took its connection first, and the reverse."""
    table = "pinned_probe"
    with db.engine.begin() as conn:
        conn.exec_driver_sql(f"CREATE TABLE {table} (n INTEGER)")

    def insert(n: int) -> None:
        def work(conn: sa.Connection) -> None:
            conn.exec_driver_sql(f"INSERT INTO {table} VALUES ({n})")

        db.pinned.write_one(work)

    def two_then_fail(conn: sa.Connection) -> None:
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (2)")
        conn.exec_driver_sql(f"INSERT INTO {table} VALUES (3)")
        raise RuntimeError("the unit of work fails")

    def on_the_driver(conn: sa.Connection, n: int = 5) -> None:  # none through SQLAlchemy
        conn.connection.dbapi_connection.execute(f"INSERT INTO {table} VALUES ({n})")  # type: ignore[union-attr]

    def on_the_driver_then_fail(conn: sa.Connection) -> None:
        on_the_driver(conn, 7)
        raise RuntimeError("the unit of work fails")

    insert(1)
    with pytest.raises(RuntimeError):
        db.pinned.write(two_then_fail)
    insert(4)
    with pytest.raises(RuntimeError):
        db.pinned.write(on_the_driver_then_fail)
    db.pinned.write(on_the_driver)
    db.pinned.write(lambda conn: conn.exec_driver_sql(f"INSERT INTO {table} VALUES (6)"))
    with db.engine.connect() as conn:
        kept = sorted(n for (n,) in conn.exec_driver_sql(f"SELECT n FROM {table}"))
    assert kept == [1, 4, 5, 6]


def test_a_workers_engine_never_plans_a_bitmap_scan(
    backends: Backends, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PostgreSQL: a worker completes claims through the partial index of claimed tasks,
    whose entries every completion leaves behind until VACUUM. On its engine
    (``no_bitmap_scans``) every connection plans plain index scans, which mark such
    entries dead as they pass them; a bitmap scan would read them all again, batch after
    batch. Other engines keep the server's setting."""
    url, handle = backends.new("postgresql")
    plain, worker = Database(url), Database(url, no_bitmap_scans=True)
    try:
        show = sa.text("SHOW enable_bitmapscan")
        for db, setting in ((plain, "on"), (worker, "off")):
            assert db.read(lambda conn: conn.execute(show).scalar()) == setting
            assert db.write(lambda conn: conn.execute(show).scalar()) == setting
            assert db.pinned.write_one(lambda conn: conn.execute(show).scalar()) == setting
        queue = TaskQueue(worker)
        queue.enqueue_many([TaskSpec(agent="a", command="t", models=("m",))] * 3010)
        acks: list[Settlement] = []
        for _ in range(301):  # 3,000 completions: 3,000 entries left behind
            _, tasks = queue.settle_and_claim(acks, "a", "w", 60, 10)
            acks = [Settlement(t.id, t.claim_token, Complete("ok")) for t in tasks]
        ran: list[tuple[Prepared, Any]] = []  # the next settle-and-claim's statement, as it runs
        execute = Prepared.execute

        def recorded(self: Prepared, conn: sa.Connection, values: Any) -> Any:
            ran.append((self, values))
            return execute(self, conn, values)

        monkeypatch.setattr(Prepared, "execute", recorded)
        queue.settle_and_claim(acks, "a", "w", 60, 10)
        monkeypatch.undo()
        ((statement, values),) = ran

        def plan(db: Database) -> list[str]:
            def explain(conn: sa.Connection) -> list[str]:
                cursor = psycopg.RawCursor(conn.connection.driver_connection)
                cursor.execute("EXPLAIN " + statement.sql, statement.params(values))
                return [line for (line,) in cursor.fetchall()]

            return db.read(explain)

        assert not [line for line in plan(worker) if "Bitmap" in line], plan(worker)
    finally:
        worker.dispose()
        plain.dispose()
        backends.drop(handle)


def test_a_server_that_never_answers_is_given_up_at_the_connect_timeout() -> None:
    """A host that accepts and says nothing (a hung server, a black-holed proxy) is a
    refused connection after db_connect_timeout_sec, not a process held for minutes."""
    import contextlib
    import socket

    from agentbus.errors import DatabaseUnavailable

    with contextlib.closing(socket.socket()) as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        db = Database(f"postgresql+psycopg://nobody@127.0.0.1:{port}/x", connect_timeout=2)
        try:
            with pytest.raises(DatabaseUnavailable, match="timeout"):
                db.check_connection()
        finally:
            db.dispose()
