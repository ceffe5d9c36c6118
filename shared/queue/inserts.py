"""The statements that insert: tasks (an enqueue), their events and routing rows, built once.

Like ``agentbus.queue.statements``, bind parameters for the values; only
``agentbus.queue`` executes them.
"""

from __future__ import annotations

from typing import Any

import sqlalchemy as sa

from agentbus.queue.statements import P_NOW
from agentbus.queue.states import TaskStatus
from agentbus.schema import bus_commands as t
from agentbus.schema import route_log, task_events


def insert_all(table: sa.Table) -> sa.Insert:
    """INSERT of one row of ``table``: a bind parameter per column but the key ``id``."""
    columns = [c for c in table.c if c.name != "id"]
    return sa.insert(table).values({c.name: sa.bindparam(c.name, type_=c.type) for c in columns})


#: One event row (``events.event``).
INSERT_EVENT = insert_all(task_events)
#: One routing row (``Route.row``).
INSERT_ROUTE = insert_all(route_log)

#: The columns an enqueue writes (``TaskQueue._row``).
ENQUEUED_COLUMNS = (
    "agent",
    "command",
    "payload",
    "models",
    "role",
    "status",
    "priority",
    "run_after",
    "max_attempts",
    "idempotency_key",
    "expires_at",
    "group_key",
    "created_at",
    "updated_at",
)

#: The columns an enqueue passes as JSON text (``TaskQueue.stored_row``).
JSON_TEXT_COLUMNS = ("payload", "models")

#: SQLite: insert one task (``p_<column>`` for each of ENQUEUED_COLUMNS; payload and models
#: as JSON text). Its id is the cursor's ``lastrowid``: a RETURNING clause would buffer the
#: row in a temporary table (~9 µs of an enqueue's CPU).
ENQUEUE_ONE_BINDS = tuple((f"p_{c}", c) for c in ENQUEUED_COLUMNS)  # (bind name, column)
ENQUEUE_ONE = sa.insert(t).values(
    {
        c: sa.bindparam(name, type_=sa.Text if c in JSON_TEXT_COLUMNS else t.c[c].type)
        for name, c in ENQUEUE_ONE_BINDS
    }
)

#: The per-task values of a PostgreSQL enqueue, with their types.
ENQUEUE_ARRAYS: dict[str, Any] = {
    "agent": sa.Text,
    "command": sa.Text,
    "payload": sa.Text,  # JSON text
    "models": sa.Text,  # JSON text or NULL
    "role": sa.Text,
    "priority": sa.Integer,
    "run_after": sa.Float,
    "max_attempts": sa.Integer,
    "expires_at": sa.Float,
    "group_key": sa.Text,
}


def _enqueue_postgres(*, single: bool) -> sa.Select[Any]:
    """PostgreSQL: insert tasks, their enqueue events and the idle workers' wake-up in one
    statement. Parameters: ``p_<name>`` for each ENQUEUE_ARRAYS entry (with ``single``
    the task's value, else an array of the tasks' values, in order) and ``p_now``.
    ``payload`` and ``models`` are JSON text (a payload's "\u0000" stays an escape:
    PostgreSQL refuses it decoded). Returns the new ids in order."""
    from agentbus.queue.wakeups import CHANNEL

    order: tuple[Any, ...] = ()
    if single:
        given: Any = sa.select(
            *(sa.bindparam(f"p_{n}", type_=e).label(n) for n, e in ENQUEUE_ARRAYS.items())
        ).subquery("given")
    else:  # an array per column, sent in binary
        given = (
            sa.func.unnest(
                *(sa.bindparam(f"p_{n}", type_=sa.ARRAY(e)) for n, e in ENQUEUE_ARRAYS.items())
            )
            .table_valued(*ENQUEUE_ARRAYS, with_ordinality="n")
            .render_derived(name="given")
        )
        order = (given.c.n,)  # ids are drawn in this order: RETURNING sorted by id keeps it
    rows = sa.select(
        given.c.agent,
        given.c.command,
        sa.cast(given.c.payload, sa.JSON),
        sa.cast(given.c.models, sa.JSON),
        given.c.role,
        sa.literal(TaskStatus.QUEUED.value, sa.Text),
        given.c.priority,
        given.c.run_after,
        given.c.max_attempts,
        sa.cast(given.c.expires_at, sa.Float),  # typed: a NULL alone would be text
        given.c.group_key,
        P_NOW,
        P_NOW,
    ).order_by(*order)
    columns = [c for c in ENQUEUED_COLUMNS if c != "idempotency_key"]  # in the order above
    new = sa.insert(t).from_select(columns, rows).returning(t.c.id, t.c.agent).cte("new")
    event = (
        sa.insert(task_events)
        .from_select(
            ["task_id", "to_status", "reason", "at"],
            sa.select(
                new.c.id,
                sa.literal(TaskStatus.QUEUED.value, sa.Text),
                sa.literal("enqueue", sa.Text),
                P_NOW,
            ),
        )
        .cte("event")
    )
    notified = sa.func.pg_notify(CHANNEL, new.c.agent).label("notified")
    return sa.select(new.c.id, notified).add_cte(event).order_by(new.c.id)


ENQUEUE_MANY_POSTGRES = _enqueue_postgres(single=False)
ENQUEUE_ONE_POSTGRES = _enqueue_postgres(single=True)
