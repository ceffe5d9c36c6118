"""The task queue: task states and values, the guarded statements, and the one writer.

- ``states``: the task states and every legal transition.
- ``tasks``: a task to enqueue (``TaskSpec``, validated) and a stored one (``Task``).
- ``decisions``: what becomes of a claimed task (``Settlement``: a claim and its decision).
- ``statements``: every ``bus_commands`` UPDATE, derived from the transition table.
- ``task_queue``: ``TaskQueue``, the only code that changes a task's status
  (``sweeps``: its rescue, resume, postpone and demote operations).
- ``events``: the task event log, written in the transaction of each change.
- ``reads``: read-only queries; ``counts``: the tasks per agent and state, kept by
  triggers; ``malformed``: rows written by hand that agentbus
  cannot use; ``retention``: pruning old tasks;
  ``todos``: ``ops_todos``; ``workers``: the worker registry.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentbus.queue.task_queue import Enqueued, Settlement, TaskQueue

__all__ = ["Enqueued", "Settlement", "TaskQueue"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from agentbus.queue import task_queue

        return getattr(task_queue, name)
    raise AttributeError(f"module 'agentbus.queue' has no attribute {name!r}")
