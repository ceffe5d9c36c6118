"""Admission's statements on ``call_slots`` and the gates' transaction locks.

A limited call holds a row of ``call_slots`` from its admission to its release
(``agentbus.admission.admission`` is the only code that runs these). Each
statement is built once, its values bind parameters, and runs compiled
(``agentbus.db.compiled.prepared``).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission.circuit import COUNT_SUCCESS, END_RUN
from agentbus.admission.limits import (
    WINDOW_SEQ,
    Limits,
    admits,
    admitted_now,
    count_columns,
    next_in_window,
)
from agentbus.admission.routing import Candidate
from agentbus.admission.tokens import IN_TOKEN_WINDOW, OF_MODEL, TOKENS_OF, Tokens
from agentbus.db.compiled import Prepared, prepared
from agentbus.providers.outcomes import Outcome, Succeeded
from agentbus.schema import call_slots, circuit_calls

#: PostgreSQL: an admission holds a transaction lock on each gate it counts (the
#: class "admi", the gate's name hashed), so admissions through different
#: providers, accounts, bulkheads and agents never wait for each other.
LOCK_CLASS = 0x61646D69

#: PostgreSQL: the transaction that runs this commits without waiting for its WAL to
#: reach the disk (``synchronous_commit`` off for that transaction alone). Run by the
#: transactions that take or give back a slot: once committed their rows are seen by
#: every process at once, as any commit's; only a crash of the server itself can lose
#: the last few hundred milliseconds of them, and a slot is a lease, so nothing is lost
#: that its lease would not give back. The gates' locks are held until the commit, so
#: they are held the shorter too. A task's own transitions stay durable.
ASYNC_COMMIT = sa.select(sa.func.set_config("synchronous_commit", "off", sa.true()))
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
    ),
    # And, for the rest of the transaction, no bitmap scans: the counts that follow then
    # read the open slots' index entry by entry, which marks the entries a release left
    # behind dead as it passes them. A bitmap scan never does, and reads every released
    # slot again until VACUUM (~1 µs each: 1.3 ms an admission after 14,000 calls).
    sa.select(sa.func.set_config("enable_bitmapscan", "off", sa.true())).scalar_subquery(),
    ASYNC_COMMIT.scalar_subquery(),
)


#: The columns an admission writes to its slot (bind parameters named after them).
_TAKEN = (
    "provider",
    "account",
    "model",
    "agent",
    "bulkhead",
    "task_id",
    "worker",
    "lease_until",
    "tokens_in",
    "tokens_out",
)


def _slot_values(windows: tuple[str, ...]) -> dict[str, Any]:
    """A slot's values but its time: bind parameters, and its number in each of
    ``windows`` (gates of ``limits.WINDOW_SEQ``, whose locks the admission holds)."""
    values: dict[str, Any] = {
        name: sa.bindparam(name, type_=call_slots.c[name].type) for name in _TAKEN
    }
    for gate in windows:
        values[WINDOW_SEQ[gate].key] = next_in_window(gate)
    return values


@functools.cache
def take(windows: tuple[str, ...]) -> sa.Insert:
    """Take a slot, numbered in each of ``windows`` and stamped ``limits.admitted_now``
    (parameter ``p_now``); returns its id."""
    values = _slot_values(windows)
    values["admitted_at"] = admitted_now(windows)
    return sa.insert(call_slots).values(values).returning(call_slots.c.id)


@functools.cache
def take_if_admitted(
    slot_gates: tuple[str, ...],
    windows: tuple[str, ...],
    budgets: bool,
    token_gates: tuple[str, ...] = (),
    fair: bool = False,
) -> sa.Select[Any]:
    """PostgreSQL: the gates' counts (``limits.counts_statement``'s columns, taking), the
    admission's time (``now``: ``limits.admitted_now``, which the counts and the slot
    use) and, in column ``slot_id``, the slot taken when every gate admits (NULL:
    refused), in one statement. Parameters: those of the counts, each gate's limit
    (``Limits.params``) and the slot's values (``take``'s but ``admitted_at``). Run it
    holding the gates' locks, taken by an earlier statement: its snapshot then holds
    every slot taken before."""
    moment = sa.select(admitted_now(windows).label("now")).cte("moment")
    asked = count_columns(slot_gates, windows, True, budgets, moment.c.now, token_gates, fair)
    counts = sa.select(*asked, moment.c.now).select_from(moment).cte("counts")
    values = _slot_values(windows)
    values["admitted_at"] = counts.c.now
    typed = [sa.cast(v, call_slots.c[k].type) if k in _TAKEN else v for k, v in values.items()]
    admitted = sa.select(*typed).where(
        admits(counts, slot_gates, windows, budgets, token_gates, fair)
    )
    taken = (
        sa.insert(call_slots)
        .from_select(list(values), admitted)
        .returning(call_slots.c.id)
        .cte("taken")
    )
    slot_id = sa.select(taken.c.id).scalar_subquery().label("slot_id")
    return sa.select(*counts.c, slot_id)


def row(
    c: Candidate,
    agent: str,
    task_id: int | None,
    worker: str,
    now: float,
    lease_sec: float,
    tokens: Tokens | None = None,
) -> dict[str, Any]:
    """The parameters of ``take`` and ``take_if_admitted`` for one call (with
    ``Limits.params``); ``tokens``: what it reserves of its account's token windows
    (None: none counts it)."""
    return {
        "p_now": now,
        "provider": c.provider,
        "account": c.account,
        "model": c.model,
        "agent": agent,
        "bulkhead": c.bulkhead,
        "task_id": task_id,
        "worker": worker,
        "lease_until": now + lease_sec,
        "tokens_in": tokens.input if tokens is not None else None,
        "tokens_out": tokens.output if tokens is not None else None,
    }


@dataclass(frozen=True)
class Ask:
    """One admission's question: may ``agent``'s task ``task_id`` call ``c`` now, under
    ``limits``, holding its slots ``lease_sec`` at most and needing ``need`` tokens?"""

    c: Candidate
    agent: str
    task_id: int | None
    lease_sec: float
    limits: Limits
    need: Tokens

    def lock_keys(self, gates: Mapping[str, Any]) -> list[str]:
        circuit = [f"circuit:{self.c.provider}"] if "circuit" in gates else []
        return [*self.limits.lock_keys(self.c, self.agent), *circuit]

    def params(self, worker: str, now: float) -> dict[str, Any]:
        """The parameters of the statements that count the gates and take the slot."""
        c, agent, limits = self.c, self.agent, self.limits
        reserved = limits.reserved(self.need)
        slot = row(c, agent, self.task_id, worker, now, self.lease_sec, reserved)
        return limits.params(c, agent, now, self.need) | slot


@functools.cache
def count_elsewhere(gate: str) -> sa.Insert:
    """The tokens an answer says the window ``gate`` of its model holds (``p_used``: its
    limit less what remains) beyond the model's calls the account's windows count: a
    call of the account's other clients, released as it is taken, which the windows
    then count until it leaves.
    Parameters: ``p_provider``, ``p_account``, ``p_model``, ``p_now``,
    ``p_tokens_since``, ``p_used``."""
    counted = (
        sa.select(sa.func.coalesce(sa.func.sum(TOKENS_OF[gate]), 0))
        .where(IN_TOKEN_WINDOW, OF_MODEL)
        .scalar_subquery()
    )
    beyond = sa.bindparam("p_used", type_=sa.BigInteger) - counted
    now = sa.bindparam("p_now", type_=sa.Float)
    row = {
        "provider": sa.bindparam("p_provider", type_=sa.Text),
        "account": sa.bindparam("p_account", type_=sa.Text),
        "model": sa.bindparam("p_model", type_=sa.Text),
        "agent": sa.literal(""),
        "admitted_at": now,
        "lease_until": now,
        "released_at": now,
        "tokens_in": sa.literal(0) if gate == "otpm" else beyond,
        "tokens_out": beyond if gate == "otpm" else sa.literal(0),
    }
    typed = [sa.cast(value, call_slots.c[name].type) for name, value in row.items()]
    return sa.insert(call_slots).from_select(list(row), sa.select(*typed).where(beyond > 0))


def purge(conn: Connection, cutoff: float, now: float) -> int:
    """Delete the slots admitted before ``cutoff`` that are released or whose lease ran
    out (no window counts them any more); returns how many."""
    gone = conn.execute(
        sa.delete(call_slots).where(
            call_slots.c.admitted_at < cutoff,
            sa.or_(call_slots.c.released_at.is_not(None), call_slots.c.lease_until < now),
        )
    ).rowcount
    return int(gone)


def _reported(column: sa.Column[Any]) -> Any:
    """A token count of a released slot: what the answer reported (``p_<column>``) in
    place of the estimate, if the slot's windows count tokens and the answer said."""
    reported = sa.bindparam(f"p_{column.key}", None, type_=sa.BigInteger, required=False)
    return sa.case((column.is_not(None), sa.func.coalesce(reported, column)), else_=None)


