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

#: A worker that has not beaten for this long is not counted among an agent's idle peers
#: (an idle worker beats every third of its lease: 20 s by default).
PEER_SILENT_SEC = 60.0


def _idle_peers(agent: str, since: float) -> sa.ScalarSelect[int]:
    """The workers of ``agent`` running nothing that have beaten since ``since``."""
    peer = w.alias("peer")
    return (
        sa.select(sa.func.count())
        .where(peer.c.agent == agent, peer.c.current_task.is_(None), peer.c.heartbeat_at >= since)
        .scalar_subquery()
    )


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
        #: The agent's workers running nothing at the last heartbeat, this one counted.
        self.idle_peers = 1

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
        """Write heartbeat, running tasks and backoff state (re-registering if pruned), and
        read how many workers of the agent are idle (``idle_peers``)."""

        def work(conn: Connection) -> int | None:
            now = self.clock()
            return conn.execute(
                sa.update(w)
                .where(w.c.id == self.id)
                .values(heartbeat_at=now, **self._state())
                .returning(_idle_peers(self.agent, now - PEER_SILENT_SEC))
            ).scalar()

        peers = self.db.write(work)
        if peers is None:
            self.register()
        else:
            self.idle_peers = max(int(peers), 1)

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
