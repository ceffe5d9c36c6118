"""The ``workers`` table: one row per live worker process (its only writer).

Operators read it to see who is alive (heartbeat), what each is running (up
to ``concurrency`` tasks at once) and whether it is backing off. A clean exit
removes the row; a killed worker's row goes stale and the sweeper prunes it
after rescuing its tasks.
"""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Callable, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.clock import offset_of
from agentbus.db import Database
from agentbus.schema import workers as w


def new_worker_id(agent: str) -> str:
    return f"{agent}@{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:4]}"


class WorkerRegistry:
    def __init__(
        self,
        db: Database,
        worker_id: str,
        agent: str,
        *,
        concurrency: int = 1,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.db = db
        self.id = worker_id
        self.agent = agent
        self.concurrency = concurrency
        self.clock = clock or db.clock
        self.consecutive_failures = 0
        self.backoff_until: float | None = None
        self.running: dict[int, None] = {}  # task ids in the order they were claimed

    def register(self) -> None:
        now = self.clock()
        row = {
            "id": self.id,
            "agent": self.agent,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": now,
            "heartbeat_at": now,
            "concurrency": self.concurrency,
            **self._state(),
        }
        self.db.write(lambda conn: conn.execute(sa.insert(w), row))

    def beat(self) -> None:
        """Write heartbeat, running tasks and backoff state (re-registering if pruned)."""

        def work(conn: Connection) -> int:
            return conn.execute(
                sa.update(w)
                .where(w.c.id == self.id)
                .values(heartbeat_at=self.clock(), **self._state())
            ).rowcount

        if self.db.write(work) == 0:
            self.register()

    def _state(self) -> dict[str, object]:
        running = list(self.running)  # a copy: the worker's threads change it
        return {
            "current_task": running[0] if running else None,
            "running": running,
            "consecutive_failures": self.consecutive_failures,
            "backoff_until": self.backoff_until,
            "clock_offset": offset_of(self.clock),
        }

    def remove(self) -> None:
        self.db.write(lambda conn: conn.execute(sa.delete(w).where(w.c.id == self.id)))


def drop(db: Database, worker_ids: Sequence[str]) -> int:
    """Delete these workers' rows (written so that no reader can use them); a live
    worker registers again at its next heartbeat."""
    query = sa.delete(w).where(w.c.id.in_(list(worker_ids)))
    return int(db.write(lambda conn: conn.execute(query).rowcount)) if worker_ids else 0


def prune_stale(db: Database, older_than: float) -> int:
    """Delete the rows of workers silent since ``older_than`` (run after rescuing tasks)."""
    return int(
        db.write(
            lambda conn: conn.execute(sa.delete(w).where(w.c.heartbeat_at < older_than)).rowcount
        )
    )
