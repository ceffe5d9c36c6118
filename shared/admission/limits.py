"""The limited gates of admission: concurrency, bulkheads, sliding windows
(rpm and tokens per provider account, rate per agent) and the daily budgets,
counted from ``call_slots`` and the usage ledger in one statement. Which apply to
a candidate is plain data (``Limits.of``); ``check`` turns the counts into
refusals."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.admission import shares, usage
from agentbus.admission.gates import Code, Refusal, day_of, next_day, window_free_at
from agentbus.admission.routing import Candidate
from agentbus.admission.tokens import UNKNOWN, Tokens, token_window_blocker, token_window_used
from agentbus.catalog import Catalog
from agentbus.config import Settings
from agentbus.db.compiled import prepared
from agentbus.schema import call_slots


@dataclass(frozen=True)
class Limits:
    """The database-backed gates that apply to one candidate (None/0: not configured)."""

    global_concurrency: int
    provider_concurrency: int | None
    bulkhead: tuple[str, int] | None
    rpm: tuple[int, float] | None  # calls per window, per provider account
    agent_rate: tuple[int, float] | None
    tokens: int
    cost: float
    # The token windows (the account's tpm, itpm, otpm; the model's own model_tpm …:
    # tokens per window), and their length (the rpm window's).
    token_limits: tuple[tuple[str, int], ...] = ()
    token_window: float = 60.0
    share: float = 1.0  # the agent's part of its account's windows when others wait

    @classmethod
    def of(
        cls,
        catalog: Catalog,
        settings: Settings,
        c: Candidate,
        agent: str,
        learnt: Mapping[tuple[str, str, str], Mapping[str, int]] | None = None,
    ) -> Limits:
        """The gates of a call to ``c`` for ``agent``; ``learnt``: the token windows the
        answers announced per account and model, for those the config does not set.
        An account's own windows count every model's calls (``tpm``, ``itpm``,
        ``otpm``); a model's (configured or learnt) its calls alone (``model_tpm`` …)."""
        provider = catalog.provider(c.provider)
        account = provider.account(c.account)
        agent_config = catalog.agents.get(agent)
        size = catalog.bulkheads.get(c.bulkhead) if c.bulkhead else None
        own = account.token_limits if account else {}
        said = (learnt or {}).get((c.provider, c.account, c.model), {})
        per_model = {g: n for g, n in said.items() if g not in own}
        per_model |= catalog.model_token_limits(c.model)
        token_limits = {**own, **{f"model_{g}": n for g, n in per_model.items()}}
        return cls(
            settings.global_concurrency,
            provider.concurrency,
            (c.bulkhead, size) if c.bulkhead and size else None,
            (account.rpm, settings.rpm_window_sec) if account and account.rpm else None,
            (agent_config.rate, agent_config.rate_window_sec)
            if agent_config and agent_config.rate
            else None,
            settings.daily_token_budget,
            settings.daily_cost_budget,
            tuple(token_limits.items()),
            settings.rpm_window_sec,
            agent_config.share if agent_config else 1.0,
        )

    def lock_keys(self, c: Candidate, agent: str) -> list[str]:
        """The gates whose counts an admission of ``c`` reads and adds to: each is locked
        while it does (the daily budgets are thresholds over settled usage: no lock)."""
        keys = []
        if self.global_concurrency:
            keys.append("concurrency")
        if self.provider_concurrency:
            keys.append(f"provider:{c.provider}")
        if self.bulkhead:
            keys.append(f"bulkhead:{self.bulkhead[0]}")
        if self.rpm:
            keys.append(f"rpm:{c.provider}/{c.account}")
        if self.token_limits:
            keys.append(f"tokens:{c.provider}/{c.account}")
        if self.agent_rate:
            keys.append(f"agent:{agent}")
        return keys

    @property
    def window_limits(self) -> dict[str, tuple[int, float]]:
        """The sliding windows that count this call (gates of ``WINDOW_SEQ``): their calls
        per window, and its length."""
        configured = {"rpm": self.rpm, "agent_rate": self.agent_rate}
        return {gate: limit for gate, limit in configured.items() if limit}

    @property
    def slot(self) -> bool:
        """Whether an admission takes a ``call_slots`` row (slots and windows count them)."""
        return bool(
            self.global_concurrency
            or self.provider_concurrency
            or self.bulkhead
            or self.rpm
            or self.agent_rate
            or self.token_limits
        )

    @property
    def any(self) -> bool:
        return bool(self.slot or self.tokens or self.cost)

    def reserved(self, need: Tokens) -> Tokens | None:
        """What a call's slot holds of its account's token windows (None: none counts it)."""
        return need if self.token_limits else None

    def too_large(self, c: Candidate, need: Tokens) -> Refusal | None:
        """A call that no token window of its account can ever admit (it needs more than
        the window's limit): refused for good, not paused."""
        for gate, limit in self.token_limits:
            if need.of(gate) > limit:
                detail = (
                    f"{gate}: the call needs ~{need.of(gate):,} tokens, more than the "
                    f"{limit:,} per {self.token_window:g}s {_whose(gate, c)} ever admits"
                )
                return Refusal(Code.TOO_LARGE, 0.0, detail, gate)
        return None

    def check(
        self,
        conn: Connection,
        c: Candidate,
        agent: str,
        now: float,
        gates: dict[str, Any],
        *,
        take: bool,
        recheck: float,
        need: Tokens,
        free: dict[str, int] | None = None,
    ) -> tuple[list[Refusal], list[int]]:
        """The refusals of the limited gates, and the room each leaves (calls that fit now;
        windows count theirs only when not ``take``-ing: the sweeper's question, when
        ``free`` gets the tokens each token window has left too). ``gates`` gets each
        gate's result for the routing history; ``need``: the call's tokens."""
        shape = (*self.shape(take), self.token_gates, self.contended)
        statement = prepared(conn.dialect, counts_statement(*shape))
        answers = statement.tuples(statement.execute(conn, self.params(c, agent, now, need)))[0]
        return self.read(answers, c, agent, now, gates, take=take, recheck=recheck, free=free)

    def shape(self, take: bool) -> tuple[tuple[str, ...], tuple[str, ...], bool, bool]:
        """Which gates ``counts_statement`` counts (its arguments but ``token_gates``)."""
        slot_gates = tuple(gate for gate, _, _ in self._slot_gates())
        return slot_gates, tuple(self.window_limits), take, bool(self.tokens or self.cost)

    @property
    def contended(self) -> bool:
        """Whether the agents' fair shares apply: the account has windows (rpm, tokens,
        the model's own) or its provider slots in flight."""
        return bool(self.rpm or self.provider_concurrency or self.token_limits)

    @property
    def token_gates(self) -> tuple[str, ...]:
        return tuple(gate for gate, _ in self.token_limits)

    def params(
        self, c: Candidate, agent: str, now: float, need: Tokens = UNKNOWN
    ) -> dict[str, Any]:
        """The parameters of ``counts_statement``, and each gate's limit (``p_<gate>_limit``,
        ``p_tokens_limit``, ``p_cost_limit``: what ``slots.take_if_admitted`` compares with;
        a token window's ``p_<gate>_room``: the tokens the calls already in it may hold
        for ``need`` to fit)."""
        params: dict[str, Any] = {
            "p_now": now,
            "p_provider": c.provider,
            "p_account": c.account,
            "p_bulkhead": self.bulkhead[0] if self.bulkhead else None,
            "p_agent": agent,
            "p_day": day_of(now),
            "p_tokens_limit": self.tokens,
            "p_cost_limit": self.cost,
        }
        for gate, _, limit in self._slot_gates():
            params[f"p_{gate}_limit"] = limit
        for gate, (limit, window) in self.window_limits.items():
            params[f"p_{gate}_since"], params[f"p_{gate}_window"] = now - window, window
            params[f"p_{gate}_offset"] = limit - 1
        if self.token_limits:
            params["p_tokens_since"] = now - self.token_window
            params["p_model"] = c.model
        for gate, limit in self.token_limits:
            params[f"p_{gate}_room"] = limit - need.of(gate)
        return params

    def _slot_gates(self) -> list[tuple[str, Code, int]]:
        """The gates that count slots in flight, with their refusal code and limit."""
        return [
            (gate, code, limit)
            for gate, code, limit in (
                ("concurrency", Code.CONCURRENCY_FULL, self.global_concurrency),
                ("provider_concurrency", Code.CONCURRENCY_FULL, self.provider_concurrency),
                ("bulkhead", Code.BULKHEAD_FULL, self.bulkhead[1] if self.bulkhead else None),
            )
            if limit
        ]

    def read(
        self,
        row: Sequence[Any],
        c: Candidate,
        agent: str,
        now: float,
        gates: dict[str, Any],
        *,
        take: bool,
        recheck: float,
        free: dict[str, int] | None = None,
    ) -> tuple[list[Refusal], list[int]]:
        """``check``'s answer from the row of ``counts_statement``."""
        refusals: list[Refusal] = []
        rooms: list[int] = []
        answers = iter(row)
        for gate, code, limit in self._slot_gates():
            used = int(next(answers))
            gates[gate] = f"{used}/{limit}"
            rooms.append(limit - used)
            if used >= limit:
                detail = f"{gate}: {used}/{limit} calls in flight"
                refusals.append(Refusal(code, recheck, detail, gate))
        for gate, (limit, window) in self.window_limits.items():
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
                        gate,
                    )
                )
        for gate, limit in self.token_limits:
            free_at = window_free_at(next(answers), self.token_window, now)
            gates[gate] = "ok" if free_at is None else "refused"
            if not take:
                left = limit - int(next(answers) or 0)
                if free is not None:
                    free[gate] = max(0, left)
            if free_at is not None:
                what = _whose(gate, c)
                detail = f"{gate}: {limit:,} tokens per {self.token_window:g}s for {what}"
                refusals.append(Refusal(Code.RATE_LIMITED, free_at, detail, gate))
        if self.tokens or self.cost:
            tokens, cost = int(next(answers)), float(next(answers))
            over = (self.tokens and tokens >= self.tokens) or (self.cost and cost >= self.cost)
            gates["budget"] = "refused" if over else "ok"
            if over:
                refusals.append(
                    Refusal(
                        Code.BUDGET_EXHAUSTED,
                        next_day(now),
                        f"daily budget used: {tokens} tokens, cost {cost:g}",
                        "budget",
                    )
                )
        if self.contended and next(answers):
            gates["share"] = "check"  # other agents wait: ``shares.check`` decides
        return refusals, rooms


