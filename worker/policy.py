"""What happens to a task, decided from plain values (no I/O; tested exhaustively).

The worker's shell calls these with the outcome of a model call and the
task's state, and carries out the decision through ``agentbus.queue``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agentbus.config import Settings
from agentbus.providers.outcomes import Failed, RateLimited, TimedOut, Usage

ALL_COOLING = "all candidate models are cooling down"
ALL_REFUSED = "no candidate is admitted now"


@dataclass(frozen=True)
class Complete:
    result: str
    model: str
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True)
class Pause:
    """Every candidate is temporarily unusable: not a failure, no attempt spent."""

    resume_after: float
    model: str  # the candidate that becomes usable first
    reason: str
    cooling: Mapping[str, float]


@dataclass(frozen=True)
class Requeue:
    """A retryable failure: the attempt is spent; try again at ``run_after``."""

    run_after: float
    error: str


@dataclass(frozen=True)
class Fail:
    reason: str


Decision = Complete | Pause | Requeue | Fail


def cooldown_until(outcome: RateLimited | TimedOut, now: float, settings: Settings) -> float:
    """When a model's cooldown ends: the configured length, or the provider's longer ask."""
    if isinstance(outcome, TimedOut):
        return now + settings.model_timeout_cooldown_sec
    return now + max(settings.model_cooldown_sec, outcome.retry_after_sec or 0.0)


def cooldown_key(
    outcome: RateLimited | TimedOut, model: str, candidate_key: str, accounts: int
) -> str:
    """What a cooling answer cools: a 429 through one of several accounts is that
    account's quota (``model@account``); overload and timeouts are the model's."""
    if isinstance(outcome, RateLimited) and not outcome.overloaded and accounts > 1:
        return candidate_key
    return model


def cost(usage: Usage, input_per_1k: float, output_per_1k: float) -> float:
    """The cost of a call from its usage and the model's prices per 1,000 tokens."""
    return (usage.prompt_tokens * input_per_1k + usage.completion_tokens * output_per_1k) / 1000


def after_failure(
    outcome: Failed, attempts: int, max_attempts: int, now: float, settings: Settings
) -> Requeue | Fail:
    """A failed call (after in-call retries) spends the attempt: re-queue with backoff, or fail."""
    if not outcome.retryable:
        return Fail(outcome.detail)
    spent = attempts + 1
    if spent >= max_attempts:
        return Fail(f"attempts exhausted ({spent}/{max_attempts}): {outcome.detail}")
    delay = min(settings.retry_backoff_sec * 2 ** (spent - 1), settings.retry_backoff_max_sec)
    return Requeue(now + delay, outcome.detail)


def when_no_candidate_left(
    blocked: Mapping[str, float], refused: Sequence[str], codes: Mapping[str, str] | None = None
) -> Pause | Fail:
    """Every candidate was cooling, refused by a gate, or unusable: pause until the
    earliest moment one is admitted again (``blocked``: candidate -> that moment).

    ``codes`` names each blocked candidate's refusal (``cooldown`` when absent).
    Only when none is blocked (every credential was refused or missing) is it a
    failure: pausing would wait for something that does not end by itself.
    """
    if blocked:
        model = min(blocked, key=lambda m: (blocked[m], m))
        gates = sorted({(codes or {}).get(m, "cooldown") for m in blocked})
        reason = ALL_COOLING if gates == ["cooldown"] else f"{ALL_REFUSED} ({', '.join(gates)})"
        return Pause(blocked[model], model, reason, dict(blocked))
    return Fail("no usable model: " + "; ".join(refused) if refused else "empty model chain")


def backoff_sec(consecutive_failures: int, steps: Sequence[tuple[int, float]]) -> float:
    """The worker's sleep after its Nth consecutive genuine failure (0: none)."""
    seconds = 0.0
    for failures, step in steps:
        if consecutive_failures >= failures:
            seconds = step
    return seconds
