"""Admission against the shared state in the database: the only writer of call_slots,
circuits, circuit_calls and account_state.

Cheap refusals come from per-process caches refreshed every ``cache_sec``
(cooldowns, open circuits). A candidate with no limit configured is admitted
without touching the database; otherwise one transaction checks every
limited gate and takes the slot (Postgres: under one advisory lock, SQLite:
``BEGIN IMMEDIATE``), so two processes never both take the last slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import sqlalchemy as sa
import tenacity
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Connection

from shared import eventlog
from shared.admission import usage
from shared.admission.gates import (
    SLOT_CODES,
    Circuit,
    CircuitRules,
    Code,
    Refusal,
    after_call,
    circuit_admits,
    circuit_failure,
    next_day,
    refuse,
    window_free_at,
)
from shared.admission.routing import Candidate, Resolution, fingerprint, resolve
from shared.config import Config
from shared.cooldowns import CooldownStore
from shared.db import Database
from shared.logging import get_logger
from shared.outcomes import Outcome
from shared.schema import account_state, call_slots, circuit_calls, circuits

log = get_logger("agentbus.admission")
ADVISORY_KEY = 0x61646D6974  # "admit": one lock serializes admissions on Postgres


@dataclass(eq=False)
class Permit:
    """Leave to make one call. Used as a context manager: leaving it releases the slot
    (also on an exception); a process that dies returns it by lease expiry."""

    admission: Admission
    candidate: Candidate
    slot_id: int | None
    probe: bool
    gates: dict[str, Any] = field(default_factory=dict)
    finished: bool = False

    def __enter__(self) -> Permit:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.finished:
            self.admission.finish(self, None)


@dataclass(frozen=True)
class Admissible:
    """A peek's yes: ``room`` more calls fit now (None: no limit counts them)."""

    room: int | None = None


@dataclass(frozen=True)
class _Limits:
    """The database-backed gates that apply to one candidate."""

    global_concurrency: int
    provider_concurrency: int | None
    bulkhead: tuple[str, int] | None
    rpm: int | None
    agent_rate: tuple[int, float] | None
    tokens: int
    cost: float

    @property
    def slot(self) -> bool:
        return bool(
            self.global_concurrency
            or self.provider_concurrency
            or self.bulkhead
            or self.rpm
            or self.agent_rate
        )