def reported(outcome: Outcome | None) -> dict[str, int | None]:
    """``RELEASE``'s token parameters: what a successful answer reported it used (None:
    it said nothing, the estimate stays)."""
    used = outcome.usage if isinstance(outcome, Succeeded) else None
    if used is None or not (used.prompt_tokens or used.completion_tokens):
        return {"p_tokens_in": None, "p_tokens_out": None}
    return {"p_tokens_in": used.prompt_tokens, "p_tokens_out": used.completion_tokens}


#: Give a slot back, with the tokens the answer reported (``p_tokens_in``,
#: ``p_tokens_out``; NULL: not reported, the estimate stays). No row matched: the
#: lease ran out and the sweeper purged it.
RELEASE = (
    sa.update(call_slots)
    .where(
        call_slots.c.id == sa.bindparam("p_id", type_=sa.BigInteger),
        call_slots.c.released_at.is_(None),
    )
    .values(
        released_at=sa.bindparam("p_now", type_=sa.Float),
        tokens_in=_reported(call_slots.c.tokens_in),
        tokens_out=_reported(call_slots.c.tokens_out),
    )
)

#: PostgreSQL: ``RELEASE``, committed as ``ASYNC_COMMIT`` says.
RELEASE_POSTGRES = RELEASE.returning(ASYNC_COMMIT.scalar_subquery())

