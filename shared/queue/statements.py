"""The guarded statements behind every task transition, built once.

Each statement is an UPDATE of ``bus_commands`` guarded by the source state
(and, for a claim's writes, by the claim token), with bind parameters for
the values, so that running one costs a cached execution, not the building
of an expression. Only ``agentbus.queue`` executes them.

Parameters: ``p_id``, ``p_token``, ``p_now`` always; per action the ones its
``PARAMS`` entry names.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.sql.dml import Update

from agentbus.queue.decisions import (
    Complete,
    Crash,
    Decision,
    Expire,
    Fail,
    Pause,
    Release,
    Requeue,
)
from agentbus.queue.groups import turn_free
from agentbus.queue.holds import NOT_HELD
from agentbus.queue.states import TRANSITIONS, TaskStatus
from agentbus.schema import bus_commands as t


def _p(name: str, type_: Any = sa.Text) -> Any:
    return sa.bindparam(name, type_=type_)


P_ID = _p("p_id", sa.BigInteger)
P_TOKEN = _p("p_token", sa.BigInteger)
P_NOW = _p("p_now", sa.Float)
P_LEASE = _p("p_lease_until", sa.Float)
P_LIMIT = _p("p_limit", sa.Integer)
P_AGENT = _p("p_agent")
P_WORKER = _p("p_worker")

#: Constants as SQL values (a plain Python value in ``.values()`` would be bound at
#: every run; these are written into the compiled statement: ``agentbus.db.compiled``).
_NULL = sa.null()


def _state(status: TaskStatus) -> sa.ColumnElement[str]:
    """A task state written into the SQL, not bound (see ``in_state``)."""
    return sa.literal_column(f"'{TaskStatus(status).value}'", sa.Text)


#: JSON text into a JSON column (SQLite keeps JSON as text).
_JSON_TEXT = sa.Text().with_variant(sa.JSON(), "postgresql")

_CLAIMED_CHANGES: dict[str, Mapping[str, Any]] = {
    "complete": {
        "result": _p("p_result"),
        "result_note": _p("p_note"),
        "result_detail": sa.cast(_p("p_detail"), _JSON_TEXT),
        "attempts": t.c.attempts + 1,
        "lease_until": _NULL,
        "first_paused_at": _NULL,
        "reentry_count": sa.literal(0),
    },
    "fail": {
        "result_note": _p("p_error"),
        "last_error": _p("p_error"),
        "attempts": t.c.attempts + _p("p_spend", sa.Integer),
        "lease_until": _NULL,
    },
    "error": {
        "result_note": _p("p_error"),
        "last_error": _p("p_error"),
        "attempts": t.c.attempts + 1,
        "lease_until": _NULL,
    },
    # No attempt is spent. first_paused_at marks the start of the pause episode
    # and survives resume/re-pause; a resumed task that pauses again on the same
    # model's cooldown raises reentry_count; another model, or a pause for a gate
    # (a full rate window, an open circuit: p_reentry false), resets it.
    "pause": {
        "resume_after": _p("p_resume_after", sa.Float),
        "pause_reason": _p("p_reason"),
        "pause_model": _p("p_model"),
        "pause_count": t.c.pause_count + 1,
        "first_paused_at": sa.func.coalesce(t.c.first_paused_at, P_NOW),
        "paused_at": P_NOW,
        "reentry_count": sa.case(
            (
                sa.and_(
                    t.c.resume_count > 0,
                    t.c.pause_model == _p("p_model"),
                    _p("p_reentry", sa.Boolean),
                ),
                t.c.reentry_count + 1,
            ),
            else_=0,
        ),
        "lease_until": _NULL,
    },
    "release": {"lease_until": _NULL, "claimed_by": _NULL},
    "requeue": {
        "attempts": t.c.attempts + 1,
        "run_after": _p("p_run_after", sa.Float),
        "last_error": _p("p_error"),
        "lease_until": _NULL,
        "claimed_by": _NULL,
    },
    # Never started: no attempt spent, the reason said (``deadline: …``).
    "expire": {"result_note": _p("p_note"), "lease_until": _NULL},
    "rescue": {"rescue_count": t.c.rescue_count + 1, "lease_until": _NULL, "claimed_by": _NULL},
    "rescue_fail": {
        "rescue_count": t.c.rescue_count + 1,
        "result_note": _p("p_error"),
        "last_error": _p("p_error"),
        "lease_until": _NULL,
        "claimed_by": _NULL,
    },
}


def in_state(*statuses: TaskStatus) -> sa.ColumnElement[bool]:
    """``status = '<state>'`` (several: ``status IN (...)``, in the order given) with the
    states written into the SQL, not bound. PostgreSQL plans a prepared statement once
    for any values (a generic plan), and can read it through a partial index only when
    the statement itself names the state: bound, a claim scanned the whole table. SQLite
    reads a partial index only for a query that repeats its condition word for word."""
    if len(statuses) == 1:
        return t.c.status == _state(statuses[0])
    return t.c.status.in_([_state(s) for s in statuses])


def keyed_in_state(status: TaskStatus) -> sa.ColumnElement[bool]:
    """The state test of a statement that names its tasks by key: ``status || '' =
    '<state>'``, which matches no partial index's condition, so that the tasks are read
    through the primary key. With ``in_state`` a plan made while few tasks were in that
    state (PostgreSQL's, from the table's statistics) read the state's whole partial
    index instead: every claimed task, for each completion and heartbeat."""
    return t.c.status + sa.literal_column("''", sa.Text) == _state(status)


def _source(action: str) -> TaskStatus:
    """The one state an action moves a task from."""
    (source,), _ = TRANSITIONS[action]
    return source


def _claimed_statement(action: str) -> Update:
    (source,), target = TRANSITIONS[action]
    guard = [t.c.id == P_ID, keyed_in_state(source), t.c.claim_token == P_TOKEN]
    if action.startswith("rescue"):
        guard.append(t.c.lease_until < P_NOW)  # a worker that heartbeats keeps its task
    return (
        sa.update(t)
        .where(*guard)
        .values(status=_state(target), updated_at=P_NOW, **_CLAIMED_CHANGES[action])
    )


#: action -> the guarded UPDATE that settles a claim held under ``p_token``.
SETTLE: dict[str, Update] = {action: _claimed_statement(action) for action in _CLAIMED_CHANGES}
#: PostgreSQL: one completion (``SETTLE["complete"]``'s parameters), returning the id when it held.
COMPLETE_ONE_POSTGRES = _claimed_statement("complete").returning(t.c.id)

HEARTBEAT = (
    sa.update(t)
    .where(t.c.id == P_ID, keyed_in_state(TaskStatus.CLAIMED), t.c.claim_token == P_TOKEN)
    .values(lease_until=P_LEASE)
)

_IDS: Any = sa.bindparam("p_ids", expanding=True)
_ID_ARRAY: Any = sa.bindparam("p_ids", type_=sa.ARRAY(sa.BigInteger))


def _postpone(ids: sa.ColumnElement[bool]) -> Update:
    return (
        sa.update(t)
        .where(ids, keyed_in_state(TaskStatus.PAUSED))
        .values(resume_after=_p("p_resume_after", sa.Float), pause_reason=_p("p_reason"))
        .returning(t.c.id)
    )


#: Move the resume time of the tasks among ``p_ids`` still paused, RETURNING their ids.
POSTPONE = _postpone(t.c.id.in_(_IDS))
#: PostgreSQL: ``POSTPONE`` over an array of ids (one statement the server plans once).
POSTPONE_POSTGRES = _postpone(t.c.id == sa.any_(_ID_ARRAY))
#: PostgreSQL: lock the tasks among ``p_ids`` still paused, in the order of their ids,
#: passing over those another transaction holds (another sweeper moving them): what a
#: postponement then moves waits on no one, and two sweepers never deadlock.
LOCK_PAUSED_POSTGRES = (
    sa.select(t.c.id)
    .where(t.c.id == sa.any_(_ID_ARRAY), keyed_in_state(TaskStatus.PAUSED))
    .order_by(t.c.id)
    .with_for_update(skip_locked=True)
)
#: What the sweeper's moves to failed (a demotion, a malformed row) write: the reason.
_SWEPT_TO_FAILED = {
    "status": _state(TRANSITIONS["demote"][1]),
    "updated_at": P_NOW,
    "result_note": _p("p_error"),
    "last_error": _p("p_error"),
    "resume_after": _NULL,
}

#: action -> UPDATE … WHERE id IN (…) AND status = source RETURNING id (sweeper moves).
MOVE_MANY: dict[str, Update] = {
    "resume": sa.update(t)
    .where(t.c.id.in_(_IDS), keyed_in_state(_source("resume")))
    .values(
        status=_state(TRANSITIONS["resume"][1]),
        updated_at=P_NOW,
        resume_after=_NULL,
        resume_count=t.c.resume_count + 1,
    )  # run_after unchanged: a resumed task keeps its place in the queue
    .returning(t.c.id),
    "demote": sa.update(t)
    .where(t.c.id.in_(_IDS), keyed_in_state(_source("demote")))
    .values(**_SWEPT_TO_FAILED)
    .returning(t.c.id),
}


#: Fail a malformed task ``p_id`` still in ``p_source`` (queued, paused or claimed), with
#: the reason ``p_error``, RETURNING its id.
FAIL_MALFORMED = (
    sa.update(t)
    .where(t.c.id == P_ID, t.c.status == _p("p_source"))
    .values(**_SWEPT_TO_FAILED, lease_until=_NULL)
    .returning(t.c.id)
)

#: Cancel the tasks among ``p_ids`` that are in ``p_source`` (one of the states a task
#: may be cancelled from) RETURNING their ids.
CANCEL = (
    sa.update(t)
    .where(t.c.id.in_(_IDS), t.c.status == _p("p_source"))
    .values(
        status=_state(TaskStatus.CANCELLED),
        updated_at=P_NOW,
        lease_until=_NULL,
        resume_after=_NULL,
        result_note=_p("p_note"),
    )
    .returning(t.c.id)
)

#: End the tasks among ``p_ids`` in ``p_source`` (queued or paused) whose deadline comes by
#: ``p_by_then``, with the note ``p_note``, RETURNING their ids (the sweeper's lapse).
LAPSE = (
    sa.update(t)
    .where(
        t.c.id.in_(_IDS), t.c.status == _p("p_source"), t.c.expires_at <= _p("p_by_then", sa.Float)
    )
    .values(
        status=_state(TRANSITIONS["lapse"][1]),
        updated_at=P_NOW,
        resume_after=_NULL,
        result_note=_p("p_note"),
    )
    .returning(t.c.id)
)


@functools.cache
def has_due(groups: str | None = None) -> sa.Select[Any]:
    """Is a task of ``p_agent`` due? (an idle SQLite worker's cheap look: a read, no lock;
    ``groups``: the agent's group order, ``p_group_limit`` read: a task whose group has no
    turn free is not due)."""
    due = [in_state(TaskStatus.QUEUED), t.c.agent == P_AGENT, t.c.run_after <= P_NOW, NOT_HELD]
    if groups is not None:
        due.append(turn_free(groups, P_NOW))
    return sa.select(t.c.id).where(*due).limit(1)


@functools.cache
def next_due(groups: str | None = None) -> sa.Select[Any]:
    """When the earliest queued task of ``p_agent`` is due (NULL: none is, or it is held;
    ``groups``: as ``has_due``'s, a task whose group has no turn free left out)."""
    due = [in_state(TaskStatus.QUEUED), t.c.agent == P_AGENT, NOT_HELD]
    if groups is not None:
        due.append(turn_free(groups, P_NOW))
    return sa.select(sa.func.min(t.c.run_after)).where(*due)


@functools.cache
def claim_statement(
    dialect: str, *, single: bool = False, limit: int | None = None, groups: str | None = None
) -> Update:
    """Claim up to ``p_limit`` due queued tasks of ``p_agent`` in one statement (``single``:
    one task, ``p_limit`` not read; ``limit``: up to that many, written in the statement,
    ``p_limit`` not read), none while the agent is held: by priority, due time, age. Read
    in the queued tasks' index order, a priority's first entry not due ends its due ones.
    ``groups``: the agent's group order (``agentbus.queue.groups``), ``p_group_limit`` read."""
    picked = (
        sa.select(t.c.id)
        .where(in_state(_source("claim")), t.c.agent == P_AGENT, t.c.run_after <= P_NOW)
        .where(NOT_HELD)
        .order_by(t.c.priority.desc(), t.c.run_after, t.c.id)
        .limit(1 if single else P_LIMIT if limit is None else limit)
    )
    if groups is not None:
        picked = picked.where(turn_free(groups, P_NOW))
    if dialect == "postgresql":
        # A CTE runs once; an IN (subquery … FOR UPDATE) may be re-run per row. The rows
        # it picks are queued and locked: the UPDATE finds them by key. (A status test
        # here would let the planner read them through the queued tasks' partial index,
        # all of it, when its statistics still say the queue is nearly empty: a burst.)
        # They are matched as an array of keys, not joined: a plan made once for any
        # ``p_limit`` guesses a tenth of the queued tasks the statistics last saw, and
        # for that many would hash the whole table to join them (each claim then costs
        # as much as the table is large). The caller orders the rows it gets back.
        cte = picked.with_for_update(skip_locked=True).cte("picked")
        keys = sa.func.array(sa.select(cte.c.id).scalar_subquery())
        match = [t.c.id == sa.any_(keys)]
    elif single:
        # SQLite builds a temporary b-tree of an IN (subquery)'s rows at every run; the one
        # task's id compares in place.
        match = [t.c.id == picked.scalar_subquery(), in_state(_source("claim"))]
    else:
        match = [t.c.id.in_(picked.scalar_subquery()), in_state(_source("claim"))]
    return (
        sa.update(t)
        .where(*match)
        .values(
            status=_state(TRANSITIONS["claim"][1]),
            claim_token=t.c.claim_token + 1,
            claimed_by=P_WORKER,
            claimed_at=P_NOW,
            lease_until=P_LEASE,
            updated_at=P_NOW,
        )
        .returning(*t.c)
    )


def _complete_many_postgres() -> Update:
    """Postgres: complete many claims in one guarded UPDATE over unnest()ed arrays.

    Parameters ``p_ids``, ``p_tokens``, ``p_results``, ``p_notes``, ``p_details`` (parallel
    arrays; a detail is JSON text), ``p_now``.
    """
    ids = sa.bindparam("p_ids", type_=sa.ARRAY(sa.BigInteger))
    batch = (
        sa.func.unnest(
            ids,
            sa.bindparam("p_tokens", type_=sa.ARRAY(sa.BigInteger)),
            sa.bindparam("p_results", type_=sa.ARRAY(sa.Text)),
            sa.bindparam("p_notes", type_=sa.ARRAY(sa.Text)),
            sa.bindparam("p_details", type_=sa.ARRAY(sa.Text)),
        )
        .table_valued("v_id", "v_token", "v_result", "v_note", "v_detail")
        .render_derived(name="batch")
    )
    changes = {
        **_CLAIMED_CHANGES["complete"],
        "result": batch.c.v_result,
        "result_note": batch.c.v_note,
        "result_detail": sa.cast(batch.c.v_detail, sa.JSON),
    }
    return (
        sa.update(t)
        .where(
            # The keys once more, as an array: the tasks are read through the primary key,
            # not joined to the arrays' rows by a read of the whole table.
            t.c.id == sa.any_(ids),
            t.c.id == batch.c.v_id,
            t.c.claim_token == batch.c.v_token,
            keyed_in_state(_source("complete")),
        )
        .values(status=_state(TRANSITIONS["complete"][1]), updated_at=P_NOW, **changes)
        .returning(t.c.id)
    )


COMPLETE_MANY_POSTGRES = _complete_many_postgres()


def action_of(decision: Decision) -> str:
    """The transition (a key of ``TRANSITIONS``) a decision makes."""
    match decision:
        case Complete():
            return "complete"
        case Pause():
            return "pause"
        case Requeue():
            return "requeue"
        case Fail():
            return "fail"
        case Crash():
            return "error"
        case Release():
            return "release"
        case Expire():
            return "expire"


#: A result detail as stored (made once: ``json.dumps`` with options makes an encoder
#: at every call).
_DETAIL_JSON = json.JSONEncoder(ensure_ascii=False)


def settle_params(decision: Decision) -> tuple[str, dict[str, Any]]:
    """The transition a decision makes and its statement's parameters."""
    match decision:
        case Complete(result=result, model=model, detail=detail):
            note = f"model={model}" if model is not None else None
            shown = None if detail is None else _DETAIL_JSON.encode(detail)
            return "complete", {"p_result": result, "p_note": note, "p_detail": shown}
        case Pause():
            return "pause", {
                "p_resume_after": decision.resume_after,
                "p_reason": decision.reason,
                "p_model": decision.model,
                "p_reentry": decision.cooldown,
            }
        case Requeue(run_after=run_after, error=error):
            return "requeue", {"p_run_after": run_after, "p_error": error}
        case Fail(reason=reason, spend_attempt=spend):
            return "fail", {"p_error": reason, "p_spend": int(spend)}
        case Crash(error=error):
            return "error", {"p_error": error}
        case Release():
            return "release", {}
        case Expire(reason=reason):
            return "expire", {"p_note": reason}
