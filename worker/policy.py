"""What happens to a task, decided from plain values (no I/O; tested exhaustively).

The worker's shell calls these with the outcome of a model call and the
task's state, and carries out the decision through ``agentbus.queue``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from agentbus.config import Settings
from agentbus.providers.outcomes import Failed
from agentbus.queue import deadlines
from agentbus.queue.decisions import (
    ALL_COOLING,
    ALL_REFUSED,
    Complete,
    Decision,
    Expire,
    Fail,
    Pause,
    Requeue,
)

__all__ = [
    "ALL_COOLING",
    "ALL_REFUSED",
    "Complete",
    "Expire",
    "Fail",
    "Pause",
    "Requeue",
    "after_failure",
    "backoff_sec",
    "by_deadline",
    "expired",
    "when_no_candidate_left",
]


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
        cooling = gates == ["cooldown"]
        reason = ALL_COOLING if cooling else f"{ALL_REFUSED} ({', '.join(gates)})"
        return Pause(blocked[model], model, reason, dict(blocked), cooldown=cooling)
    return Fail("no usable model: " + "; ".join(refused) if refused else "empty model chain")


def backoff_sec(consecutive_failures: int, steps: Sequence[tuple[int, float]]) -> float:
    """The worker's sleep after its Nth consecutive genuine failure (0: none)."""
    seconds = 0.0
    for failures, step in steps:
        if consecutive_failures >= failures:
            seconds = step
    return seconds


def expired(expires_at: float | None, now: float) -> Expire | None:
    """A claimed task whose deadline has come: it is never started."""
    if expires_at is not None and expires_at <= now:
        return Expire(deadlines.note(expires_at))
    return None


def by_deadline(decision: Decision, expires_at: float | None) -> Decision:
    """A pause or a retry that would wait until the deadline or after it ends the task
    now instead (the next try would not start in time)."""
    if expires_at is None:
        return decision
    match decision:
        case Pause(resume_after=at) | Requeue(run_after=at) if at >= expires_at:
            waits = "resume" if isinstance(decision, Pause) else "retry"
            return Expire(
                f"{deadlines.note(expires_at)}: its {waits} would come at {deadlines.iso(at)}"
            )
    return decision