#: PostgreSQL: a slot given back and a successful call counted in its circuit
#: (``circuit.COUNT_SUCCESS``, ``circuit.END_RUN``), in one statement, committed as
#: ``ASYNC_COMMIT`` says (the count always inserts its row, so its RETURNING runs).
RELEASE_AND_COUNT_SUCCESS_POSTGRES = END_RUN.add_cte(
    RELEASE.returning(call_slots.c.id).cte("released"),
    COUNT_SUCCESS.returning(circuit_calls.c.id, ASYNC_COMMIT.scalar_subquery()).cte("counted"),
)


def lock_gates(conn: Connection, keys: Iterable[str]) -> None:
    """Lock the gates ``keys`` until the transaction ends (PostgreSQL; SQLite's one writer
    at a time serializes already). Always in sorted order: two admissions never deadlock."""
    step = lock_step(conn.dialect, keys)
    if step is not None:
        statement, params = step
        statement.execute(conn, params)


def lock_step(dialect: sa.Dialect, keys: Iterable[str]) -> tuple[Prepared, dict[str, Any]] | None:
    """``lock_gates``' statement and its parameters (None: nothing to lock)."""
    wanted = sorted(set(keys))
    if not wanted or dialect.name != "postgresql":
        return None
    return prepared(dialect, _LOCK), {"p_lock_class": LOCK_CLASS, "p_keys": wanted}