def _whose(gate: str, c: Candidate) -> str:
    """Whose token window ``gate`` is: the account's, or one model's through it."""
    account = f"{c.provider}/{c.account or '-'}"
    return f"{c.model} through {account}" if gate.startswith("model_") else account


class KeptLimits:
    """``Limits.of`` for a worker, which asks for the same few at every call: answers
    kept while the catalog, the settings and the learnt windows are the same objects
    (a reload replaces them; so does learning a window)."""

    MAX = 256  # (candidate, agent) pairs kept for one catalog

    def __init__(self) -> None:
        self._for: tuple[Catalog | None, Settings | None, object] = (None, None, None)
        self._answers: dict[tuple[Candidate, str], Limits] = {}

    def of(
        self,
        catalog: Catalog,
        settings: Settings,
        c: Candidate,
        agent: str,
        learnt: Mapping[tuple[str, str, str], Mapping[str, int]],
    ) -> Limits:
        if (
            self._for[0] is not catalog
            or self._for[1] is not settings
            or self._for[2] is not learnt
        ):
            self._for, self._answers = (catalog, settings, learnt), {}
        answers = self._answers
        found = answers.get((c, agent))
        if found is None:
            found = Limits.of(catalog, settings, c, agent, learnt)
            if len(answers) < self.MAX:
                answers[(c, agent)] = found
        return found


