"""The workspace client budget: named slots reserved while in use, shared by
every process of the workspace (the database).

``try_reserve(name)`` answers ``reserved``, ``already_held`` (the name counts
once, whoever holds it) or ``refused`` (``enforce`` mode, the budget is full);
``release(name)`` is idempotent. ``budget_warning`` fires once when the share
of the budget in use rises across 75 %, and re-arms only after it falls below
37.5 %: the armed flag is one database row flipped by a guarded UPDATE, so two
processes never both warn. Refusals inside a bulk pass (nestable) become one
``refused_batch`` event from the outermost pass; the last refused names stay
visible until the next pass begins.

A worker running several tasks at once holds a name once for all of them: its
hold goes back when the last of its calls on that provider ends. Each thread
has bulk passes of its own.

The mode and size are the workspace's too: workspace settings that ``busctl
budget set`` writes and every process reads (again every ``refresh_sec``, so
a change applies without a restart). Until set, the budget is ``off``. A
process's own flags or environment (``budget_mode``, ``client_budget``) do
not override them; a process given values that disagree says so once at
start. ``SessionBudget`` is the per-process fallback (``no_workspace_budget``):
the flags' mode and size, the same rules in memory, events with scope
``session``.
"""

from __future__ import annotations

import enum
import functools
import math
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission import workspace_events
from agentbus.admission.budget_setting import BudgetSetting, read_setting
from agentbus.config import Settings, check_budget_mode
from agentbus.db import Database, dialect_insert
from agentbus.logging import get_logger
from agentbus.schema import budget_slots as slots
from agentbus.schema import budget_state as state

log = get_logger("agentbus.budget")

WARN_FRACTION = 0.75
REARM_FRACTION = 0.375
ADVISORY_KEY = 0x627564676574  # "budget"


class Reserve(enum.StrEnum):
    RESERVED = "reserved"
    ALREADY_HELD = "already_held"
    REFUSED = "refused"


class _BulkPass:
    """``with budget.bulk_pass():`` the refusals inside become one ``refused_batch``
    event (passes nest, per thread). A class, not a generator: every task opens one."""

    __slots__ = ("budget",)

    def __init__(self, budget: _Budget) -> None:
        self.budget = budget

    def __enter__(self) -> None:
        self.budget.begin_pass()

    def __exit__(self, *exc: object) -> None:
        self.budget.end_pass()


class _Budget:
    """What both budgets share: their settings, and the bulk passes of each of this
    process's threads (nesting depth and the refusals they gathered)."""

    scope = workspace_events.WORKSPACE

    def __init__(
        self,
        db: Database,
        *,
        mode: str,
        budget: int,
        holder: str,
        clock: Callable[[], float] | None = None,
    ) -> None:
        check_budget_mode(mode, budget)
        self.db, self.mode, self.budget, self.holder = db, mode, budget, holder
        self.clock = clock or db.clock
        self._passes = threading.local()  # depth, pending: one bulk pass per thread
        self._guard = threading.Lock()  # this process's holds: counted, then written

    @property
    def depth(self) -> int:
        return int(getattr(self._passes, "depth", 0))

    @property
    def pending(self) -> list[str]:
        if not hasattr(self._passes, "pending"):
            self._passes.pending = []
        return list(self._passes.pending)

    def reserved(self) -> list[str]:
        raise NotImplementedError

    def last_refused(self) -> list[str]:
        raise NotImplementedError

    def snapshot(self) -> dict[str, Any]:
        names = self.reserved() if self.mode != "off" else []
        return {
            "mode": self.mode,
            "budget": self.budget or None,
            "scope": self.scope,
            "reserved": names,
            "count": len(names),
            "last_refused": self.last_refused(),
        }

    def bulk_pass(self) -> _BulkPass:
        return _BulkPass(self)

    def begin_pass(self) -> None:
        self._passes.depth = self.depth + 1
        if self.depth == 1:
            self._passes.pending = []
            self._pass_started()

    def end_pass(self) -> None:
        self._passes.depth = max(0, self.depth - 1)
        if self.depth == 0 and self.pending:
            names, self._passes.pending = list(dict.fromkeys(self.pending)), []
            self._emit_batch(names)

    def _refused(self, name: str) -> None:
        if self.depth > 0:
            self._passes.pending.append(name)
        else:  # outside any pass: a batch of one, the same shape
            self._emit_batch([name])

    def _pass_started(self) -> None:
        raise NotImplementedError

    def _emit_batch(self, names: list[str]) -> None:
        raise NotImplementedError


