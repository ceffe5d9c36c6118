"""Hot statements compiled once and run on the driver's own cursor.

A worker runs a few statements for every task; SQLAlchemy's work per execution
(cache key, parameter processing, result set-up) costs more than the
database's. ``prepared(dialect, statement)`` compiles an expression once per
dialect; ``Prepared`` runs it, its parameters and rows processed by the
statement's own types. Errors come out as SQLAlchemy raises them
(``DBAPIError``), so ``agentbus.db``'s retries know them.
"""

from __future__ import annotations

import copy
import operator
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection


class Prepared:
    """A statement compiled once for one dialect and run on the driver's own cursor.

    For the few statements a worker runs for every task: SQLAlchemy's work per
    execution (cache key, parameter processing, result set-up) costs more than
    the database's. The statement stays an SQLAlchemy expression, written once;
    only its compilation and its types' processors are looked up ahead. Run it
    inside a transaction of the same engine (``Database.write``).

    On PostgreSQL the statement is compiled with ``$n`` placeholders and run on
    psycopg's ``RawCursor`` as a server-side prepared statement: neither psycopg
    (which caches the parsing of short queries only) nor the server parses or
    plans it again.
    """

    def __init__(self, statement: Any, dialect: sa.Dialect) -> None:
        self._server_side = dialect.name == "postgresql"
        if self._server_side:
            dialect = copy.copy(dialect)  # the engine's own, with psycopg's native placeholders
            dialect.paramstyle, dialect.positional = "numeric_dollar", True
        compiled = _inline_constants(statement, dialect).compile(dialect=dialect)
        self.sql = compiled.string
        if "POSTCOMPILE" in self.sql:
            raise ValueError("a statement with expanding parameters cannot be prepared")
        binds = {compiled.bind_names[b]: b for b in compiled.binds.values()}
        self._defaults = {name: b.effective_value for name, b in binds.items() if not b.required}
        types = {name: b.type for name, b in binds.items()}
        names = compiled.positiontup if compiled.positional else list(binds)
        self._positional = bool(compiled.positional)
        self._names = list(names or ())
        self._binds = [(name, _processor(types[name], dialect)) for name in self._names]
        # The values gathered in one C call (``params``), and the few that need processing.
        self._gather = operator.itemgetter(*self._names) if len(self._names) > 1 else None
        # With each processor its answer for None, when that answer is a constant: a None
        # (an event's empty detail, a column left empty) takes no call.
        self._process = [
            (i, p, _none_of(p)) for i, (_, p) in enumerate(self._binds) if p is not None
        ]
        # Arrays go to psycopg in binary: a text array quotes and escapes each element with
        # a regular expression (a batch of ten completions: ~4x the client time).
        self._binary_arrays = self._server_side and any(
            isinstance(t, sa.ARRAY) for t in types.values()
        )
        columns = getattr(statement, "selected_columns", None)
        if columns is None:
            columns = statement.exported_columns
        self.columns = [c.key for c in columns]
        self._types = [c.type.dialect_impl(dialect) for c in columns]
        self._dialect = dialect
        # (column index, processor) of the columns whose values need reading, at the first rows
        self._results: list[tuple[int, Callable[[Any], Any]]] | None = None

    @property
    def names(self) -> list[str]:
        """The bind parameters' names, in the order the driver takes them (positional)."""
        return list(self._names)

    def params(self, values: Mapping[str, Any]) -> Any:
        """The driver's parameters from ``values`` (by bind name; literals filled in)."""
        gather = self._gather
        try:  # every value given, as on the hot path: gathered by one itemgetter
            out = list(gather(values)) if gather is not None else self._filled(values)
        except KeyError:  # some left to their defaults
            out = self._filled(values)
        for i, process, none in self._process:
            value = out[i]
            out[i] = process(value) if value is not None or none is _CALL else none
        return out if self._positional else dict(zip(self._names, out, strict=True))

    def _filled(self, values: Mapping[str, Any]) -> list[Any]:
        return [values[n] if n in values else self._defaults[n] for n in self._names]

    def execute(self, conn: Connection, values: Mapping[str, Any]) -> Any:
        """Run once; returns the driver's cursor."""
        return self.run(conn, self.params(values))

    def execute_many(self, conn: Connection, rows: Iterable[Mapping[str, Any]]) -> None:
        self.run_many(conn, [self.params(row) for row in rows])

    def run(self, conn: Connection, params: Any) -> Any:
        """Run once with the driver's parameters made already (``params``: made outside
        a transaction that should hold only its statements); returns the driver's cursor."""
        with _AsSQLAlchemyErrors(conn, self.sql, params):
            if not self._server_side:
                return _sqlite_cursor(conn).execute(self.sql, params)
            return _raw_cursor(conn, self._binary_arrays).execute(self.sql, params, prepare=True)

    def run_many(self, conn: Connection, params: list[Any]) -> None:
        """Run once per row of driver parameters made already (``params``)."""
        if params and self._server_side:
            with _AsSQLAlchemyErrors(conn, self.sql, params):
                _raw_cursor(conn, self._binary_arrays).executemany(self.sql, params)
        elif params:
            with _AsSQLAlchemyErrors(conn, self.sql, params):
                _sqlite_cursor(conn).executemany(self.sql, params)

    def rows(self, cursor: Any) -> list[dict[str, Any]]:
        """The cursor's rows as dicts by column, each value as SQLAlchemy would read it."""
        return self.dicts(self.fetch(cursor))

    def tuples(self, cursor: Any) -> list[tuple[Any, ...]]:
        """The cursor's rows, each value as SQLAlchemy would read it."""
        return self.read(self.fetch(cursor))

    def fetch(self, cursor: Any) -> list[tuple[Any, ...]]:
        """The cursor's rows as the driver gives them (``read`` or ``dicts`` them later,
        say once a transaction is over)."""
        rows = list(cursor.fetchall())
        if self._results is None:  # the driver's column types are known now
            processors = [
                type_.result_processor(self._dialect, described[1])
                for type_, described in zip(self._types, cursor.description, strict=True)
            ]
            self._results = [(i, p) for i, p in enumerate(processors) if p is not None]
        return rows

    def read(self, fetched: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Rows from ``fetch``, each value as SQLAlchemy would read it."""
        if not self._results:
            return fetched
        out = []
        for row in fetched:
            values = list(row)
            for i, process in self._results:  # only the columns whose type reads values
                values[i] = process(values[i])
            out.append(tuple(values))
        return out

    def dicts(self, fetched: list[tuple[Any, ...]]) -> list[dict[str, Any]]:
        """Rows from ``fetch`` as dicts by column, read as SQLAlchemy would."""
        return [dict(zip(self.columns, row, strict=True)) for row in self.read(fetched)]


def _inline_constants(statement: Any, dialect: sa.Dialect) -> Any:
    """``statement`` with its constants (the literal values SQLAlchemy binds as parameters:
    ``status = 'done'``, ``attempts + 1``) written into the SQL, cast to their type as
    their placeholders were: a run sends only the values that vary (a worker's
    settle-and-claim on PostgreSQL: 12 parameters instead of 31), and a plan made once
    for any values still knows the constants."""
    from sqlalchemy.sql import visitors

    def inline(element: Any, **kw: Any) -> Any:
        if (
            not isinstance(element, sa.BindParameter)
            or element.required
            or element.callable is not None
            or element.expanding
        ):
            return None
        value = element.value
        render = element.type.literal_processor(dialect)
        if value is None or render is None:
            return None
        return sa.cast(sa.literal_column(render(value)), element.type)

    opts: dict[str, Any] = {}
    return visitors.replacement_traverse(statement, opts, inline)


def at_once(
    conn: Connection, steps: Sequence[tuple[Prepared, Mapping[str, Any]]]
) -> list[list[tuple[Any, ...]]]:
    """PostgreSQL: ``steps`` as one transaction in one round trip, on a connection in
    autocommit (``Pinned.write_one``'s). The statements go to the server together
    (psycopg's pipeline mode) with one Sync after the last, and the server runs the
    statements before a Sync as one transaction, committed at the Sync: no ``BEGIN``
    and ``COMMIT`` to send (~120k fewer client instructions an admission). Each
    statement starts once the one before it has ended, in a snapshot of its own: a
    lock the first takes holds for the next, which sees what the lock's previous
    holder committed. Returns each step's rows, read. An error rolls the whole
    transaction back (the statements after it are skipped) and is raised as
    SQLAlchemy raises it; the caller then drops the connection."""
    params = [statement.params(values) for statement, values in steps]
    cursors = [_raw_cursor(conn, s._binary_arrays, slot=i) for i, (s, _) in enumerate(steps)]
    driver: Any = conn.connection.driver_connection
    with _AsSQLAlchemyErrors(conn, steps[-1][0].sql, params[-1]):
        with driver.pipeline():
            for cursor, (statement, _), values in zip(cursors, steps, params, strict=True):
                cursor.execute(statement.sql, values, prepare=True)
        return [s.read(s.fetch(c)) for c, (s, _) in zip(cursors, steps, strict=True)]


def can_run_at_once(dialect: sa.Dialect) -> bool:
    """Whether ``at_once`` runs on this engine's connections: PostgreSQL, through a libpq
    with pipeline mode (14 or newer)."""
    if dialect.name != "postgresql":
        return False
    import psycopg

    return bool(psycopg.Pipeline.is_supported())


def _raw_cursor(conn: Connection, binary_arrays: bool = False, slot: int = 0) -> Any:
    """psycopg's cursor for ``$n`` placeholders, on the connection ``conn`` holds (with
    ``binary_arrays``, sending Python lists as binary arrays; ``slot``: one of several
    whose results are read together, ``at_once``).

    Made once per database connection and kept with it (in the pool's ``info`` of the
    connection, which goes when the connection goes): a new cursor per execution
    costs more client time than the statement's round trip (its adapters are copied
    and its result's loaders looked up again). Callers read a cursor before they
    run the next statement."""
    driver = conn.connection.driver_connection
    kept: dict[tuple[bool, int], Any]
    kept = conn.connection.info.setdefault("agentbus_raw_cursors", {})
    cursor = kept.get((binary_arrays, slot))
    if cursor is None or cursor.connection is not driver or cursor.closed:
        import psycopg  # only ever here for a postgresql:// URL

        cursor = psycopg.RawCursor(driver)  # type: ignore[arg-type]
        kept[binary_arrays, slot] = cursor
        if binary_arrays:
            from psycopg.types.array import ListBinaryDumper

            cursor.adapters.register_dumper(list, ListBinaryDumper)
    return cursor


def _sqlite_cursor(conn: Connection) -> Any:
    """SQLite: the driver's cursor kept with the connection ``conn`` holds, as
    ``_raw_cursor`` keeps psycopg's (a new one through the pool's connection costs more
    than a short statement's own work). Callers read a cursor before they run the next
    statement."""
    driver: Any = conn.connection.dbapi_connection
    kept = conn.connection.info
    cursor = kept.get("agentbus_cursor")
    if cursor is None or cursor.connection is not driver:
        cursor = kept["agentbus_cursor"] = driver.cursor()
    return cursor


class _AsSQLAlchemyErrors:
    """A driver error raised as SQLAlchemy raises it (``DBAPIError``: what ``is_transient``
    and the callers know), invalidating the connection when it was lost. A class, not
    a generator: every statement of the hot path runs in one."""

    __slots__ = ("conn", "params", "sql")

    def __init__(self, conn: Connection, sql: str, params: Any) -> None:
        self.conn, self.sql, self.params = conn, sql, params

    def __enter__(self) -> None:
        return None

    def __exit__(self, _kind: object, exc: BaseException | None, _tb: object) -> None:
        conn = self.conn
        dbapi = conn.dialect.loaded_dbapi
        if exc is None or not isinstance(exc, dbapi.Error):
            return
        lost = conn.dialect.is_disconnect(exc, conn.connection.dbapi_connection, None)
        if lost:
            conn.invalidate(exc)
        raise sa.exc.DBAPIError.instance(
            self.sql,
            self.params,
            exc,
            dbapi.Error,
            connection_invalidated=lost,
            dialect=conn.dialect,
        ) from exc


_PREPARED: weakref.WeakKeyDictionary[sa.Dialect, dict[int, tuple[Any, Prepared]]] = (
    weakref.WeakKeyDictionary()
)


def prepared(dialect: sa.Dialect, statement: Any) -> Prepared:
    """``statement`` compiled for ``dialect`` (an engine's: ``conn.dialect``), once."""
    known = _PREPARED.setdefault(dialect, {})
    found = known.get(id(statement))
    if found is None or found[0] is not statement:
        found = known[id(statement)] = (statement, Prepared(statement, dialect))
    return found[1]


#: ``_none_of``: the processor's answer for None is not known ahead; call it.
_CALL = object()


def _none_of(process: Callable[[Any], Any]) -> Any:
    """What ``process`` makes of None, when that is an immutable constant (SQLAlchemy's
    processors are pure functions of the value: a number's gives None, JSON's ``'null'``
    or None), else ``_CALL``."""
    try:
        made = process(None)
    except Exception:
        return _CALL
    return made if made is None or type(made) in (str, int, float, bytes) else _CALL


def _processor(type_: Any, dialect: sa.Dialect) -> Callable[[Any], Any] | None:
    processor: Callable[[Any], Any] | None = type_.dialect_impl(dialect).bind_processor(dialect)
    return processor
