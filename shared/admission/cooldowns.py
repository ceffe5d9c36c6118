"""Model cooldowns shared by every process: the only reader and writer of ``model_cooldown``.

A cooldown is written with an upsert that never shortens it: a second 429
during a cooldown extends it, and a shorter one leaves it be. Reads are
cached per process for ``cache_sec`` (1 s). When one read of the table takes
longer than ``slow_read_ms`` (100 ms), the process switches to a
``slow_cache_sec`` (10 s) cache and says so in its log; a fast read switches
it back. Writes update the local cache at once, so a process never calls a
model it has just put in cooldown itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission import workspace_events
from agentbus.admission.gates import Cooled, cooldown_key, cooldown_reason, cooldown_until
from agentbus.db import Database, dialect_insert
from agentbus.logging import get_logger
from agentbus.schema import cooldown_history
from agentbus.schema import model_cooldown as mc

if TYPE_CHECKING:
    from agentbus.admission.routing import Candidate
    from agentbus.config import Settings
    from agentbus.providers.outcomes import RateLimited, Succeeded, TimedOut

log = get_logger("agentbus.cooldowns")


class CooldownStore:
    def __init__(
        self,
        db: Database,
        *,
        clock: Callable[[], float] | None = None,
        timer: Callable[[], float] = time.perf_counter,
        cache_sec: float = 1.0,
        slow_read_ms: float = 100.0,
        slow_cache_sec: float = 10.0,
    ) -> None:
        self.db = db
        self.clock = clock or db.clock
        self.timer = timer
        self.normal_ttl = cache_sec
        self.slow_read_ms = slow_read_ms
        self.slow_ttl = slow_cache_sec
        self.ttl = cache_sec
        self._cache: dict[str, float] = {}
        self._read_at: float | None = None
        upsert = dialect_insert(db.dialect)
        stmt = upsert(mc)
        longer = stmt.excluded.cooldown_until > mc.c.cooldown_until
        self._upsert = stmt.on_conflict_do_update(
            index_elements=[mc.c.model_id],
            set_={
                "cooldown_until": sa.case(
                    (longer, stmt.excluded.cooldown_until), else_=mc.c.cooldown_until
                ),
                "reason": sa.case((longer, stmt.excluded.reason), else_=mc.c.reason),
                "source": sa.case((longer, stmt.excluded.source), else_=mc.c.source),
                "updated_at": stmt.excluded.updated_at,
            },
        ).returning(mc.c.cooldown_until)

    @classmethod
    def configured(cls, db: Database, settings: Settings) -> CooldownStore:
        """The store of a process that admits calls, its caches as ``settings`` say."""
        return cls(
            db,
            cache_sec=settings.cooldown_cache_sec,
            slow_read_ms=settings.cooldown_slow_read_ms,
            slow_cache_sec=settings.cooldown_slow_cache_sec,
        )

    # -- reading -------------------------------------------------------------

    def active(self) -> dict[str, float]:
        """Every model cooling down now -> when its cooldown ends."""
        now = self.clock()
        if self._read_at is None or now - self._read_at >= self.ttl:
            self._refresh(now)
        return {model: until for model, until in self._cache.items() if until > now}

    def cooling(self, models: Iterable[str]) -> dict[str, float]:
        """Those of ``models`` cooling down now -> when each cooldown ends."""
        active = self.active()
        return {m: active[m] for m in models if m in active}

    def refresh(self) -> None:
        """Read the table now (the sweeper: once per pass, then from memory)."""
        self._refresh(self.clock())

    def details(self) -> list[dict[str, Any]]:
        """Every active cooldown row (model, until, reason, source), soonest to end first."""
        now = self.clock()
        rows = self.db.read(
            lambda conn: (
                conn.execute(
                    sa.select(mc.c.model_id, mc.c.cooldown_until, mc.c.reason, mc.c.source)
                    .where(mc.c.cooldown_until > now)
                    .order_by(mc.c.cooldown_until)
                )
                .mappings()
                .all()
            )
        )
        return [dict(r) for r in rows]

    def _refresh(self, now: float) -> None:
        started = self.timer()
        rows = self.db.read(
            lambda conn: conn.execute(
                sa.select(mc.c.model_id, mc.c.cooldown_until).where(mc.c.cooldown_until > now)
            ).all()
        )
        elapsed_ms = (self.timer() - started) * 1000
        self._cache = {model: until for model, until in rows}
        self._read_at = now
        if elapsed_ms > self.slow_read_ms and self.ttl != self.slow_ttl:
            self.ttl = self.slow_ttl
            log.warning("cooldown_read_slow", read_ms=round(elapsed_ms, 1), cache_sec=self.ttl)
        elif elapsed_ms <= self.slow_read_ms and self.ttl != self.normal_ttl:
            self.ttl = self.normal_ttl
            log.info("cooldown_read_fast_again", read_ms=round(elapsed_ms, 1), cache_sec=self.ttl)

    # -- writing -------------------------------------------------------------

    def cool(
        self,
        c: Candidate,
        outcome: RateLimited | TimedOut | Succeeded,
        accounts: int,
        s: Settings,
        now: float,
        source: str,
    ) -> Cooled:
        """Cool the candidate's model down for every process after a cooling ``outcome``
        (an account's quota, of one of ``accounts``: only ``model@account``); a cooldown
        is never shortened. A success cools only when its headers said the account has
        nothing left (until they said it resets)."""
        key = cooldown_key(outcome, c.model, c.key, accounts)
        until = cooldown_until(outcome, now, s.model_cooldown_sec, s.model_timeout_cooldown_sec)
        reason = cooldown_reason(outcome)  # rate_limited, overloaded, timeout, limit_reached
        return Cooled(key, self.set(key, until, reason=reason, source=source))

    def set(self, model: str, until: float, *, reason: str, source: str | None = None) -> float:
        """Cool ``model`` down until ``until`` at least; returns when its cooldown now ends."""

        def work(conn: Connection) -> float:
            now = self.clock()
            row = {
                "model_id": model,
                "cooldown_until": until,
                "updated_at": now,
                "reason": reason,
                "source": source,
            }
            effective = float(conn.execute(self._upsert, row).scalar_one())
            detail = {"model": model, "until": effective, "reason": reason}
            workspace_events.emit(conn, "cooldown_set", now, source=source, detail=detail)
            conn.execute(
                sa.insert(cooldown_history),
                {
                    "model_id": model,
                    "cooldown_until": effective,
                    "set_at": now,
                    "reason": reason,
                    "source": source,
                },
            )
            return effective

        effective = self.db.write(work)
        self._cache[model] = max(effective, self._cache.get(model, 0.0))
        return effective

    def clear(self, model: str, *, by: str) -> list[str]:
        """An operator ends cooldowns now: ``model`` (and its accounts' ``model@…``), or
        one ``model@account``. Returns the keys cleared; each gets a ``cooldown_cleared``
        event naming ``by``, and its history ends now. Workers see it at their next
        read (within ``cache_sec``); their own writes still only extend."""
        keys = [mc.c.model_id == model]
        if "@" not in model:
            keys.append(mc.c.model_id.startswith(model + "@", autoescape=True))
        which = sa.or_(*keys)

        def work(conn: Connection) -> list[str]:
            now = self.clock()
            rows = conn.execute(
                sa.delete(mc)
                .where(which, mc.c.cooldown_until > now)
                .returning(mc.c.model_id, mc.c.cooldown_until)
            ).all()
            for key, until in sorted(rows):
                conn.execute(
                    sa.update(cooldown_history)
                    .where(
                        cooldown_history.c.model_id == key, cooldown_history.c.cooldown_until > now
                    )
                    .values(cooldown_until=now)
                )
                detail = {"model": key, "was_until": until}
                workspace_events.emit(conn, "cooldown_cleared", now, source=by, detail=detail)
            return sorted(key for key, _ in rows)

        cleared = self.db.write(work)
        for key in cleared:
            self._cache.pop(key, None)
        return cleared

    def drop(self, rows: Mapping[str, str], *, by: str) -> list[str]:
        """Delete cooldown rows that were written so that no reader can use them
        (``rows``: key -> what is wrong), each with a ``cooldown_cleared`` event."""

        def work(conn: Connection) -> list[str]:
            now = self.clock()
            keys = list(rows)
            gone = conn.execute(
                sa.delete(mc).where(mc.c.model_id.in_(keys)).returning(mc.c.model_id)
            ).scalars()
            dropped = sorted(gone)
            for key in dropped:
                detail = {"model": key, "malformed": rows[key]}
                workspace_events.emit(conn, "cooldown_cleared", now, source=by, detail=detail)
            return dropped

        dropped = self.db.write(work) if rows else []
        for key in dropped:
            self._cache.pop(key, None)
        return dropped

    def purge_expired(self) -> int:
        """Delete cooldowns that have ended; returns how many."""
        now = self.clock()

        def work(conn: Connection) -> int:
            gone = conn.execute(
                sa.delete(mc).where(mc.c.cooldown_until <= now).returning(mc.c.model_id)
            ).scalars()
            models = sorted(gone)
            for model in models:
                workspace_events.emit(conn, "cooldown_expired", now, detail={"model": model})
            return len(models)

        return self.db.write(work)
