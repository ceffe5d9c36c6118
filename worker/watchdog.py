"""The worker's watchdog thread: leases, heartbeat, and the end of the grace period.

While calls run, it renews the lease of every task the worker holds and writes
the worker's heartbeat (at once when the running tasks change, at most every
second, and every third of a lease in any case); every few seconds it adds the
call and task times observed to the database. On shutdown it lets the
running calls finish within the grace period, then has the worker give their
tasks back and end.

It never dies of an error: each round catches, logs and carries on (a database
outage longer than ``db_retry_sec`` is retried at the next round). Should the
thread end anyway, the worker stops claiming and exits non-zero rather than run
calls whose leases nobody renews.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentbus.worker.loop import Worker

ROUND_SEC = 0.1
BEAT_CHANGES_SEC = 1.0  # running ids that changed are written at most this often
FLUSH_SEC = 5.0  # observations (call and task times) are added to the database this often


class Watchdog:
    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.failed = False  # the thread ended while the worker still ran

    def start(self) -> None:
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()

    def _watch(self) -> None:
        worker = self.worker
        try:
            self._rounds()
        except BaseException as exc:  # pragma: no cover - the rounds catch what they raise
            worker.log.error("watchdog_died", error=repr(exc))
        finally:
            if not worker.finished.is_set():
                self.failed = True
                worker.stopping.set()

    def _rounds(self) -> None:
        worker = self.worker
        every = worker.options.lease_sec / 3
        next_heartbeat = time.monotonic() + every
        next_flush = time.monotonic() + FLUSH_SEC
        grace_ends: float | None = None
        while not worker.finished.wait(ROUND_SEC):
            try:
                running, held, changed = worker.watched()
                now = time.monotonic()
                worker.noticed_stop()
                if worker.stopping.is_set() and running:
                    grace_ends = grace_ends or now + worker.options.grace_sec
                    if now >= grace_ends:
                        worker.abandon()
                if now >= next_heartbeat:
                    next_heartbeat = now + every
                    if held:
                        worker.renew(held)
                    worker.beat()
                elif changed and now - worker.last_beat >= BEAT_CHANGES_SEC:
                    worker.beat()
                if now >= next_flush:
                    next_flush = now + FLUSH_SEC
                    worker.observed.flush(worker.queue.db)
            except Exception as exc:
                # The database is away (longer than db_retry_sec) or a bug: say so and
                # try again soon; a lease that ran out meanwhile is renewed if still
                # ours, and a claim taken over is reported as lost by the renewal.
                worker.log.error("watchdog_error", error=f"{type(exc).__name__}: {exc}")
                next_heartbeat = min(next_heartbeat, time.monotonic() + min(every, 1.0))
