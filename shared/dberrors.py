"""What a database error means, and saying so once: a transient error (run the unit
of work again), a server or pooler with every connection taken (wait for one), a
transaction pooler nobody declared (say which setting to give); and the ``db_retry``
lines of ``agentbus.db``'s retries, one warning per RETRY_LOG_EVERY_SEC."""

from __future__ import annotations

import sys
import time
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
        from agentbus.sqlite_engine import RETRIED_CODES

        code = getattr(orig, "sqlite_errorcode", None)
        if code is not None:
            return code & 0xFF in RETRIED_CODES
        return "locked" in str(orig) or "busy" in str(orig)
    psycopg = sys.modules.get("psycopg")  # imported by the engine when the URL is PostgreSQL
    return psycopg is not None and isinstance(orig, psycopg.OperationalError)


#: What a full server or pooler answers a new connection: PostgreSQL's SQLSTATE 53300
#: (``too many clients already``, a role's or a database's CONNECTION LIMIT), and
#: PgBouncer's refusals (it sends them all as 08P01, told apart by their text).
_FULL_SQLSTATE = "53300"
_SERVER_FULL = ("too many clients", "remaining connection slots are reserved")
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


#: A process says once that the database fails (a fleet's every thread hits the same
#: outage, a refused connection comes back at each retry): again only this much later.
RETRY_LOG_EVERY_SEC = 30.0
_last_retry_log = [-RETRY_LOG_EVERY_SEC]


def say_retry(attempt: int, exc: BaseException | None) -> None:
    now = time.monotonic()
    error = first_line(getattr(exc, "orig", exc))
    if now - _last_retry_log[0] >= RETRY_LOG_EVERY_SEC:
        _last_retry_log[0] = now
        log.warning("db_retry", attempt=attempt, error=error, effect="retried with backoff")
    else:
        log.debug("db_retry", attempt=attempt, error=error)


def log_first_failure(exc: BaseException) -> None:
    say_retry(0, exc)


def log_retry(state: tenacity.RetryCallState) -> None:
    say_retry(state.attempt_number, state.outcome.exception() if state.outcome else None)