class WorkspaceBudget(_Budget):
    """The workspace's budget: its mode and size are workspace settings, read again
    every ``refresh_sec`` (a change is logged as ``client_budget_changed``)."""

    scope = workspace_events.WORKSPACE

    def __init__(
        self,
        db: Database,
        *,
        holder: str,
        clock: Callable[[], float] | None = None,
        refresh_sec: float = 1.0,
    ) -> None:
        super().__init__(db, mode="off", budget=0, holder=holder, clock=clock)
        self.refresh_sec = refresh_sec
        self._mine: Counter[str] = Counter()  # names this process holds a row for: its calls
        self.setting = BudgetSetting()
        self._read_at = -math.inf
        self.refresh(force=True)

    def refresh(self, *, force: bool = False) -> BudgetSetting:
        """The workspace's setting, read again when ``refresh_sec`` has passed."""
        now = self.clock()
        if not force and now - self._read_at < self.refresh_sec:
            return self.setting
        self._read_at = now
        new = read_setting(self.db)
        if new.mode == "enforce" and new.size <= 0:  # written by hand: refuse nothing
            log.error("client_budget_invalid", mode=new.mode, size=new.size, applied="off")
            new = BudgetSetting("off", 0, new.updated_at, new.updated_by)
        old, self.setting = self.setting, new
        self.mode, self.budget = new.mode, new.size
        if not force and (old.mode, old.size) != (new.mode, new.size):
            log.info(
                "client_budget_changed",
                mode=new.mode,
                size=new.size,
                was=f"{old.mode}/{old.size}",
                by=new.updated_by,
            )
        return new

    def snapshot(self) -> dict[str, Any]:
        self.refresh()
        doc = super().snapshot()
        doc["set_at"], doc["set_by"] = self.setting.updated_at, self.setting.updated_by
        return doc

    # -- slots ---------------------------------------------------------------

    def try_reserve(self, name: str, *, lease_sec: float = 3600.0) -> Reserve:
        self.refresh()
        if self.mode == "off":
            return Reserve.RESERVED

        def work(conn: Connection) -> Reserve:
            self._lock(conn)
            now = self.clock()
            held = self._names(conn, now)
            row = {"name": name, "holder": self.holder, "reserved_at": now}
            row["lease_until"] = now + lease_sec
            if name in held:
                conn.execute(_hold(self.db.dialect), row)
                return Reserve.ALREADY_HELD
            if self.mode == "enforce" and len(held) >= self.budget:
                return Reserve.REFUSED
            conn.execute(_hold(self.db.dialect), row)
            self._hysteresis(conn, len(held) + 1, now, [*held, name])
            return Reserve.RESERVED

        with self._guard:
            answer = self.db.write(work)
            if answer is not Reserve.REFUSED:
                self._mine[name] += 1
        if answer is Reserve.REFUSED:
            self._refused(name)
        return answer

    def release(self, name: str) -> bool:
        """Give ``name`` back (this process's hold on it); False if it held none.

        A name held before the mode became ``off`` goes back too; a name never
        held costs no database write, nor does one still in use by another of this
        process's calls."""
        with self._guard:
            if self._mine[name] <= 0:
                return False
            self._mine[name] -= 1
            if self._mine[name]:
                return True
            del self._mine[name]
            return self._delete(name)

    def _delete(self, name: str) -> bool:
        def work(conn: Connection) -> bool:
            self._lock(conn)
            now = self.clock()
            gone = conn.execute(
                sa.delete(slots).where(slots.c.name == name, slots.c.holder == self.holder)
            ).rowcount
            self._hysteresis(conn, len(self._names(conn, now)), now, None)
            return bool(gone)

        return self.db.write(work)

    def reserved(self) -> list[str]:
        now = self.clock()
        return self.db.read(lambda conn: self._names(conn, now))

    # -- hysteresis and refusal batches --------------------------------------

    def _hysteresis(
        self, conn: Connection, count: int, now: float, names: list[str] | None
    ) -> None:
        if self.budget <= 0:
            return
        self._ensure_state(conn, now)
        share = count / self.budget
        if names is not None and share >= WARN_FRACTION:
            fired = conn.execute(
                sa.update(state)
                .where(state.c.id == 1, state.c.armed.is_(True))
                .values(armed=False, updated_at=now)
            ).rowcount
            if fired:
                detail = {"reserved": count, "budget": self.budget, "names": sorted(names)}
                workspace_events.emit(
                    conn, "budget_warning", now, scope=self.scope, source=self.holder, detail=detail
                )
        elif share < REARM_FRACTION:
            conn.execute(
                sa.update(state)
                .where(state.c.id == 1, state.c.armed.is_(False))
                .values(armed=True, updated_at=now)
            )

    def _ensure_state(self, conn: Connection, now: float) -> None:
        row = {"id": 1, "armed": True, "last_refused": [], "updated_at": now}
        conn.execute(_init_state(self.db.dialect), row)

    def _set_last_refused(self, conn: Connection, names: list[str], now: float) -> None:
        self._ensure_state(conn, now)
        conn.execute(
            sa.update(state).where(state.c.id == 1).values(last_refused=names, updated_at=now)
        )

    def _pass_started(self) -> None:
        if self.mode == "off":
            return

        def work(conn: Connection) -> None:
            now = self.clock()
            self._set_last_refused(conn, [], now)

        if self.last_refused():  # a write only when there is something to clear
            self.db.write(work)

    def _emit_batch(self, names: list[str]) -> None:
        def work(conn: Connection) -> None:
            now = self.clock()
            self._set_last_refused(conn, names, now)
            detail = {"names": names, "count": len(names), "budget": self.budget}
            workspace_events.emit(
                conn, "refused_batch", now, scope=self.scope, source=self.holder, detail=detail
            )

        self.db.write(work)

    def last_refused(self) -> list[str]:
        value = self.db.read(
            lambda conn: conn.execute(
                sa.select(state.c.last_refused).where(state.c.id == 1)
            ).scalar()
        )
        return list(value or [])

    # -- helpers -------------------------------------------------------------

    def _lock(self, conn: Connection) -> None:
        if self.db.dialect == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(ADVISORY_KEY)))

    @staticmethod
    def _names(conn: Connection, now: float) -> list[str]:
        return list(
            conn.execute(
                sa.select(slots.c.name)
                .where(slots.c.lease_until > now)
                .distinct()
                .order_by(slots.c.name)
            ).scalars()
        )


