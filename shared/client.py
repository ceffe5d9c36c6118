"""The producer API: what an orchestrator written in Python uses.

    from agentbus.client import AgentBus

    with AgentBus("sqlite:///ops_multiagent.db") as bus:
        task_id = bus.enqueue("codex", "Summarise the macro news", models=["sim/a", "sim/b"])
        task = bus.wait(task_id, timeout=600)      # done, failed or error
        print(task.status, task.result)

The URL defaults to $AGENTBUS_DATABASE_URL, then sqlite:///ops_multiagent.db.
Errors a caller can act on are ``agentbus.errors.BusError`` subclasses.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any

from agentbus.config import Settings, load_config
from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.states import TERMINAL
from agentbus.queue.tasks import Task, TaskSpec


class WaitTimeout(TimeoutError):
    """The task did not finish in time (it is still on the queue)."""


class AgentBus:
    """Enqueue tasks and read their results."""

    def __init__(self, url: str | None = None, *, settings: Settings | None = None) -> None:
        base = settings or load_config().settings
        self.settings = base if url is None else base.replace(database_url=url)
        self.db = Database.from_settings(self.settings)
        try:
            self.db.require_migrated()
        except BaseException:
            self.db.dispose()
            raise
        self.queue = TaskQueue(self.db, **self.settings.queue_options())

    def enqueue(
        self,
        agent: str,
        text: str,
        *,
        models: Sequence[str] | None = None,
        role: str | None = None,
        payload: Mapping[str, Any] | None = None,
        priority: int = 0,
        delay_sec: float = 0.0,
        max_attempts: int | None = None,
        key: str | None = None,
    ) -> int:
        """Queue a task and return its id (an existing task's id for a known ``key``)."""
        spec = TaskSpec(
            agent=agent,
            command=text,
            models=tuple(models) if models is not None else None,
            role=role,
            payload=dict(payload or {}),
            priority=priority,
            delay_sec=delay_sec,
            max_attempts=max_attempts,
            key=key,
        )
        return self.queue.enqueue(spec).id

    def get(self, task_id: int) -> Task:
        return self.queue.get(task_id)

    def wait(self, task_id: int, *, timeout: float | None = None, poll: float = 0.5) -> Task:
        """Block until the task is done, failed or error; a paused task keeps waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            task = self.queue.get(task_id)
            if task.status in TERMINAL:
                return task
            if deadline is not None and time.monotonic() >= deadline:
                raise WaitTimeout(f"task {task_id} is still {task.status.value}")
            time.sleep(poll)

    def close(self) -> None:
        self.db.dispose()

    def __enter__(self) -> AgentBus:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
