"""The hot path's own connections: a worker's settle-and-claim and a producer's
enqueues run on connections kept out of the pool (``Database.pinned``)."""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection

    from agentbus.db import Database

T = TypeVar("T")


class Pinned:
    """Connections kept checked out for a caller on its hot path (a worker's
    settle-and-claim, its admissions): no pool checkout, reset and check-in per
    transaction.

    ``write`` and ``write_one`` are ``Database.write`` and ``write_one`` on them (on
    PostgreSQL one connection for each: ``write_one``'s is in autocommit). One thread
    uses them at a time; a thread that finds them in use goes through the pool. After
    any error the connections are closed and the next transaction (a retry included)
    takes a fresh one.
    """

    def __init__(self, db: Database, *, enabled: bool = True) -> None:
        self.db = db
        self.enabled = enabled  # False: every transaction goes through the pool
        self._resting = False
        self._lock = threading.Lock()
        self._held: dict[bool, Connection] = {}  # autocommit -> its connection, once taken
        # Dropped without ``close`` (a Database never disposed): the connections go back.
        weakref.finalize(self, _close_all, self._held)

    def write(self, work: Callable[[Connection], T], *, durable: bool = True) -> T:
        return self._run(work, autocommit=False, durable=durable)

    def write_one(self, work: Callable[[Connection], T]) -> T:
        return self._run(work, autocommit=self.db.dialect == "postgresql")

    def _run(self, work: Callable[[Connection], T], *, autocommit: bool, durable: bool = True) -> T:
        if self._resting or not self.enabled or not self._lock.acquire(blocking=False):
            if autocommit:
                return self.db.write_one(work)
            return self.db.write(work, durable=durable)
        try:
            return self.db._retrying(lambda: self._once(work, autocommit, durable))
        finally:
            self._lock.release()

    def _once(self, work: Callable[[Connection], T], autocommit: bool, durable: bool) -> T:
        conn = self._held.get(autocommit)
        if conn is None:
            engine = self.db._read_engine if autocommit else self.db.engine
            conn = self._held[autocommit] = engine.connect()
        try:
            if autocommit:  # each statement commits by itself: nothing to begin or end
                result = work(conn)
                if conn.in_transaction():  # begun by an execute of SQLAlchemy's own
                    conn.commit()
                return result
            return self.db._transaction(conn, work, durable)
        except BaseException:
            self.close()
            raise

    def rest(self, resting: bool = True) -> None:
        """``resting``: give the connections back (the caller has gone idle) and send
        the transactions through the pool until ``rest(False)``."""
        self._resting = resting
        if resting:
            self.give_back()

    def give_back(self) -> None:
        """Close the connections held, unless in use now (taken again at next use)."""
        if self._held and self._lock.acquire(blocking=False):
            try:
                self.close()
            finally:
                self._lock.release()

    def close(self) -> None:
        _close_all(self._held)


def _close_all(held: dict[bool, Connection]) -> None:
    while held:
        with contextlib.suppress(Exception):
            held.popitem()[1].close()
