"""Waking idle workers when a task is queued.

On PostgreSQL the transaction that queues tasks sends ``NOTIFY agentbus_queued``
with the agent's name (delivered on commit); an idle worker of that agent
LISTENs on its own connection and claims within milliseconds. SQLite has no
such thing: there an idle worker looks every ``LOOK_SEC`` (50 ms) with a read
(``TaskQueue.has_due``: an index lookup that takes no lock) and claims only
when something is due. Either way a worker also tries a claim every
``poll_sec``: a notification is a hint, and a task whose ``run_after`` has
just come sends none.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.logging import get_logger

log = get_logger("agentbus.wakeups")

CHANNEL = "agentbus_queued"
SETTLED = "agentbus_settled"  # a task reached an end (done, failed, error, cancelled)
LOOK_SEC = 0.05
_NOTIFY = sa.select(sa.func.pg_notify(CHANNEL, sa.bindparam("agent")))
_SETTLED = sa.select(sa.func.pg_notify(SETTLED, ""))


def notify(conn: Connection, agents: Iterable[str]) -> None:
    """Tell the idle workers of ``agents`` that tasks are queued (PostgreSQL; on commit)."""
    if conn.dialect.name != "postgresql":
        return
    for agent in sorted(set(agents)):
        conn.execute(_NOTIFY, {"agent": agent})


def settled(conn: Connection) -> None:
    """Tell the producers waiting for tasks that some reached an end (PostgreSQL; on
    commit): each looks again at the tasks it waits for."""
    if conn.dialect.name == "postgresql":
        conn.execute(_SETTLED)


class Listener:
    """Calls ``wake()`` whenever ``channel`` is notified with ``payload`` (None: any) — a
    task of an agent queued, or tasks settled — from a thread LISTENing on its own
    PostgreSQL connection; it reconnects after an error, and wakes its owner then
    too, since something may have happened meanwhile."""

    def __init__(
        self,
        conninfo: str,
        wake: Callable[[], None],
        *,
        channel: str = CHANNEL,
        payload: str | None = None,
    ) -> None:
        self.conninfo, self.wake = conninfo, wake
        self.channel, self.payload = channel, payload
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wakeups", daemon=True)

    def start(self) -> Listener:
        self._thread.start()
        return self

    def close(self, wait: float = 0.0) -> None:
        """Stop listening; wait up to ``wait`` seconds for the connection to close."""
        self._closed.set()
        if wait > 0 and self._thread.is_alive():
            self._thread.join(wait)

    def _run(self) -> None:
        import psycopg

        while not self._closed.is_set():
            try:
                with psycopg.connect(self.conninfo, autocommit=True, connect_timeout=10) as conn:
                    conn.execute(f"LISTEN {self.channel}")
                    self.wake()
                    while not self._closed.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if self.payload is None or note.payload == self.payload:
                                self.wake()
            except Exception as exc:  # the database is away: poll meanwhile, try again
                log.warning("wakeups_unavailable", error=f"{type(exc).__name__}: {exc}")
                self._closed.wait(5.0)
