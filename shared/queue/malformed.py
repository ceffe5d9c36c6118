"""Rows written by hand that agentbus cannot use: which they are, and why.

Operators write SQL as well as read it. SQLite keeps whatever a column is given
(``'tomorrow'`` in a time, bytes in a name); PostgreSQL keeps NaN in a time, any
JSON in a JSON column, and NULL where no constraint forbids it. The schema's column
types read such a value as None or 0, so no reader crashes on it (``agentbus.schema``);
this module finds the rows in SQL, on what is stored, so that they are shown flagged
(``busctl tasks``, ``show``) and the sweeper takes them out of the way: a task that has
not ended is failed with the reason and an ``ops_todos`` entry, a cooldown or a worker
row is deleted. They are counted (``busctl status``, /metrics
``agentbus_malformed_rows``): the cooldowns and worker rows as they are, the tasks once
the sweeper failed them, until an operator resolves their todo. Counting the tasks not
yet ended at every scrape read them all (the backlog: 164 ms at 200,000 on
PostgreSQL); the sweeper reads them once a pass.

Only the rows that can hold work up are looked at: the tasks not yet ended, the
cooldowns, the workers. Ended tasks, events and todos are only read, and readers
take them as they come.
"""

from __future__ import annotations

import math
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.column_types import Integer, LenientJSON, Real, Text
from agentbus.queue.statements import in_state
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import NEEDED
from agentbus.schema import bus_commands as t
from agentbus.schema import model_cooldown, ops_todos, workers

#: The task states whose rows can hold work up (and the sweeper fails when malformed).
ACTIVE = (TaskStatus.QUEUED, TaskStatus.PAUSED, TaskStatus.CLAIMED)
SHOWN = 20  # malformed rows listed by the status document

_WHAT: dict[type, str] = {Integer: "a whole number", Real: "a finite number", Text: "text"}
_STORED: dict[type, tuple[str, ...]] = {
    Integer: ("integer",),
    Real: ("integer", "real"),
    Text: ("text",),
}


def _kind(column: sa.Column[Any]) -> type | None:
    for kind in (Integer, Real, Text, LenientJSON):
        if isinstance(column.type, kind):
            return kind
    return None


def _column_checks(table: sa.Table, dialect: str) -> list[tuple[Any, str]]:
    """(condition, problem) for each column: its value is not of the column's kind."""
    checks: list[tuple[Any, str]] = []
    for column in table.columns:
        kind = _kind(column)
        if column.primary_key or kind is None:
            continue
        if kind is LenientJSON:
            if dialect == "sqlite":
                bad = sa.and_(column.is_not(None), sa.func.json_valid(column) == 0)
                checks.append((bad, f"{column.name} is not JSON"))
            continue
        if dialect == "sqlite":
            stored = _STORED[kind] + (("null",) if column.nullable else ())
            checks.append(
                (sa.func.typeof(column).not_in(stored), f"{column.name} is not {_WHAT[kind]}")
            )
        if kind is Real:  # SQLite keeps an infinity (NaN is NULL), PostgreSQL both
            bounds = [math.inf, -math.inf] + ([math.nan] if dialect != "sqlite" else [])
            checks.append((column.in_(bounds), f"{column.name} is not a finite number"))
    return checks


def _json_shape(column: sa.Column[Any], shape: str, dialect: str) -> Any:
    """The column holds JSON of another shape than ``shape`` (object or array); null
    (JSON's or SQL's) is fine."""
    kind: sa.ColumnElement[Any] = sa.func.json_typeof(column)
    if dialect == "sqlite":
        kind = sa.case((sa.func.json_valid(column) == 1, sa.func.json_type(column)), else_=shape)
    return sa.and_(column.is_not(None), kind.not_in([shape, "null"]))


def problem(table: sa.Table, dialect: str) -> sa.ColumnElement[Any]:
    """SQL: the first problem of a row of ``table`` as text, NULL when it has none."""
    checks = _column_checks(table, dialect)
    if table is t:
        checks += [
            (_json_shape(t.c.payload, "object", dialect), "payload is not a JSON object"),
            (_json_shape(t.c.models, "array", dialect), "models is not a JSON list"),
        ]
        checks += [
            (sa.and_(t.c.status == state.value, t.c[name].is_(None)), f"{name} is missing")
            for state, name in NEEDED.items()
        ]
    if table is workers:
        checks.append(
            (_json_shape(workers.c.running, "array", dialect), "running is not a JSON list")
        )
    return sa.case(*checks, else_=sa.null())


def _key(table: sa.Table) -> sa.Column[Any]:
    (key,) = table.primary_key.columns
    return key


