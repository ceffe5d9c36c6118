"""Engines, transactions and the one place transient database errors are retried.

SQLite runs in WAL mode with a busy timeout, and every write transaction
starts with ``BEGIN IMMEDIATE`` so that two writers queue on the lock instead
of failing on a lock upgrade (``agentbus.db.sqlite``). Postgres
connections are checked before use. A unit of work is a function of a
connection; :meth:`Database.write` and :meth:`Database.read` run it in one
transaction and run it again, from the start, when the database reports a
transient error (locked, busy, connection lost, serialization failure, server
restarting).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine

from agentbus.clock import clock_for
from agentbus.config import POOLERS
from agentbus.db.compiled import Prepared, prepared
from agentbus.db.errors import (
    EPISODE,
    first_line,
    is_full,
    is_transient,
    log_first_failure,
    log_retry,
    pooler_hint,
)
from agentbus.db.pinned import Pinned
from agentbus.errors import BusError, ConfigError, DatabaseUnavailable, NotMigrated
from agentbus.logging import get_logger

if TYPE_CHECKING:
    import tenacity

T = TypeVar("T")
log = get_logger("agentbus.db")


def parse_url(raw: str) -> URL:
    """Parse a database URL, defaulting Postgres to the psycopg 3 driver."""
    try:
        url = sa.make_url(raw)
    except sa.exc.ArgumentError:
        raise BusError(
            "invalid database URL: expected sqlite:///FILE or postgresql+psycopg://USER@HOST/DB"
        ) from None
    if url.drivername in {"postgres", "postgresql"}:
        url = url.set(drivername="postgresql+psycopg")
    if url.get_backend_name() not in {"sqlite", "postgresql"}:
        raise BusError(
            f"unsupported database {url.get_backend_name()!r}: use sqlite:///FILE "
            "or postgresql+psycopg://USER@HOST/DB"
        )
    if url.get_backend_name() == "postgresql":
        pooler = url.query.get("pooler")
        if pooler is not None:
            check_pooler(pooler if isinstance(pooler, str) else ",".join(pooler), "?pooler=")
        if url.get_driver_name() != "psycopg":
            raise BusError("use the psycopg 3 driver: postgresql+psycopg://USER@HOST/DB")
        if importlib.util.find_spec("psycopg") is None:
            raise BusError("PostgreSQL needs the psycopg driver: pip install 'agentbus[postgres]'")
    return url


def check_pooler(value: str, where: str = "setting pooler ") -> str:
    if value not in POOLERS:
        raise BusError(f"{where}{value!r} is not known: use {' or '.join(POOLERS)}")
    return value


def _split_pooler(url: URL) -> tuple[URL, str | None]:
    """The URL without its ``pooler`` query argument (psycopg would pass it on to the
    server), and that argument's value."""
    value = url.query.get("pooler")
    if value is None:
        return url, None
    return url.difference_update_query(["pooler"]), value if isinstance(value, str) else value[0]


def redact(raw: str | URL) -> str:
    """The URL with any password masked: safe for logs and error messages."""
    if isinstance(raw, URL):
        return raw.render_as_string(hide_password=True)
    try:
        return sa.make_url(raw).render_as_string(hide_password=True)
    except sa.exc.ArgumentError:
        return "<unparseable URL>"


_JSON_DECODE = json.JSONDecoder().decode


def _json_loads(data: bytes | str) -> Any:
    """PostgreSQL's JSON values as psycopg hands them over (bytes), read without
    ``json.loads``' sniffing of their encoding: the server sends UTF-8. A claimed task's
    payload and models go through it."""
    return _JSON_DECODE(data.decode() if isinstance(data, bytes) else data)


def pooled_name(name: str, pooler: str) -> str:
    """The ``application_name`` of a connection: behind a transaction pooler the kind of
    process alone (``agentbus-worker``, not ``agentbus-worker:codex:host:pid``). PgBouncer
    gives each transaction a server connection whose name it first sets to the client's,
    one statement more whenever the last client had another: with a name per process
    nearly every transaction of a fleet pays it (an idle fleet of 200 workers: 470
    transactions a second at the server instead of 246)."""
    return name.split(":", 1)[0] if pooler == "transaction" else name


