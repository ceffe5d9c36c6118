"""SQLite: its engine, the writers' turns, and transactions begun on the driver.

Every connection runs in WAL mode with a busy timeout and takes transaction
control from the driver: a write transaction begins with ``BEGIN IMMEDIATE``
(two writers queue on the lock instead of failing on a lock upgrade), a read
with ``BEGIN``. ``agentbus.db`` builds its SQLite databases from these.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sqlite3
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

T = TypeVar("T")

#: The primary result codes a unit of work is retried after: busy, locked.
RETRIED_CODES = frozenset({5, 6})


def engine(url: URL, busy_timeout_ms: int, synchronous: str, pool_size: int) -> Engine:
    """An engine for the SQLite file at ``url``: WAL, the busy timeout, ``synchronous``;
    BEGIN IMMEDIATE for every write transaction, BEGIN for reads."""
    in_memory = url.database in (None, "", ":memory:")  # one connection per thread anyway
    pool = {} if in_memory else {"pool_size": pool_size, "max_overflow": pool_size}
    made = sa.create_engine(url, connect_args={"timeout": busy_timeout_ms / 1000}, **pool)

    @sa.event.listens_for(made, "connect")
    def _on_connect(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        # Take transaction control away from the driver: we emit BEGIN ourselves.
        dbapi_conn.isolation_level = None
        cur = dbapi_conn.cursor()
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
        cur.execute(f"PRAGMA synchronous={synchronous.upper()}")
        cur.execute("PRAGMA foreign_keys=ON")
        cur.close()

    @sa.event.listens_for(made, "begin")
    def _on_begin(conn: Connection) -> None:
        driver: Any = conn.connection.dbapi_connection
        if driver.in_transaction:  # begun on the driver already (``in_driver_transaction``)
            return
        read_only = conn.get_execution_options().get("agentbus_read_only")
        statement(driver, "BEGIN" if read_only else "BEGIN IMMEDIATE")

    return made


def statement(driver: sqlite3.Connection, sql: str) -> None:
    """``sql`` on the driver's connection, an error raised as SQLAlchemy raises it
    (``is_transient`` knows "database is locked")."""
    try:
        driver.execute(sql)
    except sqlite3.Error as exc:
        raise sa.exc.DBAPIError.instance(sql, None, exc, sqlite3.Error) from exc


#: The ``synchronous`` levels above NORMAL: a commit at them waits for the disk.
_WAITING = frozenset({"FULL", "EXTRA", "2", "3"})


def relaxed(synchronous: str) -> str | None:
    """The level for a commit that need not wait for the disk, when ``synchronous`` makes
    commits wait: NORMAL, at which a commit in WAL mode survives the crash of any
    process but not of the machine (None: ``synchronous`` does not wait already)."""
    return "NORMAL" if synchronous.upper() in _WAITING else None


@contextlib.contextmanager
def synchronous(conn: Connection, level: str, configured: str) -> Iterator[None]:
    """``PRAGMA synchronous`` at ``level`` on ``conn``'s connection for the transactions
    inside, ``configured`` again after them; a connection whose level could not be set
    back is invalidated (closed, never pooled again)."""
    driver: Any = conn.connection.dbapi_connection
    statement(driver, f"PRAGMA synchronous={level}")
    try:
        yield
    finally:
        try:
            statement(driver, f"PRAGMA synchronous={configured}")
        except BaseException:
            conn.invalidate()
            raise


def in_driver_transaction(conn: Connection, work: Callable[[Connection], T]) -> T:
    """SQLite: ``work`` between a BEGIN IMMEDIATE and a COMMIT sent on the driver's
    connection. A hot path's transaction runs compiled statements on the driver's
    cursor (``Prepared``): SQLAlchemy's transaction around them (its object, its
    events) cost more than a short statement. A statement ``work`` executes through
    SQLAlchemy makes it begin a transaction of its own, whose BEGIN the engine's hook
    leaves out; it is committed here. On an error the transaction is rolled back here,
    before the caller's writers' turn ends."""
    driver: Any = conn.connection.dbapi_connection
    statement(driver, "BEGIN IMMEDIATE")
    try:
        result = work(conn)
    except BaseException:
        with contextlib.suppress(sqlite3.Error, sa.exc.SQLAlchemyError):  # the error goes on
            if conn.in_transaction():
                conn.rollback()  # SQLAlchemy's, which rolls the driver back
            else:
                driver.execute("ROLLBACK")
        raise
    if conn.in_transaction():
        conn.commit()
    else:
        statement(driver, "COMMIT")
    return result


class WriterTurns:
    """SQLite: the writers of one database file take turns through an ``flock`` on the
    file ``<database>-writer`` beside it (as ``-wal`` and ``-shm`` are).

    A writer waiting on SQLite's own lock polls with sleeps of 1, 2, 5, 10 … ms
    (its busy handler), so two busy workers spend much of their time asleep while
    the lock is free. Blocked on the ``flock``, a writer wakes the moment the other
    one commits. Threads of one process take turns on a lock of their own first
    (an ``flock`` is held per open file, not per thread). Writers that do not take
    this turn (an operator's ``sqlite3`` shell) still meet SQLite's lock and the
    busy timeout; where the file cannot be opened, SQLite's lock alone serializes.
    """

    def __init__(self, database: Path) -> None:
        self._path = database.with_name(database.name + "-writer")
        self._lock = threading.Lock()
        self._fd: int | None = None

    def __enter__(self) -> None:
        self._lock.acquire()
        try:
            if self._fd is None:
                self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            fcntl.flock(self._fd, fcntl.LOCK_EX)
        except OSError:  # no turns then: SQLite's lock still serializes
            pass

    def __exit__(self, *exc: object) -> None:
        try:
            if self._fd is not None:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except OSError:
            pass
        finally:
            self._lock.release()