def found(conn: Connection, table: sa.Table, limit: int) -> list[dict[str, Any]]:
    """Up to ``limit`` malformed rows of ``table`` (tasks: those not ended), by key:
    ``{"table", "key", "problem"}`` (tasks also ``status`` and ``agent``). The tasks are
    read a state at a time through that state's partial index: the backlog, never the
    finished tasks (SQLite read the whole table for a list of states)."""
    if table is not t:
        return _found(conn, table, None, limit)
    rows = [row for state in ACTIVE for row in _found(conn, t, state, limit)]
    return sorted(rows, key=lambda row: row["key"])[:limit]  # task ids: whole numbers


def _found(
    conn: Connection, table: sa.Table, state: TaskStatus | None, limit: int
) -> list[dict[str, Any]]:
    rows = conn.execute(query(table, conn.dialect.name, state, limit)).mappings()
    return sorted(({"table": table.name, **row} for row in rows), key=lambda r: str(r["key"]))


def query(table: sa.Table, dialect: str, state: TaskStatus | None, limit: int) -> sa.Select[Any]:
    """Up to ``limit`` malformed rows of ``table`` (of tasks, those in ``state``). No
    ORDER BY: in key order the planners read every task by key for the few of one state
    (PostgreSQL: 0.55 s at 1 M tasks), not that state's index."""
    why = problem(table, dialect).label("problem")
    extra = [t.c.status, t.c.agent] if table is t else []
    scope = [] if state is None else [in_state(state)]
    inner = sa.select(_key(table).label("key"), why, *extra).where(*scope).subquery()
    return sa.select(inner).where(inner.c.problem.is_not(None)).limit(limit)


def counts(conn: Connection) -> dict[str, int]:
    """Malformed rows per table: the cooldowns and worker rows there are now (few rows,
    read whole), and the tasks the sweeper failed as malformed whose todo is open."""
    out = {}
    for table in (model_cooldown, workers):
        why = problem(table, conn.dialect.name)
        inner = sa.select(why.label("problem")).subquery()
        bad = sa.select(sa.func.count()).where(inner.c.problem.is_not(None))
        out[table.name] = int(conn.execute(bad.select_from(inner)).scalar_one())
    failed = sa.select(sa.func.count()).select_from(ops_todos).where(*_OPEN)
    out[t.name] = int(conn.execute(failed).scalar_one())
    return {table.name: out[table.name] for table in TABLES}


def summary(conn: Connection) -> dict[str, Any]:
    """The counts per table, and the first rows when there are any (a workspace with
    none, the usual one, costs a count per table). No reader that polls scans the tasks:
    those that are not ended are the sweeper's to look at, once a pass (``found``); what
    it found stays listed until an operator resolves its ``ops_todos`` row."""
    counted = counts(conn)
    return {"counts": counted, "rows": listed(conn) if any(counted.values()) else []}


def listed(conn: Connection, limit: int = SHOWN) -> list[dict[str, Any]]:
    """The first malformed rows, at most ``limit`` in all: the tasks the sweeper failed
    as malformed (open todos, newest first), then the cooldowns and worker rows."""
    todo = ops_todos.c
    failed = conn.execute(
        sa.select(todo.task_id, todo.why, todo.agent, t.c.status)
        .select_from(ops_todos.outerjoin(t, t.c.id == todo.task_id))
        .where(*_OPEN)
        .order_by(todo.id.desc())
        .limit(limit)
    ).all()
    rows: list[dict[str, Any]] = [
        {
            "table": t.name,
            "key": task_id,
            "problem": why.removeprefix("malformed: "),
            "status": status,
            "agent": agent,
        }
        for task_id, why, agent, status in failed
    ]
    for table in (model_cooldown, workers):
        rows += found(conn, table, limit - len(rows)) if len(rows) < limit else []
    return rows


def task_problems(conn: Connection, task_ids: list[int]) -> dict[int, str]:
    """Task id -> its problem, for those of ``task_ids`` that are malformed (any state)."""
    if not task_ids:
        return {}
    why = problem(t, conn.dialect.name).label("problem")
    inner = sa.select(t.c.id, why).where(t.c.id.in_(task_ids)).subquery()
    rows = conn.execute(sa.select(inner).where(inner.c.problem.is_not(None)))
    return {int(i): str(p) for i, p in rows}


TABLES = (t, model_cooldown, workers)
#: The open todos of tasks the sweeper failed as malformed.
_OPEN = (ops_todos.c.kind == "malformed", ops_todos.c.resolved_at.is_(None))