class Database:
    """One database: its engine, its dialect, and retried transactions."""

    def __init__(
        self,
        url: str,
        *,
        retry_for: float = 30.0,
        sqlite_busy_timeout_ms: int = 5000,
        sqlite_synchronous: str = "FULL",
        pool_size: int = 5,
        no_bitmap_scans: bool = False,
        pooler: str = "none",
        listen_url: str | None = None,
        application_name: str = "agentbus-api",
        connections: int = 3,
        full_wait_sec: float | None = 30.0,
        connect_timeout: float = 10.0,
    ) -> None:
        """``no_bitmap_scans``: a worker's engine (PostgreSQL). Its statements find rows by
        key or through the partial indexes of claimed, queued and open states, whose
        entries a change of state leaves behind until VACUUM: a plain index scan marks
        them dead as it passes them, a bitmap scan reads every one again (completing
        10 claims read 3,000 such entries after 3,000 tasks, ~0.3 ms a batch).

        PostgreSQL only: ``connections`` is the most this process opens (a listener's
        besides): from 3 on, two kept for the hot path (``Pinned``: its transactions and
        its autocommit statements), one kept in the pool, the rest opened under load and
        closed when it passes. ``pooler`` (or the URL's
        ``?pooler=transaction``) says a transaction pooler stands in front of the server:
        no statement is prepared on the server, nothing is set for a session, and no
        process LISTENs through it (``listen_url``, a direct connection, does).
        ``application_name`` names every connection in ``pg_stat_activity`` (behind a
        pooler its kind alone: ``pooled_name``).

        A server or pooler that refuses a connection because every one is taken
        (``is_full``) is waited out for ``full_wait_sec`` (None: as long as it takes, as
        the services do), whatever ``retry_for`` allows other transient errors."""
        self.url, in_url = _split_pooler(parse_url(url))
        self.dialect = self.url.get_backend_name()
        self.pooler = "transaction" if "transaction" in (in_url, check_pooler(pooler)) else "none"
        own = self.url.query.get("application_name")
        self.application_name = own if isinstance(own, str) else application_name
        #: Where this process LISTENs (PostgreSQL; None: nowhere, it polls).
        self.listen_conninfo: str | None = None
        #: The fleet's clock (PostgreSQL: the database's; SQLite: this host's).
        self.clock: Callable[[], float] = clock_for(self)
        self.retry_for = retry_for
        self.connections = max(connections, 1)
        self.full_wait_sec = full_wait_sec
        self._synchronous = sqlite_synchronous.upper()
        self._relaxed: str | None = None
        self._writers: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
        if self.dialect == "sqlite":
            # Imported here only: a PostgreSQL process never loads sqlite3 (~1 MB resident).
            from agentbus.db import sqlite as sqlite_engine

            self._relaxed = sqlite_engine.relaxed(sqlite_synchronous)
            self.engine = sqlite_engine.engine(
                self.url, sqlite_busy_timeout_ms, sqlite_synchronous, pool_size
            )
            if (path := self.sqlite_path()) is not None:
                self._writers = sqlite_engine.WriterTurns(path)
            # Held for the write transactions: the module is not looked up at each one.
            self._on_driver = sqlite_engine.in_driver_transaction
            self._at_level = sqlite_engine.synchronous
        else:
            connect_args: dict[str, Any] = {}
            # Whole seconds, 2 at least (as psycopg keeps it); the URL's own wins, checked.
            self._connect_timeout = _connect_timeout(self.url, connect_timeout)
            connect_args["connect_timeout"] = self._connect_timeout
            if "application_name" not in self.url.query:  # the user's own name wins
                connect_args["application_name"] = pooled_name(application_name, self.pooler)
            if self.pooler == "transaction":
                # psycopg prepares a statement run often, and Prepared asks it to at once:
                # with no threshold it never does (a prepared statement lives in a session).
                connect_args["prepare_threshold"] = None
            # Pinned's connection is one of the pool's, checked out for good.
            self.engine = sa.create_engine(
                self.url,
                pool_size=1,
                max_overflow=max(connections - 1, 0),
                pool_timeout=max(retry_for, 1.0),
                connect_args=connect_args,
                json_deserializer=_json_loads,
            )
            if no_bitmap_scans and self.pooler == "none":  # a session's setting
                sa.event.listen(self.engine, "connect", _no_bitmap_scans)
            if listen_url:
                listen, said = _split_pooler(parse_url(listen_url))
                if said == "transaction" or (self.pooler == "transaction" and listen == self.url):
                    # A LISTEN through the pooler would be lost with its transaction.
                    raise ConfigError(
                        "listen_url must reach PostgreSQL directly, not through the "
                        "transaction pooler of the database URL"
                    )
                self.listen_conninfo = _conninfo(listen, _connect_timeout(listen, connect_timeout))
            elif self.pooler == "none":
                self.listen_conninfo = _conninfo(self.url, self._connect_timeout)
        if self.dialect == "postgresql":
            # A read is one statement or a report: autocommit spares BEGIN and COMMIT
            # (two of the three round trips of a lone SELECT).
            self._read_engine = self.engine.execution_options(isolation_level="AUTOCOMMIT")
        else:
            self._read_engine = self.engine.execution_options(agentbus_read_only=True)
        #: The one connection kept out of the pool for the hot writes (a worker's
        #: settle-and-claim, enqueues): taken at its first use, closed by ``dispose``.
        self.pinned = Pinned(self, enabled=self.dialect == "sqlite" or connections >= 3)

    @classmethod
    def from_settings(
        cls,
        settings: Any,
        *,
        threads: int = 1,
        no_bitmap_scans: bool = False,
        name: str = "agentbus-api",
        connections: int = 3,
        service: bool = False,
    ) -> Database:
        """The database of ``settings``, its pool sized for ``threads`` that use it at once
        (besides a worker's watchdog and its claims); on PostgreSQL at most ``connections``
        of its own, each named ``name``. A ``service`` (worker, sweeper, serve) waits out
        a full server or pooler however long it lasts; busctl and the producer API for
        the setting ``db_full_wait_sec``."""
        return cls(
            settings.database_url,
            retry_for=settings.db_retry_sec,
            sqlite_busy_timeout_ms=settings.sqlite_busy_timeout_ms,
            sqlite_synchronous=settings.sqlite_synchronous,
            pool_size=pool_size_for(threads),
            no_bitmap_scans=no_bitmap_scans,
            pooler=settings.pooler,
            listen_url=settings.listen_url or None,
            application_name=name,
            connections=connections,
            full_wait_sec=None if service else settings.db_full_wait_sec,
            connect_timeout=settings.db_connect_timeout_sec,
        )

    def __repr__(self) -> str:
        return f"Database({redact(self.url)})"

    def spare_connection(self) -> bool:
        """Whether this process may open or take one more connection now, without
        waiting for one of its own to come back (PostgreSQL; SQLite: always)."""
        if self.dialect != "postgresql":
            return True
        taken: int = self.engine.pool.checkedout()  # type: ignore[attr-defined]
        return taken < self.connections

    def write(self, work: Callable[[Connection], T], *, durable: bool = True) -> T:
        """Run ``work`` in one write transaction, retrying transient errors.

        ``durable=False``: a transaction whose loss in a crash of the machine is
        harmless (admission's slots, which are leases). On SQLite its commit does not
        wait for the disk (``synchronous`` NORMAL for it alone: in WAL mode it still
        survives the crash of any process). On PostgreSQL the statements of such a
        transaction say so themselves (``admission.slots.ASYNC_COMMIT``)."""
        return self._retrying(lambda: self._write_once(work, durable))

    def _write_once(self, work: Callable[[Connection], T], durable: bool) -> T:
        # The pool's work (checking a connection out and back in) outside the writers'
        # turn: the turn lasts from BEGIN IMMEDIATE to COMMIT only.
        with self.engine.connect() as conn:
            return self._transaction(conn, work, durable)

    def _transaction(
        self, conn: Connection, work: Callable[[Connection], T], durable: bool = True
    ) -> T:
        """``work`` in one write transaction on ``conn``, in the writers' turn. SQLite's
        begins and ends on the driver (``db.sqlite.in_driver_transaction``: a short
        transaction costs less without SQLAlchemy's transaction object and events)."""
        with self._writers:
            if self.dialect == "sqlite":
                if durable or self._relaxed is None:
                    return self._on_driver(conn, work)
                with self._at_level(conn, self._relaxed, self._synchronous):
                    return self._on_driver(conn, work)
            with conn.begin():
                return work(conn)

    def prepared(self, statement: Any) -> Prepared:
        """``statement`` compiled for this database, once (see ``Prepared``)."""
        return prepared(self.engine.dialect, statement)

    def write_one(self, work: Callable[[Connection], T]) -> T:
        """PostgreSQL: run ``work``, one statement, in autocommit, retrying transient
        errors: the statement is its own transaction, so BEGIN and COMMIT cost no round
        trip of their own. (SQLite: as ``write``.)"""
        if self.dialect != "postgresql":
            return self.write(work)
        return self._retrying(lambda: self._once(self._read_engine, work))

    def read(self, work: Callable[[Connection], T]) -> T:
        """Run ``work`` in one read-only transaction, retrying transient errors."""
        return self._retrying(lambda: self._once(self._read_engine, work))

    @staticmethod
    def _once(engine: Engine, work: Callable[[Connection], T]) -> T:
        with engine.begin() as conn:
            return work(conn)

    def _retrying(
        self, fn: Callable[[], T], when: Callable[[BaseException], bool] = is_transient
    ) -> T:
        try:  # the common case pays nothing for the retry machinery
            result = fn()
        except Exception as exc:
            if not when(exc):
                hint = pooler_hint(exc)
                if hint is not None:
                    raise ConfigError(hint) from None
                raise
            log_first_failure(exc)
        else:
            EPISODE.answered()
            return result
        import tenacity  # only once a transient error happened

        def stop(state: tenacity.RetryCallState) -> bool:
            """A full server for ``full_wait_sec``; anything else for ``retry_for``."""
            failed = state.outcome.exception() if state.outcome else None
            limit = self.full_wait_sec if failed is not None and is_full(failed) else self.retry_for
            return limit is not None and (state.seconds_since_start or 0.0) >= limit

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(when),
            stop=stop,
            # Up to 2 s apart, with jitter: a fleet refused at once does not come back
            # at once.
            wait=tenacity.wait_exponential(multiplier=0.02, max=2.0)
            + tenacity.wait_random(0, 0.25),
            before_sleep=self._before_retry,
            reraise=True,
        )
        try:
            result = retrying(fn)
        except sa.exc.DBAPIError as exc:
            if not is_full(exc):
                raise
            raise DatabaseUnavailable(
                f"{redact(self.url)} refused every connection for {self.full_wait_sec:g} s "
                f"(db_full_wait_sec): {first_line(exc.orig)}"
            ) from None
        EPISODE.answered()
        return result

    def _before_retry(self, state: tenacity.RetryCallState) -> None:
        log_retry(state)
        failed = state.outcome.exception() if state.outcome else None
        if failed is not None and is_full(failed):
            # Every process of a fleet may hold one connection and wait for a second:
            # the hot path's, while no one uses it, goes back for this or another one.
            self.pinned.give_back()

    def check_connection(self) -> None:
        """Fail fast, with one readable line, when the database cannot be reached (nor the
        ``listen_url``, when one is given). A server or pooler that is full (every
        connection taken) is waited for, up to ``full_wait_sec``: a fleet starting at
        once gets in as others leave."""

        def connect() -> None:
            with self.engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")

        try:
            self._retrying(connect, when=is_full)
        except sa.exc.DBAPIError as exc:
            raise DatabaseUnavailable(
                f"cannot connect to {redact(self.url)}: {first_line(exc.orig)}"
            ) from None
        own = _conninfo(self.url, self._connect_timeout) if self.dialect == "postgresql" else None
        if self.listen_conninfo is not None and self.listen_conninfo != own:
            import psycopg

            conninfo = self.listen_conninfo
            try:
                self._retrying(lambda: psycopg.connect(conninfo).close(), when=is_full)
            except psycopg.Error as exc:
                raise DatabaseUnavailable(
                    f"cannot connect to listen_url {redact(self.listen_conninfo)}: "
                    f"{first_line(exc)}"
                ) from None

    def current_revision(self) -> str | None:
        """The schema's Alembic revision (None: no agentbus schema), read without Alembic."""

        def work(conn: Connection) -> str | None:
            if not sa.inspect(conn).has_table("alembic_version"):
                return None
            return conn.exec_driver_sql("SELECT version_num FROM alembic_version").scalar()

        return self.read(work)

    def require_migrated(self) -> None:
        """Raise NotMigrated unless the schema is at the newest migration.

        A SQLite file that does not exist is reported, not created.
        """
        path = self.sqlite_path()
        if path is not None and not path.exists():
            raise NotMigrated(f"database file {path} does not exist: run `busctl migrate`")
        self.check_connection()
        from agentbus.migrations import HEAD as head

        current = self.current_revision()
        if current != head:
            state = "has no agentbus schema" if current is None else f"is at {current}"
            raise NotMigrated(
                f"database {redact(self.url)} {state}, not {head}: run `busctl migrate`"
            )

    def sqlite_path(self) -> Path | None:
        """The file of a SQLite database (None for Postgres or in-memory)."""
        if self.dialect != "sqlite" or self.url.database in (None, "", ":memory:"):
            return None
        return Path(self.url.database)

    def dispose(self) -> None:
        self.pinned.close()
        self.engine.dispose()


