"""What the queue's operations share: its database and clock, the guarded moves of many
tasks, and the message of a guarded write that matched nothing."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.db import Database, dialect_insert
from agentbus.errors import TransitionRejected
from agentbus.queue import events, wakeups
from agentbus.queue.settle_and_claim import SteadyState
from agentbus.queue.statements import MOVE_MANY
from agentbus.queue.states import TRANSITIONS, TaskStatus
from agentbus.queue.tasks import PayloadLimits
from agentbus.schema import KEYED, idempotency_keys
from agentbus.schema import bus_commands as t

Clock = Callable[[], float]
DEFAULT_LIMITS = PayloadLimits()


def text_safe(params: Mapping[str, Any]) -> dict[str, Any]:
    return {key: events.storable(value) for key, value in params.items()}


class GuardedQueue:
    def __init__(
        self,
        db: Database,
        *,
        clock: Clock | None = None,
        max_attempts: int = 3,
        payload_limits: PayloadLimits = DEFAULT_LIMITS,
    ) -> None:
        self.db = db
        self.clock = clock or db.clock  # the fleet's (see agentbus.clock)
        self.max_attempts = max_attempts
        self.payload_limits = payload_limits
        upsert = dialect_insert(db.dialect)
        self._insert_keyed = (
            upsert(t).on_conflict_do_nothing(index_elements=["idempotency_key"], index_where=KEYED)
        ).returning(t.c.id)
        self._insert_key = upsert(idempotency_keys).on_conflict_do_nothing(index_elements=["key"])

    @functools.cached_property
    def _steady(self) -> SteadyState:
        """Completions and claims, compiled at the first use (a producer never needs them)."""
        return SteadyState(self.db)

    # -- the guarded writes --------------------------------------------------

    def _move_many(
        self,
        action: str,
        task_ids: Sequence[int],
        by: str,
        reason: str,
        params: Mapping[str, Any],
        *,
        detail: Mapping[str, Any] | None = None,
        also: Callable[[Connection, list[int], float], None] | None = None,
    ) -> list[int]:
        """Move many tasks with one guarded UPDATE; ``also`` writes more in the same transaction."""
        (source,), target = TRANSITIONS[action]

        def work(conn: Connection) -> list[int]:
            now = self.clock()
            full = {"p_ids": list(task_ids), "p_now": now, **params}
            moved = sorted(int(i) for i in conn.execute(MOVE_MANY[action], full).scalars())
            events.record(
                conn,
                [
                    events.event(
                        i, source.value, target.value, now, reason=reason, worker=by, detail=detail
                    )
                    for i in moved
                ],
            )
            if also is not None:
                also(conn, moved, now)
            if target is TaskStatus.QUEUED and moved and self.db.dialect == "postgresql":
                agents = sa.select(t.c.agent).where(t.c.id.in_(moved)).distinct()
                wakeups.notify(conn, conn.execute(agents).scalars())  # resumed: claim them now
            return moved

        return self.db.write(work) if task_ids else []

    @classmethod
    def _reject(
        cls,
        conn: Connection,
        task_id: int,
        action: str,
        token: int | None,
        lease_checked_at: float | None = None,
    ) -> NoReturn:
        raise cls._rejection(conn, task_id, action, token, lease_checked_at)

    @staticmethod
    def _rejection(
        conn: Connection,
        task_id: int,
        action: str,
        token: int | None,
        lease_checked_at: float | None = None,
    ) -> TransitionRejected:
        """Why a guarded write matched no row: where the task is now."""
        row = conn.execute(
            sa.select(t.c.status, t.c.claim_token, t.c.lease_until).where(t.c.id == task_id)
        ).first()
        sources, _ = TRANSITIONS.get(action, (frozenset({TaskStatus.CLAIMED}), None))
        expected = " or ".join(sorted(s.value for s in sources))
        if row is None:
            return TransitionRejected(task_id, action, expected, None, token)
        actual = row.status
        claimed = row.status == TaskStatus.CLAIMED
        if token is not None and claimed and row.claim_token != token:
            actual = f"claimed under token {row.claim_token}"
        elif lease_checked_at is not None and claimed:
            actual = f"claimed with {(row.lease_until or 0) - lease_checked_at:.1f}s of lease left"
        return TransitionRejected(task_id, action, expected, actual, token)
