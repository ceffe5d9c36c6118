"""Waking idle workers when a task is queued.

On PostgreSQL the transaction that queues tasks sends ``NOTIFY agentbus_queued``
with the agent's name (delivered on commit); an idle worker of that agent
LISTENs on its own connection and claims within milliseconds. SQLite has no
such thing, nor does PostgreSQL through a transaction pooler (a LISTEN is a
session's; ``listen_url`` gives a direct connection for it): there an idle worker
looks every ``LOOK_SEC`` (50 ms; through a pooler ever less often while the quiet
lasts, ``look_sec``) with a read (``TaskQueue.has_due``: an index lookup that takes
no lock) and claims only when something is due. Either way a worker also tries a claim every
``poll_sec``: a notification is a hint, and a task whose ``run_after`` has
just come sends none. A notified worker that finds nothing due (a task queued
with a delay; or one stamped by a producer whose reading of the database's
clock runs a few milliseconds ahead of the worker's) waits only until the
agent's earliest queued task is due (``TaskQueue.due_in``), if that comes
before its next poll.

A task that reaches an end sends ``NOTIFY agentbus_settled`` for the producers
waiting for tasks (``AgentBus.wait``), but only while one listens: each listening
connection keeps a row of ``settle_listeners`` current (``Listener(register=True)``).
A notifying commit holds a lock of the whole cluster that every other notifying
commit waits for, so the settles of a fleet nobody waits on commit side by side.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.db.errors import first_line
from agentbus.logging import get_logger
from agentbus.schema import settle_listeners

log = get_logger("agentbus.wakeups")

CHANNEL = "agentbus_queued"
# A task reached an end (done, failed, error, cancelled). The channel keeps its first
# name: producers and workers of two releases still hear each other during an upgrade.
ENDED = "agentbus_settled"
LOOK_SEC = 0.05
#: Behind a pooler with no ``listen_url`` a PostgreSQL worker cannot LISTEN: it looks
#: every LOOK_SEC for POOLED_FAST_SEC after its last task, then ever less often, up to
#: every POOLED_LOOK_MAX_SEC times the idle workers of its agent (``peers``): the agent's
#: queue is looked at about once a POOLED_LOOK_MAX_SEC however many replicas wait on it,
#: so an idle fleet costs the server a statement a second per agent, not per worker.
#: A look sees what a claim would, so such a worker claims only on a look that found a
#: task, or every POOLED_CLAIM_SEC at least (not every ``poll_sec``).
POOLED_FAST_SEC = 5.0
POOLED_LOOK_MAX_SEC = 1.0
POOLED_CLAIM_SEC = 10.0
#: An idle worker gives back its claims' own connection after this long.
REST_SEC = 5.0
#: A worker woken for a task its claim did not find due looks again this soon at the
#: earliest (the task is due by the producer's clock but not yet by the worker's).
AGAIN_SEC = 0.005
#: How long a listener's row holds (seconds, by the database's clock); it is renewed
#: a third of the way in.
LISTENER_TTL_SEC = 30.0
_NOTIFY = sa.select(sa.func.pg_notify(CHANNEL, sa.bindparam("agent")))


def claim_every(poll_sec: float, *, pooled: bool, peers: int = 1) -> float:
    """How often an idle worker claims with nothing seen due (``pooled``: it looks
    through a pooler, and a look sees what a claim would; with ``peers`` idle workers of
    its agent, each that many times less often: the agent's queue is claimed from about
    once a POOLED_CLAIM_SEC. Unprepared, as through a pooler, a claim costs the server
    about 1 ms: 200 idle workers claiming every 10 s each spent 2 % of a core on it)."""
    return max(poll_sec, POOLED_CLAIM_SEC * max(peers, 1)) if pooled else poll_sec


def look_sec(idle_sec: float, *, pooled: bool, peers: int = 1) -> float:
    """How long an idle worker waits between looks for due tasks, ``idle_sec`` into its
    idleness (``pooled``: through a pooler; else every LOOK_SEC), with ``peers`` idle
    workers of its agent (itself among them) looking too: each looks that many times less
    often, up to once a POOLED_CLAIM_SEC. (The waits are drawn around this: ``jittered``.)"""
    if not pooled or idle_sec <= POOLED_FAST_SEC:
        return LOOK_SEC
    slowest = min(POOLED_LOOK_MAX_SEC * max(peers, 1), POOLED_CLAIM_SEC)
    return min(LOOK_SEC * 2 ** ((idle_sec - POOLED_FAST_SEC) / 2), slowest)


def jittered(wait: float, draw: float) -> float:
    """``wait`` spread by ``draw`` (uniform in [0, 1)) over half to one and a half times
    it: replicas that started together do not look at the same moments."""
    return wait * (0.5 + draw)


def listening() -> sa.Exists:
    """SQL (PostgreSQL): a producer listens for ended tasks now."""
    now = sa.func.extract("epoch", sa.func.now())
    return sa.exists().where(settle_listeners.c.until > now)


def ended_notice(*conditions: Any) -> sa.Select[Any]:
    """SQL (PostgreSQL): notify the producers waiting for tasks, only while one listens
    and ``conditions`` hold (the steady state's: some completion held)."""
    return sa.select(sa.func.pg_notify(ENDED, "")).where(listening(), *conditions)


_ENDED = ended_notice()
# A listener's row: stale rows (their process gone) go first; then its own, until
# LISTENER_TTL_SEC from now. Plain SQL: a listener talks to psycopg directly.
_REGISTER = (
    "DELETE FROM settle_listeners WHERE until < extract(epoch from now())",
    "INSERT INTO settle_listeners (listener, until)"
    " VALUES (%(listener)s, extract(epoch from now()) + %(ttl)s)"
    " ON CONFLICT (listener) DO UPDATE SET until = excluded.until",
)
_UNREGISTER = "DELETE FROM settle_listeners WHERE listener = %(listener)s"


def notify(conn: Connection, agents: Iterable[str]) -> None:
    """Tell the idle workers of ``agents`` that tasks are queued (PostgreSQL; on commit)."""
    if conn.dialect.name != "postgresql":
        return
    for agent in sorted(set(agents)):
        conn.execute(_NOTIFY, {"agent": agent})


def notify_ended(conn: Connection) -> None:
    """Tell the producers waiting for tasks that some reached an end (PostgreSQL; on
    commit, and only while one listens): each looks again at the tasks it waits for."""
    if conn.dialect.name == "postgresql":
        conn.execute(_ENDED)


class Listener:
    """Calls ``wake()`` whenever ``channel`` is notified with ``payload`` (None: any) — a
    task of an agent queued, or tasks ended — from a thread LISTENing on its own
    PostgreSQL connection. ``listening`` is set while it does: when its connection is
    lost it wakes its owner (who looks for itself meanwhile), says so once for the
    whole outage, reconnects every 5 s, and wakes its owner again once back, since
    something may have happened meanwhile.

    With ``register`` (the ended tasks' channel) it keeps a row of
    ``settle_listeners`` current while it listens, so that settles notify; it wakes
    its owner once the row is there (a settle that began before may not have seen it)."""

    def __init__(
        self,
        conninfo: str,
        wake: Callable[[], None],
        *,
        channel: str = CHANNEL,
        payload: str | None = None,
        register: bool = False,
        application_name: str = "agentbus",
    ) -> None:
        self.conninfo, self.wake = conninfo, wake
        self.application_name = application_name
        self.channel, self.payload = channel, payload
        self.register = register
        self.name = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        #: Set while it listens: until then, and while its database is away, its owner
        #: looks for itself (a worker polls as it would with no listener).
        self.listening = threading.Event()
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

        away = False  # an episode of failures is said once, at its start
        while not self._closed.is_set():
            try:
                with psycopg.connect(
                    self.conninfo,
                    autocommit=True,  # connect_timeout: the conninfo's (Database's)
                    application_name=self.application_name,
                ) as conn:
                    conn.execute(f"LISTEN {self.channel}")
                    renew = self._keep_row(conn, 0.0)
                    self.listening.set()
                    if away:
                        away = False
                        log.info("wakeups_back", channel=self.channel)
                    self.wake()
                    while not self._closed.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if self.payload is None or note.payload == self.payload:
                                self.wake()
                        renew = self._keep_row(conn, renew)
                    if self.register:
                        conn.execute(_UNREGISTER, {"listener": self.name})
            except Exception as exc:  # the database is away: poll meanwhile, try again
                if self.listening.is_set():  # its owner waits on it: look for itself
                    self.listening.clear()
                    self.wake()
                error = f"{type(exc).__name__}: {first_line(exc)}"
                if not away:
                    away = True
                    log.warning("wakeups_unavailable", error=error, effect="polling meanwhile")
                else:
                    log.debug("wakeups_unavailable", error=error)
                self._closed.wait(5.0)

    def _keep_row(self, conn: Any, renew: float) -> float:
        """With ``register``: write this listener's row once it is due for renewal
        (monotonic time ``renew``); returns when it is due next."""
        if not self.register or time.monotonic() < renew:
            return renew
        for sql in _REGISTER:
            conn.execute(sql, {"listener": self.name, "ttl": LISTENER_TTL_SEC})
        return time.monotonic() + LISTENER_TTL_SEC / 3