def _connect_timeout(url: URL, seconds: float) -> int:
    """libpq's ``connect_timeout`` for ``url``: its own, checked, else ``seconds``; whole
    seconds, 2 at least (as psycopg keeps it)."""
    own = url.query.get("connect_timeout")
    if own is None:
        return max(2, math.ceil(seconds))
    try:
        value = float(own) if isinstance(own, str) else math.nan
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(
            f"connect_timeout in the database URL must be a positive number of seconds, got {own!r}"
        )
    return max(2, math.ceil(value))


def _conninfo(url: URL, connect_timeout: int) -> str:
    """``url`` as libpq reads it (psycopg's own connections: listeners)."""
    url = url.update_query_dict({"connect_timeout": str(connect_timeout)})
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def dialect_insert(dialect: str) -> Any:
    """The dialect's INSERT, the one with ON CONFLICT (PostgreSQL's module is imported only
    when a PostgreSQL database asks: a SQLite process never loads it)."""
    if dialect == "postgresql":
        from sqlalchemy.dialects import postgresql

        return postgresql.insert
    from sqlalchemy.dialects import sqlite

    return sqlite.insert


def pool_size_for(threads: int) -> int:
    """Connections kept for ``threads`` running tasks: a task holds one only while it
    reads or writes (not during its model call), so past 16 they share."""
    return max(5, min(threads, 16) + 2)


def _no_bitmap_scans(dbapi_conn: Any, _record: Any) -> None:
    """PostgreSQL, as a connection opens: no bitmap scans for its whole session (set in
    autocommit, so that no transaction of the pool's can roll it back)."""
    autocommit = dbapi_conn.autocommit
    dbapi_conn.autocommit = True
    dbapi_conn.execute("SET enable_bitmapscan = off")
    dbapi_conn.autocommit = autocommit