class Admission:
    def __init__(
        self,
        db: Database,
        config: Config,
        *,
        worker: str,
        cooldowns: CooldownStore,
        environ: Mapping[str, str] | None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        cache_sec: float = 1.0,
    ) -> None:
        self.db = db
        self.worker = worker
        self.cooldowns = cooldowns
        self.environ = environ
        self.clock = clock
        self.sleep = sleep
        self.cache_sec = cache_sec
        self._read_at: float | None = None
        self._circuits: dict[str, tuple[str, Circuit]] = {}  # provider -> (endpoint, state)
        self._unusable: set[tuple[str, str, str]] = set()
        self.configure(config)

    def configure(self, config: Config) -> None:
        """Take a (re)loaded config; counters, windows and circuits live on in the database."""
        self.catalog = config.catalog
        s = self.settings = config.settings
        self.rules = CircuitRules(
            s.circuit_window_sec,
            s.circuit_failure_rate,
            s.circuit_min_calls,
            s.circuit_consecutive_failures,
            s.circuit_open_sec,
        )

    # -- resolving -----------------------------------------------------------

    def resolve(
        self, *, models: tuple[str, ...] | None, role: str | None, agent: str
    ) -> Resolution:
        self._refresh()
        return resolve(
            self.catalog,
            models=models,
            role=role,
            agent=agent,
            environ=self.environ,
            unusable=self._unusable,
        )

    # -- admitting -----------------------------------------------------------

    def admit(
        self, candidate: Candidate, *, agent: str, task_id: int | None, lease_sec: float
    ) -> Permit | Refusal:
        """A permit for one call now, or the refusal of the gate that admits last.

        Slots held by others (concurrency, bulkhead) are waited for up to
        ``admission_wait_ms`` before refusing.
        """
        wait = self.settings.admission_wait_ms / 1000
        attempt = self._admit_once
        answer = attempt(candidate, agent, task_id, lease_sec, True)
        if not _slot_refusal(answer) or wait <= 0:
            assert isinstance(answer, (Permit, Refusal))  # only a peek answers otherwise
            return answer
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(_slot_refusal),
            stop=tenacity.stop_after_delay(wait),
            wait=tenacity.wait_fixed(min(0.02, wait)),
            sleep=self.sleep,
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        result = retrying(attempt, candidate, agent, task_id, lease_sec, True)
        assert isinstance(result, (Permit, Refusal))
        return result

    def peek(self, candidate: Candidate, *, agent: str) -> Refusal | Admissible:
        """Would ``candidate`` be admitted now, and how many calls fit? Takes nothing
        (the sweeper's resume check: it resumes no more tasks than there is room for)."""
        answer = self._admit_once(candidate, agent, None, 0.0, False)
        assert not isinstance(answer, Permit)
        return Admissible() if answer is None else answer

    def _admit_once(
        self, c: Candidate, agent: str, task_id: int | None, lease_sec: float, take: bool
    ) -> Permit | Refusal | Admissible | None:
        """Permit or refusal; when not ``take``-ing, Admissible (or None: no limit)."""
        now = self.clock()
        self._refresh()
        gates: dict[str, Any] = {}
        refusals: list[Refusal] = []
        cooling = self.cooldowns.cooling(dict.fromkeys((c.model, c.key)))
        if cooling:
            until = max(cooling.values())
            refusals.append(Refusal(Code.COOLDOWN, until, f"{c.key} is cooling down"))
        gates["cooldown"] = "ok" if not cooling else "refused"
        verdict: Refusal | str = "ok"
        cached = self._circuit(c.provider)
        if cached is not None:
            verdict = circuit_admits(cached, now, self.settings.admission_recheck_sec)
            if isinstance(verdict, Refusal):
                refusals.append(verdict)
            gates["circuit"] = verdict if isinstance(verdict, str) else "refused"
        limits = self._limits(c, agent)
        limited = bool(limits.slot or limits.tokens or limits.cost)
        if refusals:
            # Refused already (from the caches); but it is admitted only once every
            # gate admits, so the limited ones say how long that is (nothing taken).
            if limited:
                later = self.db.read(
                    lambda conn: self._check(conn, c, agent, None, 0.0, limits, gates, False)
                )
                if isinstance(later, Refusal):
                    refusals.append(later)
            refused = refuse(refusals, gates)
            assert refused is not None
            return refused
        if not limited and verdict == "ok":
            return Permit(self, c, None, False, gates) if take else None

        def work(conn: Connection) -> Permit | Refusal | Admissible:
            return self._check(conn, c, agent, task_id, lease_sec, limits, gates, take)

        return self.db.write(work) if take else self.db.read(work)

    def _check(
        self,
        conn: Connection,
        c: Candidate,
        agent: str,
        task_id: int | None,
        lease_sec: float,
        limits: _Limits,
        gates: dict[str, Any],
        take: bool,
    ) -> Permit | Refusal | Admissible:
        if take and self.db.dialect == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(ADVISORY_KEY)))
        now = self.clock()
        refusals: list[Refusal] = []
        rooms: list[int] = []
        recheck = now + self.settings.admission_recheck_sec
        open_slot = sa.and_(call_slots.c.released_at.is_(None), call_slots.c.lease_until > now)
        slots_gates = [
            (gate, code, limit, where)
            for gate, code, limit, where in (
                ("concurrency", Code.CONCURRENCY_FULL, limits.global_concurrency, sa.true()),
                (
                    "provider_concurrency",
                    Code.CONCURRENCY_FULL,
                    limits.provider_concurrency,
                    call_slots.c.provider == c.provider,
                ),
                (
                    "bulkhead",
                    Code.BULKHEAD_FULL,
                    limits.bulkhead[1] if limits.bulkhead else None,
                    call_slots.c.bulkhead == (limits.bulkhead[0] if limits.bulkhead else None),
                ),
            )
            if limit
        ]
        windows = []
        if limits.rpm:
            account = sa.and_(
                call_slots.c.provider == c.provider, call_slots.c.account == c.account
            )
            windows.append(("rpm", limits.rpm, self.settings.rpm_window_sec, account))
        if limits.agent_rate:
            n, window = limits.agent_rate
            windows.append(("agent_rate", n, window, call_slots.c.agent == agent))
        # Every count in one statement: one round trip however many gates apply.
        asked: list[sa.ColumnElement[Any]] = []
        for _, _, _, where in slots_gates:
            asked.append(
                sa.select(sa.func.count())
                .select_from(call_slots)
                .where(open_slot, where)
                .scalar_subquery()
            )
        for _, limit, window, where in windows:
            in_window = sa.and_(where, call_slots.c.admitted_at > now - window)
            asked.append(  # the limit-th newest call of the window, if there are that many
                sa.select(call_slots.c.admitted_at)
                .where(in_window)
                .order_by(call_slots.c.admitted_at.desc())
                .offset(limit - 1)
                .limit(1)
                .scalar_subquery()
            )
            if not take:
                asked.append(
                    sa.select(sa.func.count())
                    .select_from(call_slots)
                    .where(in_window)
                    .scalar_subquery()
                )
        if limits.tokens or limits.cost:
            asked += usage.today_columns(now)
        answers = iter(conn.execute(sa.select(*asked)).one() if asked else ())
        for gate, code, limit, _ in slots_gates:
            used = int(next(answers))
            gates[gate] = f"{used}/{limit}"
            rooms.append(limit - used)
            if used >= limit:
                refusals.append(Refusal(code, recheck, f"{gate}: {used}/{limit} calls in flight"))
        for gate, limit, window, _ in windows:
            free_at = window_free_at(next(answers), window, now)
            gates[gate] = "ok" if free_at is None else "refused"
            if not take:
                counted = int(next(answers))
                if free_at is None:
                    rooms.append(limit - counted)
            if free_at is not None:
                what = f"{c.provider}/{c.account or '-'}" if gate == "rpm" else f"agent {agent}"
                refusals.append(
                    Refusal(
                        Code.RATE_LIMITED,
                        free_at,
                        f"{gate}: {limit} calls per {window:g}s for {what}",
                    )
                )
        if limits.tokens or limits.cost:
            tokens, cost = int(next(answers)), float(next(answers))
            over = (limits.tokens and tokens >= limits.tokens) or (
                limits.cost and cost >= limits.cost
            )
            gates["budget"] = "refused" if over else "ok"
            if over:
                refusals.append(
                    Refusal(
                        Code.BUDGET_EXHAUSTED,
                        next_day(now),
                        f"daily budget used: {tokens} tokens, cost {cost:g}",
                    )
                )
        probe = False
        if "circuit" in gates and gates["circuit"] != "ok":
            verdict = circuit_admits(
                self._circuit_row(conn, c.provider), now, self.settings.admission_recheck_sec
            )
            gates["circuit"] = verdict if isinstance(verdict, str) else "refused"
            if isinstance(verdict, Refusal):
                refusals.append(verdict)
            probe = verdict == "probe"
        refused = refuse(refusals, gates)
        if refused is not None:
            return refused
        if not take:
            return Admissible(min(rooms) if rooms else None)
        if probe:
            conn.execute(
                sa.update(circuits)
                .where(circuits.c.provider == c.provider)
                .values(
                    state="half_open",
                    probe_owner=self.worker,
                    probe_until=now + lease_sec,
                    updated_at=now,
                )
            )
            log.info("circuit_probe", provider=c.provider, worker=self.worker)
            eventlog.emit(
                conn, "circuit_half_open", now, source=self.worker, detail={"provider": c.provider}
            )
        slot_id = None
        if limits.slot:
            slot_id = conn.execute(
                sa.insert(call_slots)
                .values(
                    provider=c.provider,
                    account=c.account,
                    model=c.model,
                    agent=agent,
                    bulkhead=c.bulkhead,
                    task_id=task_id,
                    worker=self.worker,
                    admitted_at=now,
                    lease_until=now + lease_sec,
                )
                .returning(call_slots.c.id)
            ).scalar_one()
        return Permit(self, c, slot_id, probe, gates)

    def _limits(self, c: Candidate, agent: str) -> _Limits:
        provider = self.catalog.provider(c.provider)
        account = provider.account(c.account)
        agent_config = self.catalog.agents.get(agent)
        size = self.catalog.bulkheads.get(c.bulkhead) if c.bulkhead else None
        return _Limits(
            self.settings.global_concurrency,
            provider.concurrency,
            (c.bulkhead, size) if c.bulkhead and size else None,
            account.rpm if account else None,
            (agent_config.rate, agent_config.rate_window_sec)
            if agent_config and agent_config.rate
            else None,
            self.settings.daily_token_budget,
            self.settings.daily_cost_budget,
        )

    # -- after the call ------------------------------------------------------

    def finish(self, permit: Permit, outcome: Outcome | None) -> None:
        """Release the permit's slot and count the outcome in the provider's circuit."""
        if permit.finished:
            return
        permit.finished = True
        c = permit.candidate
        provider = self.catalog.provider(c.provider)
        failed = circuit_failure(outcome) if outcome is not None and provider.circuit else None
        if permit.probe and failed is None:
            failed = outcome is None  # a probe that ended without an answer did not succeed
        if permit.slot_id is None and failed is None:
            return

        def work(conn: Connection) -> None:
            now = self.clock()
            if permit.slot_id is not None:
                conn.execute(
                    sa.update(call_slots)
                    .where(call_slots.c.id == permit.slot_id)
                    .values(released_at=now)
                )
            if failed is not None:
                self._count(conn, c.provider, provider.endpoint, failed, permit.probe, now)

        self.db.write(work)

    def _count(
        self, conn: Connection, name: str, endpoint: str, failed: bool, probe: bool, now: float
    ) -> None:
        if self.db.dialect == "postgresql":
            conn.execute(sa.select(sa.func.pg_advisory_xact_lock(ADVISORY_KEY)))
        row = conn.execute(sa.select(circuits).where(circuits.c.provider == name)).first()
        if row is None or row.endpoint != endpoint:  # a new endpoint starts afresh
            conn.execute(sa.delete(circuits).where(circuits.c.provider == name))
            conn.execute(sa.delete(circuit_calls).where(circuit_calls.c.provider == name))
            conn.execute(
                sa.insert(circuits).values(provider=name, endpoint=endpoint, updated_at=now)
            )
            before = Circuit()
        else:
            before = _circuit_of(row)
        conn.execute(sa.insert(circuit_calls).values(provider=name, at=now, failed=failed))
        since = now - self.rules.window_sec
        conn.execute(
            sa.delete(circuit_calls).where(
                circuit_calls.c.provider == name, circuit_calls.c.at <= since
            )
        )
        calls, failures = conn.execute(
            sa.select(
                sa.func.count(),
                sa.func.coalesce(sa.func.sum(sa.case((circuit_calls.c.failed, 1), else_=0)), 0),
            ).where(circuit_calls.c.provider == name, circuit_calls.c.at > since)
        ).one()
        is_probe = probe and before.probe_owner == self.worker
        after = after_call(
            before,
            failed=failed,
            probe=is_probe,
            window_calls=int(calls),
            window_failures=int(failures),
            now=now,
            rules=self.rules,
        )
        opened_at = None
        if after.state != "closed":
            opened_at = now if before.state == "closed" else getattr(row, "opened_at", None)
        conn.execute(
            sa.update(circuits)
            .where(circuits.c.provider == name)
            .values(
                state=after.state,
                consecutive_failures=after.consecutive_failures,
                opened_at=opened_at,
                open_until=after.open_until,
                probe_owner=after.probe_owner,
                probe_until=after.probe_until,
                updated_at=now,
            )
        )
        if after.state == "closed" and before.state != "closed":
            conn.execute(sa.delete(circuit_calls).where(circuit_calls.c.provider == name))
        if after.state != before.state:
            detail = {
                "provider": name,
                "consecutive_failures": after.consecutive_failures,
                "window": f"{failures}/{calls} failed",
                "open_until": after.open_until,
            }
            eventlog.emit(conn, f"circuit_{after.state}", now, source=self.worker, detail=detail)
        self._circuits[name] = (endpoint, after)

    def mark_unusable(self, candidate: Candidate, reason: str) -> None:
        """A refused credential: leave the account out until its config changes."""
        provider = self.catalog.provider(candidate.provider)
        account = provider.account(candidate.account)
        if account is None or self.environ is None:
            return
        print_ = fingerprint(provider, account, self.environ)
        now = self.clock()
        insert = (postgresql.insert if self.db.dialect == "postgresql" else sqlite.insert)(
            account_state
        )
        stmt = insert.on_conflict_do_update(
            index_elements=[account_state.c.provider, account_state.c.account],
            set_={
                "fingerprint": insert.excluded.fingerprint,
                "reason": insert.excluded.reason,
                "unusable_since": insert.excluded.unusable_since,
            },
        )
        row = {
            "provider": provider.name,
            "account": account.name,
            "fingerprint": print_,
            "reason": reason[:500],
            "unusable_since": now,
        }
        self.db.write(lambda conn: conn.execute(stmt, row))
        self._unusable.add((provider.name, account.name, print_))

    def purge(self) -> int:
        """Delete slots no window counts any more and circuit calls out of their window."""
        now = self.clock()
        windows = [self.settings.rpm_window_sec, self.settings.circuit_window_sec]
        windows += [a.rate_window_sec for a in self.catalog.agents.values()]
        cutoff = now - max(windows)

        def work(conn: Connection) -> int:
            gone = conn.execute(
                sa.delete(call_slots).where(
                    call_slots.c.admitted_at < cutoff,
                    sa.or_(call_slots.c.released_at.is_not(None), call_slots.c.lease_until < now),
                )
            ).rowcount
            conn.execute(
                sa.delete(circuit_calls).where(
                    circuit_calls.c.at < now - self.settings.circuit_window_sec
                )
            )
            return int(gone)

        return self.db.write(work)

    # -- the caches ----------------------------------------------------------

    def refresh(self) -> None:
        """Read circuits and refused accounts now (the sweeper: once per pass)."""
        self._read_at = None
        self._refresh()

    def _refresh(self) -> None:
        now = self.clock()
        if self._read_at is not None and now - self._read_at < self.cache_sec:
            return

        def work(conn: Connection) -> tuple[list[Any], list[Any]]:
            return (
                list(conn.execute(sa.select(circuits))),
                list(
                    conn.execute(
                        sa.select(
                            account_state.c.provider,
                            account_state.c.account,
                            account_state.c.fingerprint,
                        )
                    )
                ),
            )

        rows, accounts = self.db.read(work)
        self._circuits = {r.provider: (r.endpoint, _circuit_of(r)) for r in rows}
        self._unusable = {(a.provider, a.account, a.fingerprint) for a in accounts}
        self._read_at = now

    def _circuit(self, name: str) -> Circuit | None:
        """The provider's circuit as last read (None: it has no circuit breaker)."""
        provider = self.catalog.provider(name)
        if not provider.circuit:
            return None
        endpoint, state = self._circuits.get(name, (provider.endpoint, Circuit()))
        return state if endpoint == provider.endpoint else Circuit()

    def _circuit_row(self, conn: Connection, name: str) -> Circuit:
        row = conn.execute(sa.select(circuits).where(circuits.c.provider == name)).first()
        if row is None or row.endpoint != self.catalog.provider(name).endpoint:
            return Circuit()
        return _circuit_of(row)


def _circuit_of(row: Any) -> Circuit:
    return Circuit(
        row.state, row.consecutive_failures, row.open_until, row.probe_owner, row.probe_until
    )


def _slot_refusal(answer: object) -> bool:
    return isinstance(answer, Refusal) and answer.code in SLOT_CODES