_P_NOW = sa.bindparam("p_now", type_=sa.Float)
#: How each gate that counts slots in flight picks its slots.
_SLOT_GATES: dict[str, Any] = {
    "concurrency": sa.true(),
    "provider_concurrency": call_slots.c.provider == sa.bindparam("p_provider", type_=sa.Text),
    "bulkhead": call_slots.c.bulkhead == sa.bindparam("p_bulkhead", type_=sa.Text),
}
#: The columns that make one sliding window (a provider account's, an agent's).
_WINDOW_KEYS = {
    "rpm": (call_slots.c.provider, call_slots.c.account),
    "agent_rate": (call_slots.c.agent,),
}
#: Each window's numbering of its calls (1, 2, 3 … in admission order).
WINDOW_SEQ: dict[str, Any] = {"rpm": call_slots.c.account_seq, "agent_rate": call_slots.c.agent_seq}


def _window(gate: str, values: Mapping[str, Any]) -> Any:
    """The calls of window ``gate`` whose key columns equal ``values`` (by column name)."""
    return sa.and_(*(column == values[column.name] for column in _WINDOW_KEYS[gate]))


#: How each sliding window picks its calls (bind parameters ``p_<column>``).
_WINDOWS: dict[str, Any] = {
    gate: _window(gate, {c.name: sa.bindparam(f"p_{c.name}", type_=sa.Text) for c in keys})
    for gate, keys in _WINDOW_KEYS.items()
}


