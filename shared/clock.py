"""One clock for the whole fleet: on PostgreSQL, the database's.

Leases, heartbeats, pauses, cooldowns, admission windows and slots, circuits
and budget leases are written by one process and compared by another. On
PostgreSQL every process reads time as its host clock plus its measured offset
to the database's ``clock_timestamp()``: measured at the first use, again
every ``RESYNC_SEC``, and at once when the host clock jumps (a VM resumed, an
NTP step: wall time and monotonic time part by more than ``JUMP_SEC``). A
measurement is one read, its error half the round trip. A statement keeps its
one round trip: no clock read per transaction. On SQLite (one host) the host
clock is the clock.

``AGENTBUS_TEST_CLOCK_SKEW_SEC`` (tests only) moves a process's host clock by
that many seconds, as a host whose clock is off: see ``skew_host_clock``.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from agentbus.logging import get_logger

if TYPE_CHECKING:
    from agentbus.db import Database

log = get_logger("agentbus.clock")

RESYNC_SEC = 30.0
JUMP_SEC = 0.5
CLOCK_WARN_SEC = 2.0  # a host this far off the database's clock is told so
SKEW_ENV = "AGENTBUS_TEST_CLOCK_SKEW_SEC"
_DB_NOW = "SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8"


class DatabaseClock:
    """``clock()``: epoch seconds by the database's clock; ``offset``: how far the
    database's clock is ahead of this host's (seconds, as last measured)."""

    def __init__(
        self,
        db: Database,
        *,
        host: Callable[[], float] | None = None,
        resync_sec: float = RESYNC_SEC,
    ) -> None:
        self.db = db
        self.host = host or (lambda: time.time())  # looked up at each call (tests skew it)
        self.resync_sec = resync_sec
        self.offset = 0.0
        self._lock = threading.Lock()
        self._due = -1.0  # time.monotonic() of the next measurement (now: never measured)
        self._anchor = 0.0  # wall minus monotonic at the last measurement

    def __call__(self) -> float:
        wall, mono = self.host(), time.monotonic()
        due = mono >= self._due or abs((wall - mono) - self._anchor) > JUMP_SEC
        if due and self.db.spare_connection():
            self.measure()
            wall, mono = self.host(), time.monotonic()
        return wall + self.offset

    def measure(self) -> float:
        """Measure the offset now (one read); returns it. With the database away the
        last offset stays (the host clock's at first) and the next call tries again
        a second later: reading the time never fails, nor waits.

        A read due while every connection this process may open is taken (a sweeper
        has one, and reads the time inside its transactions) waits for a call made
        with one free; so does a read due while another thread measures."""
        if not self._lock.acquire(blocking=False):
            return self.offset
        try:
            return self._measure()
        finally:
            self._lock.release()

    def _measure(self) -> float:
        before = self.host()
        try:  # one try, no retries: a clock read must not wait out an outage
            with self.db.engine.connect() as conn:
                db_now = float(conn.exec_driver_sql(_DB_NOW).scalar_one())
        except Exception as exc:
            # Here, not at the top: agentbus.db imports this module.
            from agentbus.db.errors import EPISODE, is_transient

            if is_transient(exc):  # the database is away: said once for the process
                EPISODE.failed(0, exc)
            else:
                log.warning("clock_unmeasured", error=f"{type(exc).__name__}: {exc}")
            self._due = time.monotonic() + 1.0
            self._anchor = self.host() - time.monotonic()
            return self.offset
        after = self.host()
        self.offset = db_now - (before + after) / 2
        mono = time.monotonic()
        self._anchor = self.host() - mono
        self._due = mono + self.resync_sec
        return self.offset


def clock_for(db: Database) -> Callable[[], float]:
    """The clock every process of ``db``'s fleet shares."""
    if db.dialect == "postgresql":
        return DatabaseClock(db)
    return time.time


def offset_of(clock: Callable[[], float]) -> float:
    """How far the fleet's clock is ahead of this host's (0 on SQLite)."""
    if isinstance(clock, DatabaseClock):
        return clock.offset
    return 0.0


def skew_host_clock() -> None:
    """Tests only: with ``AGENTBUS_TEST_CLOCK_SKEW_SEC`` set, this process's
    ``time.time`` runs that many seconds off, as on a host whose clock is wrong."""
    skew = os.environ.get(SKEW_ENV)
    if not skew:
        return
    real, by = time.time, float(skew)
    time.time = lambda: real() + by
