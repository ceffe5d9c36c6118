"""The admission gates' decisions, from plain values (no I/O; the store feeds them).

A refusal says which gate refused and exactly when it admits again; the
worker pauses a task until the earliest such time of its candidates.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from agentbus.providers.outcomes import (
    Failed,
    Outcome,
    RateLimited,
    Succeeded,
    TimedOut,
    Usage,
    name_of,
)


class Code(enum.StrEnum):
    """Refusal names. The first three keep the JSON-RPC numbers of the traffic-governance
    contract (-32000, -32001, -32002); the others are their own code."""

    RATE_LIMITED = "rate_limited"
    CIRCUIT_OPEN = "circuit_open"
    BULKHEAD_FULL = "bulkhead_full"
    COOLDOWN = "cooldown"
    BUDGET_EXHAUSTED = "budget_exhausted"
    CONCURRENCY_FULL = "concurrency_full"
    CLIENT_BUDGET = "client_budget"  # the workspace client budget is full
    TOO_LARGE = "too_large"  # one call needs more tokens than a window ever admits

    @property
    def number(self) -> int | None:
        return _NUMBERS.get(self)

    @property
    def wire(self) -> int | str:
        """The ``code`` clients see: the JSON-RPC number where there is one, else the name."""
        number = self.number
        return number if number is not None else self.value

    @property
    def suggested_action(self) -> str:
        return _ACTIONS[self]


_NUMBERS = {Code.RATE_LIMITED: -32000, Code.CIRCUIT_OPEN: -32001, Code.BULKHEAD_FULL: -32002}
_SLOT = "RETRY_WHEN_A_SLOT_FREES"
#: What a client should do about each refusal (agentbus itself pauses the task until
#: ``retry_after``): never retry at once.
_ACTIONS = {
    Code.RATE_LIMITED: "DO_NOT_RETRY_IMMEDIATELY",
    Code.CIRCUIT_OPEN: "WAIT_FOR_CIRCUIT_PROBE",
    Code.BULKHEAD_FULL: _SLOT,
    Code.COOLDOWN: "WAIT_FOR_COOLDOWN",
    Code.BUDGET_EXHAUSTED: "WAIT_FOR_BUDGET_RESET",
    Code.CONCURRENCY_FULL: _SLOT,
    Code.CLIENT_BUDGET: _SLOT,
    Code.TOO_LARGE: "DO_NOT_RETRY",
}
#: Refusals that a short wait may end (another call finishing frees a slot).
SLOT_CODES = frozenset({Code.CONCURRENCY_FULL, Code.BULKHEAD_FULL})


def slot_refusal(answer: object) -> bool:
    """Whether ``answer`` refuses for want of a slot (one may free at any moment)."""
    return isinstance(answer, Refusal) and answer.code in SLOT_CODES


@dataclass(frozen=True)
class Refusal:
    """A candidate may not be called now; ``retry_after`` (epoch) is when it may.

    ``gate`` names the gate that refused (``cooldown``, ``circuit``, ``rpm``,
    ``agent_rate``, ``concurrency``, ``provider_concurrency``, ``bulkhead``,
    ``budget``, ``client_budget``, and the token windows ``tpm``, ``itpm``, ``otpm``);
    ``gates`` is every gate's answer. A ``too_large`` refusal is for good: the
    call can never be admitted, and ``retry_after`` means nothing.
    """

    code: Code
    retry_after: float
    detail: str
    gate: str
    gates: dict[str, Any] = field(default_factory=dict, compare=False)

    def retry_after_ms(self, now: float) -> int:
        return max(0, round((self.retry_after - now) * 1000))

    def as_dict(self, now: float) -> dict[str, Any]:
        """The refusal as every user sees it (route rows, pause events, busctl, status):
        ``{code, name, retry_after_ms, suggested_action, gate, detail}``."""
        return {
            "code": self.code.wire,
            "name": self.code.value,
            "retry_after_ms": self.retry_after_ms(now),
            "suggested_action": self.code.suggested_action,
            "gate": self.gate,
            "detail": self.detail,
        }


class Cooled(NamedTuple):
    """What a cooling answer put in cooldown (``model`` or ``model@account``), and until when."""

    key: str
    until: float


@dataclass(frozen=True)
class Admissible:
    """A peek's yes: ``room`` more calls fit now (None: no limit counts them), and the
    tokens each token window has left now (``tokens``; None: no token window)."""

    room: int | None = None
    tokens: Mapping[str, int] | None = None


def refuse(refusals: list[Refusal], gates: dict[str, Any]) -> Refusal | None:
    """Every gate must admit: the candidate is refused until the last refusing gate admits."""
    if not refusals:
        return None
    last = max(refusals, key=lambda r: r.retry_after)
    return Refusal(last.code, last.retry_after, last.detail, last.gate, gates)


def window_free_at(nth_newest: float | None, window: float, now: float) -> float | None:
    """A sliding window of ``limit`` calls: refused until the limit-th newest call leaves it.

    ``nth_newest`` is the admission time of the limit-th most recent call
    (None: fewer calls than the limit were ever admitted).
    """
    if nth_newest is None or nth_newest + window <= now:
        return None
    return nth_newest + window


def next_day(now: float) -> float:
    """When the current UTC day ends (daily budgets reset)."""
    return (now // 86400 + 1) * 86400


def day_of(at: float) -> float:
    return at // 86400 * 86400


# -- what an answer teaches ---------------------------------------------------


#: A cooldown's reason when the answer's rate-limit headers said nothing is left.
LIMIT_REACHED = "limit_reached"


def cools(outcome: Outcome) -> bool:
    """Whether an outcome puts a model in cooldown: a rate-limited, overloaded or
    timed-out answer, or a success whose headers say the account has nothing left."""
    match outcome:
        case RateLimited() | TimedOut():
            return True
        case Succeeded(limit_reset_sec=reset):
            return bool(reset)
    return False


def cooldown_until(
    outcome: RateLimited | TimedOut | Succeeded,
    now: float,
    cooldown_sec: float,
    timeout_cooldown_sec: float,
) -> float:
    """When a model's cooldown ends: the configured length, or the provider's longer
    ask; for a used-up quota, exactly when the headers say it resets."""
    match outcome:
        case TimedOut():
            return now + timeout_cooldown_sec
        case Succeeded(limit_reset_sec=reset):
            return now + (reset or 0.0)
        case _:
            return now + max(cooldown_sec, outcome.retry_after_sec or 0.0)


def cooldown_key(
    outcome: RateLimited | TimedOut | Succeeded, model: str, candidate_key: str, accounts: int
) -> str:
    """What a cooling answer cools: a 429 (or a used-up quota) through one of several
    accounts is that account's quota (``model@account``); overload and timeouts are
    the model's."""
    quota = isinstance(outcome, Succeeded) or (
        isinstance(outcome, RateLimited) and not outcome.overloaded
    )
    if quota and accounts > 1:
        return candidate_key
    return model


