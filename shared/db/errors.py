"""What a database error means, and saying so once: a transient error (run the unit
of work again), a server or pooler with every connection taken (wait for one), a
transaction pooler nobody declared (say which setting to give); and the episodes of
``agentbus.db``'s retries, each said in two lines however long it lasts."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import sqlalchemy as sa

from agentbus.logging import get_logger

if TYPE_CHECKING:
    import tenacity

log = get_logger("agentbus.db")


def is_transient(exc: BaseException) -> bool:
    """Whether running the same unit of work again may succeed."""
    if isinstance(exc, sa.exc.TimeoutError):  # every pooled connection busy for pool_timeout
        return True
    if not isinstance(exc, sa.exc.DBAPIError):
        return False
    if exc.connection_invalidated:
        return True
    orig = exc.orig
    sqlite3 = sys.modules.get("sqlite3")  # imported by the engine when the URL is SQLite
    if sqlite3 is not None and isinstance(orig, sqlite3.OperationalError):
        from agentbus.db.sqlite import RETRIED_CODES

        code = getattr(orig, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in RETRIED_CODES
        return "locked" in str(orig) or "busy" in str(orig)
    psycopg = sys.modules.get("psycopg")  # imported by the engine when the URL is PostgreSQL
    return psycopg is not None and isinstance(orig, psycopg.OperationalError)


#: What a full server or pooler answers a new connection: PostgreSQL's SQLSTATE 53300
#: (``too many clients already``, a role's or a database's CONNECTION LIMIT: ``too many
#: connections for role``), and PgBouncer's refusals (it sends them all as 08P01, told
#: apart by their text).
_FULL_SQLSTATE = "53300"
_SERVER_FULL = (
    "too many clients",
    "remaining connection slots are reserved",
    "too many connections for",
)
_POOLER_FULL = ("no more connections allowed", "query_wait_timeout", "pgbouncer cannot connect")


def is_full(exc: BaseException) -> bool:
    """Whether ``exc`` says every connection of the server or pooler is taken now."""
    orig = getattr(exc, "orig", None) or exc
    if getattr(orig, "sqlstate", None) == _FULL_SQLSTATE:
        return True
    text = str(orig)  # at connect time libpq gives the text alone, with no SQLSTATE
    return any(phrase in text for phrase in _SERVER_FULL + _POOLER_FULL)


#: What PostgreSQL answers a statement prepared on one session and run on another, or
#: prepared twice on one: seen only through a transaction pooler with pooler = none.
_LOST_PREPARE_SQLSTATES = ("42P05", "26000")  # duplicate / unknown prepared statement


def pooler_hint(exc: BaseException) -> str | None:
    """One line for an error that says a transaction pooler stands in front of the
    server while the setting says none (a prepared statement went missing); else None."""
    orig = getattr(exc, "orig", None) or exc
    if getattr(orig, "sqlstate", None) not in _LOST_PREPARE_SQLSTATES:
        return None
    return (
        f"{first_line(orig)}: the server's sessions change under this process, as behind "
        "a transaction pooler (PgBouncer, RDS Proxy): set pooler = transaction "
        "(AGENTBUS_POOLER, --pooler, or ?pooler=transaction in the URL)"
    )


def first_line(exc: BaseException | None) -> str:
    text = str(exc).strip() if exc is not None else ""
    return text.splitlines()[0] if text else type(exc).__name__


class Episode:
    """A time the database fails this process, from its first failed statement or
    connection to the first that succeeds: said once when it begins (``db_retry``, a
    warning) and once when it ends (``db_back``), however many retries, threads and
    refusals come between (they are debug lines)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.began: float | None = None  # by ``clock``; None: the database answers
        self.failures = 0
        self._lock = threading.Lock()

    def failed(self, attempt: int, exc: BaseException | None) -> None:
        error = first_line(getattr(exc, "orig", exc))
        with self._lock:
            self.failures += 1
            if self.began is not None:
                log.debug("db_retry", attempt=attempt, error=error)
                return
            self.began = self.clock()
        log.warning("db_retry", error=error, effect="retried with backoff until it answers")

    def answered(self) -> None:
        """A statement succeeded: an episode under way ends (a plain read when none is)."""
        if self.began is None:
            return
        with self._lock:
            if self.began is None:
                return
            lasted, failures = self.clock() - self.began, self.failures
            self.began, self.failures = None, 0
        log.info("db_back", after_sec=round(lasted, 1), failures=failures)


#: This process's: every thread's failures are one episode.
EPISODE = Episode()


def log_first_failure(exc: BaseException) -> None:
    EPISODE.failed(0, exc)


def log_retry(state: tenacity.RetryCallState) -> None:
    EPISODE.failed(state.attempt_number, state.outcome.exception() if state.outcome else None)