@functools.cache
def newest_call(gate: str) -> Any:
    """The newest call of the window ``gate`` (bind parameters ``p_<column>``): its number
    (``seq``) and its time (``admitted_at``); no row: none yet. A CTE, so a statement
    reads it once however many of its parts ask (each subquery is a plan the server
    sets up on every run), down the window's own index whatever the planner's
    statistics say (a fresh table has none)."""
    seq = WINDOW_SEQ[gate]
    keys = [c.desc() for c in _WINDOW_KEYS[gate]]
    newest = sa.select(seq.label("seq"), call_slots.c.admitted_at).where(
        _WINDOWS[gate], seq.is_not(None)
    )
    return newest.order_by(*keys, seq.desc()).limit(1).cte(f"newest_{gate}")


def _newest_seq(gate: str) -> Any:
    """The number of the window's newest call (NULL: none)."""
    return sa.select(newest_call(gate).c.seq).scalar_subquery()


def next_in_window(gate: str) -> Any:
    """The number of a call the window ``gate`` admits now: one past the window's newest.
    Taken under the gate's lock, so no two calls of a window get one number."""
    return sa.func.coalesce(_newest_seq(gate), 0) + 1


@functools.cache
def counts_statement(
    slot_gates: tuple[str, ...],
    windows: tuple[str, ...],
    take: bool,
    budgets: bool,
    token_gates: tuple[str, ...] = (),
    fair: bool = False,
) -> sa.Select[Any]:
    """Every count the gates of one shape need, in one statement: one round trip however
    many gates apply (built once per shape; the values are bind parameters)."""
    asked = count_columns(slot_gates, windows, take, budgets, _P_NOW, token_gates, fair)
    return sa.select(*asked) if asked else sa.select(sa.literal(1))


