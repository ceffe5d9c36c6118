"""Admission: whether a call to a candidate may start now, and what its answer teaches.

``Admission`` owns every gate: model cooldowns (``cooldowns``), the client
budget (``budget``), circuits (``circuit``), concurrency slots, bulkheads,
rate windows and daily budgets (``limits``). A worker asks ``admit`` right
before a call and reports the outcome to ``finish``, which releases the
slots, counts the outcome in the provider's circuit, cools the model down on
a rate-limited, overloaded or timed-out answer (or a success whose rate-limit
headers say the account has nothing left), and leaves a refused credential out.
It is the only writer of call_slots (its statements: ``slots``) and of
account_state (``accounts``).

Cheap refusals come from per-process caches refreshed every ``cache_sec``
(cooldowns, open circuits). A candidate with no limit configured is admitted
without touching the database; otherwise one transaction checks every
limited gate and takes the slot (PostgreSQL: under a lock per gate, in one
round trip; SQLite: ``BEGIN IMMEDIATE``), so two processes never both take
the last slot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from sqlalchemy.engine import Connection

from agentbus.admission import accounts, shares, slots, tokens
from agentbus.admission.budget import ClientBudget, Reserve, WorkspaceBudget
from agentbus.admission.circuit import CircuitStore
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import (
    Admissible,
    Code,
    Cooled,
    Refusal,
    circuit_admits,
    circuit_failure,
    cools,
    cost,
    refuse,
    slot_refusal,
)
from agentbus.admission.limits import KeptLimits
from agentbus.admission.routing import Candidate, KeptResolutions, Resolution
from agentbus.admission.slots import Ask
from agentbus.catalog import Catalog
from agentbus.config import Config, Configured, LiveConfig, Settings
from agentbus.db import Database
from agentbus.db.compiled import at_once, can_run_at_once, prepared
from agentbus.logging import get_logger
from agentbus.providers.outcomes import AuthFailed, Outcome, RateLimited, Succeeded, TimedOut, Usage

log = get_logger("agentbus.admission")

_NO_PASS = nullcontext()  # a walk without a client budget


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
    budget_slot: str | None = None  # the client-budget name reserved for the call

    def __enter__(self) -> Permit:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.finished:
            self.admission.finish(self, None)


class Admission:
    def __init__(
        self,
        db: Database,
        config: Config | Configured,
        *,
        worker: str,
        cooldowns: CooldownStore,
        environ: Mapping[str, str] | None,
        budget: ClientBudget | None = None,
        clock: Callable[[], float] | None = None,
        sleep: Callable[[float], None] = time.sleep,
        cache_sec: float = 1.0,
    ) -> None:
        self.db = db
        # PostgreSQL: a limited admission is one round trip (``_take_at_once``).
        self._at_once = can_run_at_once(db.engine.dialect)
        self.worker = worker
        self.cooldowns = cooldowns
        # A workspace budget may be switched on at any time (busctl budget set); a
        # process's own budget that is off stays off.
        changeable = isinstance(budget, WorkspaceBudget)
        self.budget = (
            budget if budget is not None and (changeable or budget.mode != "off") else None
        )
        self.environ = environ
        self.clock = clock or db.clock
        self.sleep = sleep
        self.cache_sec = cache_sec
        self._read_at: float | None = None
        self._unusable: set[accounts.Unusable] = set()
        self.learnt = accounts.LearntWindows(every=cache_sec)  # windows answers announced
        self.demand = shares.Demand()  # this process's agents waiting for accounts
        self._resolutions = KeptResolutions()
        self._limits = KeptLimits()
        # A reloaded config applies at the next call: windows, slots and circuits
        # live on in the database, keyed by the names the config gives.
        self.live: Configured = (
            LiveConfig(config, watch=False) if isinstance(config, Config) else config
        )
        self.circuits = CircuitStore(worker, lambda: self.settings)

    @property
    def catalog(self) -> Catalog:
        return self.live.catalog

    @property
    def settings(self) -> Settings:
        return self.live.settings

    # -- resolving -----------------------------------------------------------

    def resolve(
        self, *, models: tuple[str, ...] | None, role: str | None, agent: str
    ) -> Resolution:
        """The task's candidates (``routing.resolve``, answers kept while the catalog, the
        refused credentials and the key variables' values stay as they were)."""
        self._refresh()
        return self._resolutions.resolve(
            self.catalog,
            models=models,
            role=role,
            agent=agent,
            environ=self.environ,
            unusable=self._unusable,
        )

    # -- admitting -----------------------------------------------------------

    def walk(self) -> AbstractContextManager[object]:
        """One task's walk over its candidates: its client-budget refusals, one event."""
        return _NO_PASS if self.budget is None else self.budget.bulk_pass()

    def admit(
        self,
        candidate: Candidate,
        *,
        agent: str,
        task_id: int | None,
        lease_sec: float | None = None,
        request: tokens.Request | tokens.Tokens | None = None,
    ) -> Permit | Refusal:
        """A permit for one call now, or the refusal of the gate that admits last.

        The client budget is asked first (a slot named after the provider), then
        the gates. Slots held by others (concurrency, bulkhead) are waited for
        up to ``admission_wait_ms`` before refusing. ``lease_sec``: how long the
        slots are held at most (default: every try of the call, with margin).
        ``request``: what the call sends, which the token windows estimate, or the
        tokens it will use (None: not known; admitted while they have room).
        """
        lease = self.lease_for(candidate) if lease_sec is None else lease_sec
        budget = self.budget
        refused = Reserve.REFUSED
        if (
            budget is not None
            and budget.try_reserve(candidate.provider, lease_sec=lease) is refused
        ):
            recheck = self.clock() + self.settings.admission_recheck_sec
            detail = f"the client budget ({budget.budget}) is full"
            return Refusal(Code.CLIENT_BUDGET, recheck, detail, "client_budget")
        try:
            answer = self._admit_gates(candidate, agent, task_id, lease, request)
            self.demand.refused(self.db, self.live, candidate, agent, answer)
        except BaseException:
            if budget is not None:
                budget.release(candidate.provider)
            raise
        if budget is not None:
            if isinstance(answer, Permit):
                answer.budget_slot = candidate.provider
            else:
                budget.release(candidate.provider)
        return answer

    def _admit_gates(
        self,
        candidate: Candidate,
        agent: str,
        task_id: int | None,
        lease_sec: float,
        request: tokens.Request | tokens.Tokens | None,
    ) -> Permit | Refusal:
        wait = self.settings.admission_wait_ms / 1000
        attempt = self._admit_once
        answer = attempt(candidate, agent, task_id, lease_sec, True, request)
        if not slot_refusal(answer) or wait <= 0:
            assert isinstance(answer, (Permit, Refusal))  # only a peek answers otherwise
            return answer
        import tenacity  # only when a slot is to be waited for

        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_result(slot_refusal),
            stop=tenacity.stop_after_delay(wait),
            wait=tenacity.wait_fixed(min(0.02, wait)),
            sleep=self.sleep,
            retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
        )
        result = retrying(attempt, candidate, agent, task_id, lease_sec, True, request)
        assert isinstance(result, (Permit, Refusal))
        return result

    def peek(
        self, candidate: Candidate, *, agent: str, need: tokens.Tokens | None = None
    ) -> Refusal | Admissible:
        """Would ``candidate`` admit a call (of ``need`` tokens) now, and how many calls
        and tokens fit? Takes nothing (the sweeper's look before it resumes tasks)."""
        answer = self._admit_once(candidate, agent, None, 0.0, False, need)
        assert not isinstance(answer, Permit)
        self.demand.refused(self.db, self.live, candidate, agent, answer)
        return Admissible() if answer is None else answer

    def estimate(
        self, c: Candidate, agent: str, request: Callable[[], tokens.Request | None]
    ) -> tokens.Tokens | None:
        """A task's call to ``c`` (``request`` reads it, if a token window counts it): its
        tokens (None: none counts them, or it is larger than one: refused for good)."""
        limits = self._limits.of(self.catalog, self.settings, c, agent, self.learnt.known)
        said = request() if limits.token_limits else None
        need = tokens.need_of(self.catalog, self.settings, c, said)
        return need if said is not None and not limits.too_large(c, need) else None

    def _admit_once(
        self,
        c: Candidate,
        agent: str,
        task_id: int | None,
        lease_sec: float,
        take: bool,
        request: tokens.Request | tokens.Tokens | None = None,
    ) -> Permit | Refusal | Admissible | None:
        """Permit or refusal; when not ``take``-ing, Admissible (or None: no limit)."""
        now = self.clock()
        self._refresh()
        gates: dict[str, Any] = {}
        refusals: list[Refusal] = []
        cooling = self.cooldowns.cooling(dict.fromkeys((c.model, c.key)))
        if cooling:
            until = max(cooling.values())
            refusals.append(Refusal(Code.COOLDOWN, until, f"{c.key} is cooling down", "cooldown"))
        gates["cooldown"] = "ok" if not cooling else "refused"
        verdict: Refusal | str = "ok"
        cached = self.circuits.cached(self.catalog.provider(c.provider))
        if cached is not None:
            verdict = circuit_admits(cached, now, self.settings.admission_recheck_sec)
            if isinstance(verdict, Refusal):
                refusals.append(verdict)
            gates["circuit"] = verdict if isinstance(verdict, str) else "refused"
        limits = self._limits.of(self.catalog, self.settings, c, agent, self.learnt.known)
        limited = limits.any
        need = tokens.UNKNOWN
        if limits.token_limits:
            need = tokens.need_of(self.catalog, self.settings, c, request)
        too_large = limits.too_large(c, need) if limits.token_limits else None
        if too_large is not None:  # never admitted: whatever else refuses, this is final
            gates[too_large.gate] = "refused"
            return Refusal(too_large.code, now, too_large.detail, too_large.gate, gates)
        ask = Ask(c, agent, task_id, lease_sec, limits, need)
        if refusals:
            # Refused already (from the caches); but it is admitted only once every
            # gate admits, so the limited ones say how long that is (nothing taken).
            if limited:
                later = self.db.read(lambda conn: self._check(conn, ask, gates, False))
                if isinstance(later, Refusal):
                    refusals.append(later)
            refused = refuse(refusals, gates)
            assert refused is not None
            return refused
        if not limited and verdict == "ok":
            return Permit(self, c, None, False, gates) if take else None

        if take and limits.slot and gates.get("circuit", "ok") == "ok" and self._at_once:
            taken = self.db.pinned.write_one(lambda conn: self._take_at_once(conn, ask, gates))
            if taken is not None:
                return taken

        def work(conn: Connection) -> Permit | Refusal | Admissible:
            return self._check(conn, ask, gates, take)

        return self.db.pinned.write(work, durable=False) if take else self.db.read(work)

    def _take_at_once(
        self, conn: Connection, ask: Ask, gates: dict[str, Any]
    ) -> Permit | Refusal | None:
        """PostgreSQL, with no circuit to read: lock the gates, count them and take the slot
        if every one admits, as one transaction in one round trip (``prepared.at_once``;
        the statement decides as ``Limits.read`` does, which then says why it refused)."""
        c, agent, limits = ask.c, ask.agent, ask.limits
        lock = slots.lock_step(conn.dialect, ask.lock_keys(gates))
        slot_gates, windows, _, budgets = limits.shape(take=True)
        take = prepared(
            conn.dialect,
            slots.take_if_admitted(
                slot_gates, windows, budgets, limits.token_gates, limits.contended
            ),
        )
        params = ask.params(self.worker, self.clock())
        row = at_once(conn, [*([lock] if lock else []), (take, params)])[-1][0]
        *counts, admitted_at, slot_id = row
        recheck = admitted_at + self.settings.admission_recheck_sec
        refusals, _ = limits.read(counts, c, agent, admitted_at, gates, take=True, recheck=recheck)
        if slot_id is None and not refusals and gates.get("share") == "check":
            return None  # other agents wait for the account: their shares decide too
        if (slot_id is None) != bool(refusals):  # a bug: the two readings must agree
            raise RuntimeError(
                f"admission of {c.key}: the statement {'refused' if slot_id is None else 'took'}"
                f" a slot its counts {'admit' if not refusals else 'refuse'} ({gates})"
            )
        if slot_id is None:
            refused = refuse(refusals, gates)
            assert refused is not None
            return refused
        return Permit(self, c, slot_id, False, gates)

    def _check(
        self, conn: Connection, ask: Ask, gates: dict[str, Any], take: bool
    ) -> Permit | Refusal | Admissible:
        c, limits = ask.c, ask.limits
        if take:
            slots.lock_gates(conn, ask.lock_keys(gates))
        now = self.clock()
        recheck = now + self.settings.admission_recheck_sec
        free: dict[str, int] = {}  # the tokens each token window has left (a peek's)
        refusals, rooms = limits.check(
            conn, c, ask.agent, now, gates, take=take, recheck=recheck, need=ask.need, free=free
        )
        if gates.get("share") == "check":  # other agents wait for the account
            fair = shares.check(conn, limits, c, ask.agent, ask.need, now, recheck)
            gates["share"] = "ok" if fair is None else "refused"
            refusals += [fair] if fair is not None else []
        probe = False
        if "circuit" in gates and gates["circuit"] != "ok":
            provider = self.catalog.provider(c.provider)
            verdict = circuit_admits(
                self.circuits.current(conn, provider), now, self.settings.admission_recheck_sec
            )
            gates["circuit"] = verdict if isinstance(verdict, str) else "refused"
            if isinstance(verdict, Refusal):
                refusals.append(verdict)
            probe = verdict == "probe"
        refused = refuse(refusals, gates)
        if refused is not None:
            return refused
        if not take:
            return Admissible(min(rooms) if rooms else None, free or None)
        if probe and not self.circuits.take_probe(conn, provider, now, ask.lease_sec):
            detail = "another process holds the probe"
            return Refusal(Code.CIRCUIT_OPEN, recheck, detail, "circuit", gates)
        slot_id = None
        if limits.slot:
            slot = prepared(conn.dialect, slots.take(tuple(limits.window_limits)))
            slot_id = slot.tuples(slot.execute(conn, ask.params(self.worker, now)))[0][0]
        return Permit(self, c, slot_id, probe, gates)

    # -- after the call ------------------------------------------------------

    def finish(self, permit: Permit, outcome: Outcome | None) -> Cooled | None:
        """The call is over: release the permit's slots and learn from its ``outcome``
        (None: it ended without one). Returns what a cooling answer put in cooldown."""
        if permit.finished:
            return None
        permit.finished = True
        if permit.budget_slot is not None and self.budget is not None:
            self.budget.release(permit.budget_slot)
        self._release(permit, outcome)
        if isinstance(outcome, Succeeded | RateLimited) and outcome.announced:  # to learn
            c, window = permit.candidate, self.settings.rpm_window_sec
            self.learnt.heard(self.db, self.catalog, c, outcome.announced, self.clock(), window)
        match outcome:
            case RateLimited() | TimedOut() | Succeeded() if cools(outcome):
                c, now = permit.candidate, self.clock()
                accounts_of = len(self.catalog.provider(c.provider).accounts)
                return self.cooldowns.cool(c, outcome, accounts_of, self.settings, now, self.worker)
            case AuthFailed(detail=detail):
                self.mark_unusable(permit.candidate, detail)
        return None

    def _release(self, permit: Permit, outcome: Outcome | None) -> None:
        """Give back the permit's slot and count the outcome in the provider's circuit."""
        c = permit.candidate
        provider = self.catalog.provider(c.provider)
        failed = circuit_failure(outcome) if outcome is not None and provider.circuit else None
        if permit.probe and failed is None:
            failed = outcome is None  # a probe that ended without an answer did not succeed
        if permit.slot_id is None and failed is None:
            return

        success = (
            failed is False and not permit.probe and self.circuits.counts_success_alone(provider)
        )
        now = self.clock()
        params = {
            "p_id": permit.slot_id,
            "p_now": now,
            "p_provider": provider.name,
            "p_endpoint": provider.endpoint,
            **slots.reported(outcome),  # replace the slot's estimate of its tokens
        }
        if success and permit.slot_id is not None and self.db.dialect == "postgresql":
            # The common case in one statement, its own transaction: one round trip.
            both = prepared(self.db.engine.dialect, slots.RELEASE_AND_COUNT_SUCCESS_POSTGRES)
            self.db.pinned.write_one(lambda conn: both.execute(conn, params))
            return

        def work(conn: Connection) -> None:
            if permit.slot_id is not None:
                # No row matched: the lease ran out and the sweeper purged it: nothing to give.
                postgres = self.db.dialect == "postgresql"
                release = slots.RELEASE_POSTGRES if postgres else slots.RELEASE
                prepared(conn.dialect, release).execute(conn, params)
            if success:
                self.circuits.count_success(conn, provider, now)
            elif failed is not None:
                slots.lock_gates(conn, [f"circuit:{c.provider}"])
                self.circuits.count(conn, provider, failed=failed, probe=permit.probe, now=now)

        self.db.pinned.write(work, durable=False)

    def lease_for(self, candidate: Candidate) -> float:
        """How long a permit's slots are held at most: every try of the call, with margin."""
        timeout = self.catalog.provider(candidate.provider).timeout_sec
        tries = self.settings.call_retries + 1
        waits = self.settings.call_retry_wait_sec * 2**tries
        return float((timeout or self.settings.call_timeout_sec) * tries + waits + 60.0)

    def cost(self, candidate: Candidate, usage: Usage) -> float:
        """What a call's usage cost, at the model's configured prices."""
        model = self.catalog.model(candidate.model)
        return cost(usage, model.input_cost_per_1k, model.output_cost_per_1k)

    def mark_unusable(self, candidate: Candidate, reason: str) -> None:
        """A refused credential: leave the account out until its config changes."""
        refused = accounts.refused(self.catalog, self.environ, candidate)
        if refused is None:
            return
        now = self.clock()
        self.db.write(lambda conn: accounts.mark(conn, refused, reason, now))
        # Replaced, not changed in place: kept resolutions know the set by identity.
        self._unusable = {*self._unusable, refused}

    def purge(self) -> int:
        """Delete slots no window counts any more and circuit calls out of their window."""
        now = self.clock()
        windows = [self.settings.rpm_window_sec, self.settings.circuit_window_sec]
        windows += [a.rate_window_sec for a in self.catalog.agents.values()]
        windows.append(self.catalog.mcp.client_rate_window_sec)  # governed MCP clients
        cutoff = now - max(windows)

        def work(conn: Connection) -> int:
            gone = slots.purge(conn, cutoff, now)
            self.circuits.purge(conn, now)
            shares.purge(conn, now)
            return gone

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

        def work(conn: Connection) -> set[accounts.Unusable]:
            self.circuits.load(conn)
            self.learnt.load(conn)
            return accounts.unusable(conn)

        self._unusable = self.db.read(work)
        self._read_at = now
