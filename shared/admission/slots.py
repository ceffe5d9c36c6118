"""Admission's statements on ``call_slots`` and the gates' transaction locks.

A limited call holds a row of ``call_slots`` from its admission to its release
(``agentbus.admission.admission`` is the only code that runs these). Each
statement is built once, its values bind parameters, and runs compiled
(``agentbus.prepared.prepared``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission.circuit import COUNT_SUCCESS, END_RUN
from agentbus.admission.limits import WINDOW_SEQ, next_in_window
from agentbus.prepared import prepared
from agentbus.schema import call_slots, circuit_calls

#: PostgreSQL: an admission holds a transaction lock on each gate it counts (the
#: class "admi", the gate's name hashed), so admissions through different
#: providers, accounts, bulkheads and agents never wait for each other.
LOCK_CLASS = 0x61646D69
# One round trip for all of them, taken in the array's order (a function scan's).
_KEYS = (
    sa.func.unnest(sa.bindparam("p_keys", type_=sa.ARRAY(sa.Text)))
    .table_valued("k", with_ordinality="i")
    .render_derived(name="u")
)
_LOCK = sa.select(
    sa.func.count(
        sa.func.pg_advisory_xact_lock(
            sa.bindparam("p_lock_class", type_=sa.Integer), sa.func.hashtext(_KEYS.c.k)
        )
    )
)


@functools.cache
def take(windows: tuple[str, ...]) -> sa.Insert:
    """Take a slot (the values: bind parameters named after the columns), numbered in
    each of ``windows`` (gates of ``limits.WINDOW_SEQ``, whose locks the admission
    holds); returns its id."""
    values: dict[str, Any] = {
        name: sa.bindparam(name, type_=call_slots.c[name].type)
        for name in (
            "provider",
            "account",
            "model",
            "agent",
            "bulkhead",
            "task_id",
            "worker",
            "admitted_at",
            "lease_until",
        )
    }
    for gate in windows:
        values[WINDOW_SEQ[gate].key] = next_in_window(gate, values)
    return sa.insert(call_slots).values(values).returning(call_slots.c.id)


#: Give a slot back. No row matched: the lease ran out and the sweeper purged it.
RELEASE = (
    sa.update(call_slots)
    .where(
        call_slots.c.id == sa.bindparam("p_id", type_=sa.BigInteger),
        call_slots.c.released_at.is_(None),
    )
    .values(released_at=sa.bindparam("p_now", type_=sa.Float))
)

#: PostgreSQL: a slot given back and a successful call counted in its circuit
#: (``circuit.COUNT_SUCCESS``, ``circuit.END_RUN``), in one statement.
RELEASE_AND_COUNT_SUCCESS_POSTGRES = END_RUN.add_cte(
    RELEASE.returning(call_slots.c.id).cte("released"),
    COUNT_SUCCESS.returning(circuit_calls.c.id).cte("counted"),
)


def lock_gates(conn: Connection, keys: Iterable[str]) -> None:
    """Lock the gates ``keys`` until the transaction ends (PostgreSQL; SQLite's one writer
    at a time serializes already). Always in sorted order: two admissions never deadlock."""
    wanted = sorted(set(keys))
    if wanted and conn.dialect.name == "postgresql":
        lock = prepared(conn.dialect, _LOCK)
        lock.execute(conn, {"p_lock_class": LOCK_CLASS, "p_keys": wanted}).fetchall()