def cooldown_reason(outcome: RateLimited | TimedOut | Succeeded) -> str:
    """A cooldown's reason: the outcome's name, or ``limit_reached`` (headers)."""
    if isinstance(outcome, Succeeded):
        return LIMIT_REACHED
    return name_of(outcome).value


def cost(usage: Usage, input_per_1k: float, output_per_1k: float) -> float:
    """The cost of a call from its usage and the model's prices per 1,000 tokens."""
    return (usage.prompt_tokens * input_per_1k + usage.completion_tokens * output_per_1k) / 1000


# -- the circuit breaker ------------------------------------------------------


def circuit_failure(outcome: Outcome) -> bool | None:
    """Whether an outcome counts against the endpoint's health (None: neither way).

    Errors of the endpoint — 5xx, transport errors, timeouts, overloaded — are
    failures; a success is not. A 429 (our quota), a refused credential or a
    rejected request says nothing about the endpoint.
    """
    match outcome:
        case Succeeded():
            return False
        case TimedOut() | RateLimited(overloaded=True) | Failed(retryable=True):
            return True
        case _:
            return None


@dataclass(frozen=True)
class Circuit:
    state: str = "closed"  # closed | open | half_open
    consecutive_failures: int = 0
    open_until: float | None = None
    probe_owner: str | None = None
    probe_until: float | None = None


@dataclass(frozen=True)
class CircuitRules:
    window_sec: float
    failure_rate: float
    min_calls: int
    consecutive_failures: int
    open_sec: float


def circuit_admits(c: Circuit, now: float, recheck_sec: float) -> Refusal | str:
    """``"ok"``, ``"probe"`` (this call is the one half-open probe), or a refusal."""
    if c.state == "closed":
        return "ok"
    if c.state == "open" and c.open_until is not None and now < c.open_until:
        return Refusal(Code.CIRCUIT_OPEN, c.open_until, "the circuit is open", "circuit")
    if c.state == "half_open" and c.probe_until is not None and now < c.probe_until:
        return Refusal(
            Code.CIRCUIT_OPEN,
            min(c.probe_until, now + recheck_sec),
            "the circuit is half-open and its probe is in flight",
            "circuit",
        )
    return "probe"


def after_call(
    c: Circuit,
    *,
    failed: bool,
    probe: bool,
    window_calls: int,
    window_failures: int,
    now: float,
    rules: CircuitRules,
) -> Circuit:
    """The circuit after a call ended (window counts include this call)."""
    if probe and c.state == "half_open":
        if failed:
            return Circuit("open", c.consecutive_failures + 1, now + rules.open_sec)
        return Circuit("closed")
    consecutive = c.consecutive_failures + 1 if failed else 0
    if c.state != "closed":  # a call admitted before the circuit opened: counted only
        return Circuit(c.state, consecutive, c.open_until, c.probe_owner, c.probe_until)
    tripped = consecutive >= rules.consecutive_failures or (
        window_calls >= rules.min_calls and window_failures >= rules.failure_rate * window_calls
    )
    if failed and tripped:
        return Circuit("open", consecutive, now + rules.open_sec)
    return Circuit("closed", consecutive)
