"""The sweeper as an APScheduler (3.x) service.

Every ``interval`` a full pass runs every job (rescue, resume, demote, purge,
prune). Between passes a cheap "peek" (the earliest pending ``resume_after``,
one index lookup) keeps a one-off "wake" job scheduled at that moment, so a
paused task resumes within moments of its cooldown ending rather than at the
next full pass. One worker thread runs the jobs, so they never overlap;
misfires are coalesced.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.jobstores.base import JobLookupError
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.date import DateTrigger
from apscheduler.triggers.interval import IntervalTrigger

from agentbus.clock import CLOCK_WARN_SEC, offset_of
from agentbus.db.errors import first_line, is_transient
from agentbus.logging import get_logger
from agentbus.process_metrics import Observations
from agentbus.sweeper import jobs

log = get_logger("agentbus.sweeper")


#: Each job's time and failures, added to the database after each pass.
OBSERVED = Observations()


class _SkipsAreExpected(logging.Filter):
    """APScheduler warns of each run it skips because the job still runs. A pass that
    waits for the database makes the next ones skip by design (the pass under way does
    their work), and the wait is said once, by ``db_retry``: not 5 lines a second."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "maximum number of running instances" not in str(record.msg)


_SKIPS = _SkipsAreExpected()


def run_once(sweep: jobs.Sweep) -> dict[str, int]:
    """Run every job one time, in order (``sweeper --once``, cron, tests).

    Each job runs on its own: one that fails is logged with its cause and
    counted in ``failed_jobs``, and the others still run in this pass.
    """
    counts: dict[str, int] = {"failed_jobs": 0}
    for job in jobs.ALL:
        began = time.monotonic()
        try:
            for key, n in job(sweep).items():  # two jobs may count one thing (expired)
                counts[key] = counts.get(key, 0) + n
        except Exception as exc:
            counts["failed_jobs"] += 1
            OBSERVED.count("agentbus_sweep_job_failures", {"job": job.__name__})
            log.error("sweep_job_failed", job=job.__name__, error=describe(exc))
        finally:
            OBSERVED.observe(
                "agentbus_sweep_seconds", {"job": job.__name__}, time.monotonic() - began
            )
    log.info("sweep_pass", **counts)
    _flush(sweep)
    return counts


def _flush(sweep: jobs.Sweep) -> None:
    try:
        OBSERVED.flush(sweep.queue.db)
    except Exception as exc:  # kept for the next pass
        log.warning("observations_not_written", error=describe(exc))


def describe(exc: BaseException) -> str:
    """What went wrong, in one line: the database being away says so; anything else
    gives its own message (a constraint, a bug), not "database unavailable"."""
    orig = getattr(exc, "orig", None)
    if is_transient(exc):
        return f"database unavailable: {first_line(orig or exc)}"
    return f"{type(orig or exc).__name__}: {first_line(orig or exc)}"


class SweeperService:
    def __init__(self, sweep: jobs.Sweep, *, interval: float, peek: float) -> None:
        self.sweep = sweep
        self.interval = interval
        self.peek = peek
        self.stopped = threading.Event()
        # Held while a job runs: stopping waits for it before the scheduler's shutdown,
        # which holds the scheduler's job-store lock while it waits for running jobs, and
        # a job may be scheduling the next wake (which takes that lock): a deadlock.
        self._running = threading.Lock()
        self._wake_at: float | None = None
        logging.getLogger("apscheduler.scheduler").addFilter(_SKIPS)
        self.scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(1)},
            job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None},
            timezone=UTC,
        )

    def run(self) -> None:
        """Run until ``stop()`` (called on SIGTERM or SIGINT)."""
        now = datetime.now(UTC)
        self.scheduler.add_job(
            self._guard(self._full_pass),
            IntervalTrigger(seconds=self.interval, timezone=UTC),
            id="pass",
            next_run_time=now,
        )
        self.scheduler.add_job(
            self._guard(self._peek), IntervalTrigger(seconds=self.peek, timezone=UTC), id="peek"
        )
        self.sweep.clock()  # measured now, before any job: a host clock far off is said once
        if abs(offset_of(self.sweep.clock)) > CLOCK_WARN_SEC:
            log.warning(
                "clock_off",
                offset_sec=round(offset_of(self.sweep.clock), 3),
                effect="this host's clock disagrees with the database's; the database's is used",
            )
        self.scheduler.start()
        log.info("sweeper_started", interval=self.interval, peek=self.peek)
        self.stopped.wait()
        with self._running:  # the job running now ends first; the next ones do nothing
            pass
        self.scheduler.shutdown(wait=True)
        log.info("sweeper_stopped")

    def stop(self) -> None:
        self.stopped.set()

    def _full_pass(self) -> None:
        run_once(self.sweep)
        self._schedule_wake()

    def _peek(self) -> None:
        self._schedule_wake()

    def _wake(self) -> None:
        self._wake_at = None
        counts: dict[str, int] = {}
        for job in (jobs.expire, jobs.resume, jobs.schedules):
            for key, n in job(self.sweep).items():
                counts[key] = counts.get(key, 0) + n
        if any(counts.values()):
            log.info("wake_pass", **counts)
        self._schedule_wake()

    def _schedule_wake(self) -> None:
        """Keep the one-off wake job at the earliest pending resume_after, deadline or
        schedule's occurrence."""
        when = jobs.next_wake(self.sweep)
        if when == self._wake_at:
            return
        if when is None:
            with contextlib.suppress(JobLookupError):
                self.scheduler.remove_job("wake")
        else:
            # ``when`` is by the fleet's clock; the scheduler runs on this host's
            when -= offset_of(self.sweep.clock)
            run_at = datetime.fromtimestamp(max(when, time.time()), UTC)
            self.scheduler.add_job(
                self._guard(self._wake),
                DateTrigger(run_at, timezone=UTC),
                id="wake",
                replace_existing=True,
            )
        self._wake_at = when

    def _guard(self, fn: Callable[[], None]) -> Callable[[], None]:
        """Log and carry on: one failed pass must not stop the service."""

        def guarded() -> None:
            with self._running:
                if self.stopped.is_set():
                    return
                try:
                    fn()
                except Exception as exc:
                    labels = {"job": fn.__name__.strip("_")}
                    OBSERVED.count("agentbus_sweep_job_failures", labels)
                    log.error("sweep_job_failed", job=fn.__name__, error=describe(exc))

        guarded.__name__ = fn.__name__
        return guarded