@functools.cache
def _hold(dialect: str) -> sa.Insert:
    """Hold a name (or renew this holder's lease on it)."""
    insert = dialect_insert(dialect)(slots)
    held: sa.Insert = insert.on_conflict_do_update(
        index_elements=[slots.c.name, slots.c.holder],
        set_={"lease_until": insert.excluded.lease_until},
    )
    return held


@functools.cache
def _init_state(dialect: str) -> sa.Insert:
    """Create the one state row if it is not there yet."""
    created: sa.Insert = dialect_insert(dialect)(state).on_conflict_do_nothing(
        index_elements=[state.c.id]
    )
    return created


class SessionBudget(_Budget):
    """The per-process budget (``no_workspace_budget``): each process counts its own slots."""

    scope = workspace_events.SESSION

    def __init__(
        self,
        db: Database,
        *,
        mode: str,
        budget: int,
        holder: str,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(db, mode=mode, budget=budget, holder=holder, clock=clock)
        self.held: Counter[str] = Counter()  # name -> this process's calls holding it
        self.armed = True
        self._last: list[str] = []

    def try_reserve(self, name: str, *, lease_sec: float = 3600.0) -> Reserve:
        if self.mode == "off":
            return Reserve.RESERVED
        with self._guard:
            if self.held[name]:
                self.held[name] += 1
                return Reserve.ALREADY_HELD
            refused = self.mode == "enforce" and len(self.held) >= self.budget
            if not refused:
                self.held[name] = 1
            full = self.budget > 0 and len(self.held) / self.budget >= WARN_FRACTION
            warn = not refused and self.armed and full
            if warn:
                self.armed = False
                names = sorted(self.held)
                detail = {"reserved": len(names), "budget": self.budget, "names": names}
        if refused:
            self._refused(name)
            return Reserve.REFUSED
        if warn:
            self._emit("budget_warning", detail)
        return Reserve.RESERVED

    def release(self, name: str) -> bool:
        with self._guard:
            if not self.held[name]:
                return False
            self.held[name] -= 1
            if not self.held[name]:
                del self.held[name]
            if self.budget > 0 and len(self.held) / self.budget < REARM_FRACTION:
                self.armed = True
        return True

    def reserved(self) -> list[str]:
        return sorted(self.held)

    def last_refused(self) -> list[str]:
        return list(self._last)

    def _pass_started(self) -> None:
        self._last = []

    def _emit_batch(self, names: list[str]) -> None:
        self._last = names
        self._emit("refused_batch", {"names": names, "count": len(names), "budget": self.budget})

    def _emit(self, kind: str, detail: dict[str, Any]) -> None:
        now = self.clock()
        self.db.write(
            lambda conn: workspace_events.emit(
                conn, kind, now, scope=self.scope, source=self.holder, detail=detail
            )
        )


ClientBudget = WorkspaceBudget | SessionBudget


def client_budget(
    db: Database, settings: Settings, *, holder: str, clock: Callable[[], float] | None = None
) -> ClientBudget:
    """The workspace's budget, or this process's own (``budget_mode``, ``client_budget``)
    under the kill switch ``no_workspace_budget``."""
    if settings.no_workspace_budget:
        return SessionBudget(
            db, mode=settings.budget_mode, budget=settings.client_budget, holder=holder, clock=clock
        )
    return WorkspaceBudget(db, holder=holder, clock=clock, refresh_sec=settings.config_check_sec)
