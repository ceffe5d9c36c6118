"""What becomes of a claimed task, as values: the worker decides, the queue settles.

``TaskQueue.settle`` takes ``Settlement``s (the claim, its
decision, the routing decisions that led to it) and make the one guarded
change the decision names, with its event, in one transaction.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentbus.providers.outcomes import Usage

if TYPE_CHECKING:
    from agentbus.admission.routing import Route

ALL_COOLING = "all candidate models are cooling down"
ALL_REFUSED = "no candidate is admitted now"


@dataclass(frozen=True, slots=True)
class Complete:
    result: str | None
    model: str | None = None
    usage: Usage = field(default_factory=Usage)
    # What the answer said besides its text (model, finish reason, tool calls, usage):
    # the task's result_detail.
    detail: Mapping[str, Any] | None = None


@dataclass(frozen=True, slots=True)
class Pause:
    """Every candidate is temporarily unusable: not a failure, no attempt spent."""

    resume_after: float
    model: str | None  # the candidate that becomes usable first
    reason: str
    cooling: Mapping[str, float] = field(default_factory=dict)
    # Paused on models' cooldowns, not on a gate such as a full rate window: a
    # resumed task pausing again on the same model counts as re-entering it.
    cooldown: bool = True


@dataclass(frozen=True, slots=True)
class Requeue:
    """A retryable failure: the attempt is spent; try again at ``run_after``."""

    run_after: float
    error: str


@dataclass(frozen=True, slots=True)
class Fail:
    """The work cannot succeed."""

    reason: str
    spend_attempt: bool = True


@dataclass(frozen=True, slots=True)
class Crash:
    """An exception in handler or worker code: the task goes to ``error``."""

    error: str


@dataclass(frozen=True, slots=True)
class Release:
    """Give the claim back untouched (shutdown): no attempt spent."""

    reason: str = "shutdown"


@dataclass(frozen=True, slots=True)
class Expire:
    """The task's deadline came (or its next try would come after it): never started."""

    reason: str


Decision = Complete | Pause | Requeue | Fail | Crash | Release | Expire


@dataclass(frozen=True, slots=True)
class Settlement:
    """One claim (``task_id`` held under ``token``) and what becomes of it.

    ``detail`` is added to the event's detail; ``routes`` are the routing
    decisions recorded with the settle (and their calls' usage in the ledger).
    """

    task_id: int
    token: int
    decision: Decision
    routes: Sequence[Route] = ()
    detail: Mapping[str, Any] | None = None
