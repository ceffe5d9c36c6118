"""Task states and the legal transitions between them.

The schema mirrors ``TaskStatus`` with a CHECK constraint; ``agentbus.queue`` is
the only code that moves a task from one state to another, and every move it
makes is one of ``TRANSITIONS``.
"""

from __future__ import annotations

from enum import StrEnum


class TaskStatus(StrEnum):
    QUEUED = "queued"
    CLAIMED = "claimed"
    DONE = "done"
    PAUSED = "paused"
    FAILED = "failed"
    ERROR = "error"
    CANCELLED = "cancelled"


Q, C, D, P, F, E, X = (
    TaskStatus.QUEUED,
    TaskStatus.CLAIMED,
    TaskStatus.DONE,
    TaskStatus.PAUSED,
    TaskStatus.FAILED,
    TaskStatus.ERROR,
    TaskStatus.CANCELLED,
)

#: Every legal move, named by the queue operation that makes it.
TRANSITIONS: dict[str, tuple[frozenset[TaskStatus], TaskStatus]] = {
    "claim": (frozenset({Q}), C),
    "complete": (frozenset({C}), D),
    "fail": (frozenset({C}), F),
    "error": (frozenset({C}), E),
    "pause": (frozenset({C}), P),
    "release": (frozenset({C}), Q),  # shutdown: no attempt spent
    "requeue": (frozenset({C}), Q),  # retryable failure: attempt spent, run_after set
    "rescue": (frozenset({C}), Q),  # lease expired: the worker is gone
    "rescue_fail": (frozenset({C}), F),  # rescued too often: a poison pill
    "resume": (frozenset({P}), Q),
    "demote": (frozenset({P}), F),
    # A row written by hand that no worker can run (agentbus.queue.malformed): the
    # sweeper fails it, whatever state it waits in, so that nothing stays stuck unseen.
    "fail_malformed": (frozenset({Q, P, C}), F),
    "retry": (frozenset({F, E, X}), Q),  # operator
    # Operator or producer; a claimed task's worker finds its claim gone (its settle
    # and lease renewal match nothing) and abandons the call.
    "cancel": (frozenset({Q, P, C}), X),
    # A task not started by its deadline is never started: the worker that claimed it
    # (or whose next try would come after the deadline) ends it; the sweeper ends the
    # ones still waiting.
    "expire": (frozenset({C}), X),
    "lapse": (frozenset({Q, P}), X),
}

LEGAL: frozenset[tuple[TaskStatus, TaskStatus]] = frozenset(
    (src, dst) for sources, dst in TRANSITIONS.values() for src in sources
)

TERMINAL: frozenset[TaskStatus] = frozenset({D, F, E, X})


def is_legal(src: TaskStatus, dst: TaskStatus) -> bool:
    """Whether the state machine allows a task to move from ``src`` to ``dst``."""
    return (src, dst) in LEGAL
