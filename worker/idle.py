"""How a worker with nothing to run finds its next task, and what wakes it.

A wake-up (``wake``) ends any wait at once: a task queued for the agent
(PostgreSQL's notification, heard by the ``LISTEN`` connection when there is
one), a slot that freed, a stop. Without notifications the idle worker looks
for due tasks with a cheap read: every ``LOOK_SEC`` on SQLite, ever less often
through a pooler (``wakeups.look_sec``). An idle spell that lasts gives the
claims' own connection back to the pool.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from typing import Any

from agentbus.db import Database
from agentbus.logging import get_logger, when
from agentbus.queue import TaskQueue, holds, wakeups
from agentbus.queue.groups import GroupRule


class Idle:
    """The waits of one worker's main thread, for the tasks of ``agent``."""

    def __init__(
        self,
        queue: TaskQueue,
        agent: str,
        poll_sec: float,
        *,
        stopping: threading.Event,
        listen: bool,
        peers: Callable[[], int] = lambda: 1,
        groups: Callable[[], GroupRule | None] = lambda: None,
        log: Any = None,
    ) -> None:
        self.queue = queue
        self.agent = agent
        self.poll_sec = poll_sec
        #: The idle workers of the agent, this one among them (its last heartbeat's count).
        self.peers = peers
        self.groups = groups  # the agent's rule for its tasks' groups (the live config's)
        self.log = log if log is not None else get_logger("agentbus.worker")
        self.stopping = stopping  # the worker's: a stop ends the idle wait
        self._wake = threading.Event()  # a task was queued for us, a slot freed, a stop
        self._look_when_due = False  # an idle wait ended by a wake-up: see wait_for_work
        db: Database = queue.db
        self.listener: wakeups.Listener | None = None
        if db.listen_conninfo is not None and listen:
            self.listener = wakeups.Listener(
                db.listen_conninfo,
                self._wake.set,
                payload=agent,
                application_name=db.application_name,
            )
        # Looks for due tasks through the pooler, ever less often while idle (PostgreSQL
        # behind a pooler with no listen_url); SQLite looks every LOOK_SEC.
        self._pooled_looks = db.dialect == "postgresql" and self.listener is None
        self._since: float | None = None  # time.monotonic() of the first empty claim

    def start(self) -> None:
        if self.listener is not None:
            self.listener.start()

    def close(self) -> None:
        if self.listener is not None:
            self.listener.close()

    def wake(self) -> None:
        """End the current wait (from any thread)."""
        self._wake.set()

    def wait(self, timeout: float) -> bool:
        """Until a wake-up or ``timeout``; True when woken."""
        if self._wake.wait(timeout):
            self._wake.clear()
            return True
        return False

    def found_nothing(self, running: bool) -> None:
        """A claim found nothing: if an operator holds the agent's queue, that is said
        once; once it has lasted ``wakeups.REST_SEC`` with no task ``running``, the
        claims' own connection is given back (an idle worker holds one)."""
        now = time.monotonic()
        if self._since is None:
            self._since = now
            self._say_if_held()
        elif now - self._since >= wakeups.REST_SEC and not running:
            self.queue.db.pinned.rest()

    def _say_if_held(self) -> None:
        hold = self.queue.db.read(lambda conn: holds.held(conn, self.agent))
        if hold is not None:
            self.log.warning(
                "agent_on_hold",
                by=hold.held_by,
                reason=hold.reason,
                since=when(hold.held_at),
                effect="no task of this agent is claimed until busctl agents resume",
            )

    def found_work(self) -> None:
        """A claim found tasks: the idle spell is over."""
        if self._since is not None:
            self._since = None
            self.queue.db.pinned.rest(False)

    def idle_for(self) -> float:
        return 0.0 if self._since is None else time.monotonic() - self._since

    def wait_for_work(self) -> None:
        """Idle: return when a task may be due — notified (PostgreSQL), seen by a cheap
        look every LOOK_SEC (SQLite; through a pooler, ``wakeups.look_sec``) — when a
        slot frees, on a stop, or after ``poll_sec`` in any case (through a pooler,
        ``wakeups.claim_every``: its looks see what a claim would). After a wake-up whose
        claim found nothing due (PostgreSQL), it ends when the agent's earliest queued
        task is due, if sooner: a task delayed a little, or stamped by a clock a little
        ahead, is claimed on time."""
        look = self.listener is None or not self.listener.listening.is_set()
        due_in = (
            self.queue.due_in(self.agent, groups=self.groups())
            if self._look_when_due and not look
            else None
        )
        self._look_when_due = False
        wait = wakeups.claim_every(self.poll_sec, pooled=self._pooled_looks, peers=self.peers())
        if due_in is not None and due_in < wait:  # end at that task's time
            wait = max(due_in, wakeups.AGAIN_SEC)
        deadline = time.monotonic() + wait
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                # At a task's time: should the claim find it a hair early, look again.
                self._look_when_due = due_in is not None and 0 < due_in < self.poll_sec
                return
            every = wakeups.look_sec(self.idle_for(), pooled=self._pooled_looks, peers=self.peers())
            if every > wakeups.LOOK_SEC:
                every = wakeups.jittered(every, random.random())
            if self.wait(min(every, left) if look else left):
                self._look_when_due = True
                return
            if look and self.queue.has_due(self.agent, groups=self.groups()):
                return
