"""The append-only task event log: one row per transition, written with it.

Only ``agentbus.queue`` appends (in the transaction of the change it
describes); everyone may read. KPIs are computed from this log.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus import masking
from agentbus.admission import usage
from agentbus.admission.routing import Route
from agentbus.queue import wakeups
from agentbus.queue.decisions import (
    Complete,
    Crash,
    Expire,
    Fail,
    Pause,
    Release,
    Requeue,
    Settlement,
)
from agentbus.queue.statements import action_of
from agentbus.queue.states import TERMINAL, TRANSITIONS
from agentbus.schema import route_log, task_events

_ENDS = frozenset(s.value for s in TERMINAL)
#: The reason of the event of a task its deadline ended (never started).
DEADLINE = "deadline"


def storable(value: Any) -> Any:
    """A string masked (no secret is stored) and with NUL characters made storable
    (PostgreSQL text refuses NUL): model answers and error messages come from
    outside; one stray NUL must not make a task impossible to settle."""
    return masking.mask(value.replace("\x00", "\ufffd")) if isinstance(value, str) else value


def record(conn: Connection, rows: Iterable[Mapping[str, Any]]) -> None:
    """Append events; each mapping has task_id, from_status, to_status, reason,
    worker, claim_token, at and detail. A task that reached an end wakes the
    producers waiting for tasks (PostgreSQL, on commit)."""
    batch = [dict(r) for r in rows]
    if batch:
        conn.execute(sa.insert(task_events), batch)
        if any(r["to_status"] in _ENDS for r in batch):
            wakeups.notify_ended(conn)


def event(
    task_id: int,
    from_status: str | None,
    to_status: str,
    at: float,
    *,
    reason: str | None = None,
    worker: str | None = None,
    claim_token: int | None = None,
    detail: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "from_status": from_status,
        "to_status": to_status,
        "reason": storable(reason),
        "worker": worker,
        "claim_token": claim_token,
        "at": at,
        "detail": masking.mask_value(dict(detail)) if detail else None,
    }


def for_task(conn: Connection, task_id: int) -> list[dict[str, Any]]:
    """The events of one task, oldest first."""
    rows = conn.execute(
        sa.select(task_events).where(task_events.c.task_id == task_id).order_by(task_events.c.id)
    )
    return [dict(r._mapping) for r in rows]


def record_routes(conn: Connection, routes: Iterable[Route]) -> None:
    """Append routing decisions with the settle they led to, and add their calls' usage
    to the ledger."""
    batch = list(routes)
    if batch:
        conn.execute(sa.insert(route_log), [r.row() for r in batch])
        usage.record(conn, batch)


def for_settlement(item: Settlement, worker: str | None, now: float) -> dict[str, Any]:
    """The event row of a settlement: the transition, its reason and what it carried."""
    d = item.decision
    detail: dict[str, Any] = {}
    match d:
        case Complete(model=model, usage=usage) if model is not None:
            reason = "done"
            usage_detail = {
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
            }
            detail = {"model": model, "usage": usage_detail}
        case Complete():
            reason = "done"
        case Pause():
            reason = d.reason
            detail = {"resume_after": d.resume_after, "model": d.model}
            if d.cooling:
                detail["cooling"] = dict(d.cooling)
        case Requeue(run_after=run_after, error=error):
            reason, detail = "retry", {"error": error, "run_after": run_after}
        case Fail(reason=why):
            reason = why
        case Crash(error=error):
            reason, detail = "error", {"error": error}
        case Release(reason=why):
            reason = why
        case Expire(reason=why):
            reason, detail = DEADLINE, {"why": why}
    (source,), target = TRANSITIONS[action_of(d)]
    return event(
        item.task_id,
        source.value,
        target.value,
        now,
        reason=reason,
        worker=worker,
        claim_token=item.token,
        detail={**detail, **(item.detail or {})} or None,
    )


def pause_refusals(detail: Any) -> dict[str, Any]:
    """The refusals a pause event's detail names, by candidate; {} when it names none
    (or the detail is not what agentbus writes: a row written by hand)."""
    refusals = detail.get("refusals") if isinstance(detail, dict) else None
    return dict(refusals) if isinstance(refusals, dict) else {}