def count_columns(
    slot_gates: tuple[str, ...],
    windows: tuple[str, ...],
    take: bool,
    budgets: bool,
    now: Any,
    token_gates: tuple[str, ...] = (),
    fair: bool = False,
) -> list[Any]:
    """``counts_statement``'s columns, each named after its gate: the slots in flight
    (``<gate>``); a window's limit-th newest call while it is in the window at ``now``,
    NULL otherwise (``<gate>_nth``: compared as ``gates.window_free_at`` compares, so
    both read it alike); its calls (``<gate>_calls``, when not ``take``-ing); a token
    window's call that must leave it first (``<gate>_free``, ``token_window_blocker``)
    and its tokens (``<gate>_used``, when not ``take``-ing); the day's ``tokens`` and
    ``cost``; and whether other agents wait for the account or its provider's slots
    (``others_waiting``, when ``fair``: their shares then decide too)."""
    asked: list[Any] = []
    open_slot = sa.and_(call_slots.c.released_at.is_(None), call_slots.c.lease_until > _P_NOW)
    for gate in slot_gates:
        asked.append(
            sa.select(sa.func.count())
            .select_from(call_slots)
            .where(open_slot, _SLOT_GATES[gate])
            .scalar_subquery()
            .label(gate)
        )
    for gate in windows:
        since = sa.bindparam(f"p_{gate}_since", type_=sa.Float)
        window = sa.bindparam(f"p_{gate}_window", type_=sa.Float)
        in_window = sa.and_(_WINDOWS[gate], call_slots.c.admitted_at > since)
        nth = _newest_seq(gate) - sa.bindparam(f"p_{gate}_offset", type_=sa.Integer)
        at = call_slots.c.admitted_at
        asked.append(  # the limit-th newest call, if it is in the window: found by number
            sa.select(sa.case((at + window > now, at), else_=None))
            .where(_WINDOWS[gate], WINDOW_SEQ[gate] == nth)
            .limit(1)
            .scalar_subquery()
            .label(f"{gate}_nth")
        )
        if not take:
            asked.append(
                sa.select(sa.func.count())
                .select_from(call_slots)
                .where(in_window)
                .scalar_subquery()
                .label(f"{gate}_calls")
            )
    for gate in token_gates:
        asked.append(token_window_blocker(gate).scalar_subquery().label(f"{gate}_free"))
        if not take:
            asked.append(token_window_used(gate).scalar_subquery().label(f"{gate}_used"))
    if budgets:
        tokens, cost = usage.today_columns(sa.bindparam("p_day", type_=sa.Float))
        asked += [tokens.label("tokens"), cost.label("cost")]
    if fair:
        asked.append(shares.others_waiting(now).label("others_waiting"))
    return asked


def admitted_now(windows: tuple[str, ...]) -> Any:
    """SQL: an admission's time: ``p_now``, or the time of the newest call of one of its
    ``windows`` if that is later (a clock read before the gates' locks were granted, or
    a host's clock behind another's). A window's calls then keep their times in their
    order, which its count by number relies on."""
    if not windows:
        return _P_NOW
    times = [sa.select(_P_NOW.label("at"))]
    times += [sa.select(newest_call(gate).c.admitted_at) for gate in windows]
    return sa.select(sa.func.max(sa.union_all(*times).subquery().c.at)).scalar_subquery()


def admits(
    counts: Any,
    slot_gates: tuple[str, ...],
    windows: tuple[str, ...],
    budgets: bool,
    token_gates: tuple[str, ...] = (),
    fair: bool = False,
) -> Any:
    """SQL: every gate admits, read from ``counts`` (``counts_statement`` of that shape, as
    a CTE) exactly as ``Limits.read`` reads it, against the limits ``Limits.params`` binds."""
    holds: list[Any] = [
        counts.c[gate] < sa.bindparam(f"p_{gate}_limit", type_=sa.Integer) for gate in slot_gates
    ]
    holds += [counts.c[f"{gate}_nth"].is_(None) for gate in windows]
    holds += [counts.c[f"{gate}_free"].is_(None) for gate in token_gates]
    if budgets:
        tokens = sa.cast(sa.bindparam("p_tokens_limit", type_=sa.BigInteger), sa.BigInteger)
        cost = sa.cast(sa.bindparam("p_cost_limit", type_=sa.Float), sa.Float)
        holds.append(sa.or_(tokens == 0, counts.c.tokens < tokens))
        holds.append(sa.or_(cost == 0, counts.c.cost < cost))
    if fair:  # others wait: the shares decide, after this statement (``shares.check``)
        holds.append(sa.not_(counts.c.others_waiting))
    return sa.and_(*holds) if holds else sa.true()
