"""The worker loop: claim -> run -> settle, one task at a time, for one agent.

The main thread makes the calls; while it does, a watchdog thread renews the
leases of the tasks it holds and the worker's heartbeat. A pause is not a
failure: only genuine failures count towards the backoff sleep, which a stop
request interrupts. On SIGTERM the loop claims nothing more and lets the
running call finish within the grace period; after that the watchdog gives
the task back to the queue and ends the process.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from dataclasses import dataclass

from agentbus.admission.admission import Admission
from agentbus.admission.budget import WorkspaceBudget, client_budget, disagreement
from agentbus.admission.cooldowns import CooldownStore
from agentbus.config import LiveConfig
from agentbus.db import Database
from agentbus.errors import TransitionRejected
from agentbus.logging import get_logger
from agentbus.providers import Providers
from agentbus.queue import TaskQueue, wakeups
from agentbus.queue.decisions import Complete, Crash, Fail, Pause, Release, Requeue, Settlement
from agentbus.queue.tasks import Task
from agentbus.queue.workers import WorkerRegistry, new_worker_id
from agentbus.worker import policy
from agentbus.worker.runner import Run, Runner

log = get_logger("agentbus.worker")


@dataclass(frozen=True)
class Options:
    agent: str
    lease_sec: float
    poll_sec: float
    grace_sec: float
    drain: bool = False
    max_tasks: int | None = None
    batch: int = 1  # tasks per claim; their completions are acknowledged together


class Worker:
    def __init__(self, config: LiveConfig, db: Database, options: Options) -> None:
        settings = config.settings
        self.options = options
        self.id = new_worker_id(options.agent)
        self.log = log.bind(worker=self.id)
        self.queue = TaskQueue(db, max_attempts=settings.max_attempts)
        self.registry = WorkerRegistry(db, self.id, options.agent)
        self.config = config
        self.providers = Providers(config, os.environ)
        self.backoff_steps = settings.backoff_steps()
        cooldowns = CooldownStore(
            db,
            cache_sec=settings.cooldown_cache_sec,
            slow_read_ms=settings.cooldown_slow_read_ms,
            slow_cache_sec=settings.cooldown_slow_cache_sec,
        )
        self.budget = budget = client_budget(db, settings, holder=self.id)
        self.admission = Admission(
            db,
            config,
            worker=self.id,
            cooldowns=cooldowns,
            environ=os.environ,
            budget=budget,
            cache_sec=settings.cooldown_cache_sec,
        )
        self.runner = Runner(admission=self.admission, providers=self.providers, worker_id=self.id)
        self.stopping = threading.Event()
        self._wake = threading.Event()  # a task was queued for us, or stop: look now
        self._listener: wakeups.Listener | None = None
        if db.dialect == "postgresql" and not options.drain:
            conninfo = db.engine.url.set(drivername="postgresql")
            self._listener = wakeups.Listener(
                conninfo.render_as_string(hide_password=False), options.agent, self._wake
            )
        self._finished = threading.Event()
        self._last_beat = 0.0
        self._lock = threading.Lock()  # guards _held and _running (the watchdog reads them)
        self._running: Task | None = None  # the task whose call the main thread is in
        self._held: list[Task] = []  # claimed by us and not yet settled in the database
        self._acks: list[Settlement] = []  # done, to acknowledge with the next claim
        self._stop_reason: str | None = None
        self._stop_logged = False
        self._taken_over: set[int] = set()  # claims the watchdog found lost (ids)
        self._watchdog_failed = False

    def request_stop(self, reason: str = "signal") -> None:
        """Ask the worker to stop. Safe in a signal handler: it only records the reason
        and sets an event (no logging, no I/O, no lock); the loop says it noticed."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self.stopping.set()
        self._wake.set()

    def _noticed_stop(self) -> None:
        """Say once that a stop was asked for (the loop or the watchdog, whichever sees it
        first: the watchdog does while the main thread is in a long call)."""
        with self._lock:
            first = self.stopping.is_set() and not self._stop_logged
            self._stop_logged = self._stop_logged or first
        if first:
            self.log.info("shutdown_requested", reason=self._stop_reason or "stop")

    def run(self) -> int:
        self.registry.register()
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()
        budget = self.budget
        self.log.info(
            "worker_started",
            agent=self.options.agent,
            pid=os.getpid(),
            client_budget=budget.mode,
            client_budget_size=budget.budget,
            client_budget_scope=budget.scope,
        )
        if isinstance(budget, WorkspaceBudget):
            ignored = disagreement(self.config.settings, budget.setting)
            if ignored is not None:
                self.log.warning("client_budget_flags_ignored", detail=ignored)
        if self._listener is not None:
            self._listener.start()
        processed = 0
        try:
            while not self.stopping.is_set():
                self._noticed_stop()
                room = self.options.batch
                if self.options.max_tasks is not None:
                    room = min(room, self.options.max_tasks - processed)
                if room <= 0:
                    break
                tasks = self._claim(room)  # acknowledging the last completions with it
                if not tasks:
                    if self.options.drain:
                        break
                    self._beat_if_due()
                    self._reload_if_changed()
                    self._wait_for_work()
                    continue
                with self._lock:
                    self._held = list(tasks)
                for task in tasks:
                    if self.stopping.is_set():
                        break
                    self._process(task)
                    processed += 1
                self._noticed_stop()
                acked = {ack.task_id for ack in self._acks}
                for task in list(self._held):  # claimed but not started: give them back
                    if task.id not in acked:
                        self._release(task)
        finally:
            if self._listener is not None:
                self._listener.close()
            self._noticed_stop()
            try:
                self._claim(0)  # the completions not yet acknowledged
            except Exception as exc:  # their leases run out: the sweeper re-queues them
                self.log.error("ack_failed", tasks=len(self._acks), error=repr(exc))
            self._finished.set()
            self.registry.remove()
            self.providers.close()
            self.log.info("shutdown", processed=processed)
        if self._watchdog_failed:
            self.log.error("exit", reason="the watchdog stopped: leases were no longer renewed")
            return 1
        return 0

    def _wait_for_work(self) -> None:
        """Idle: return when a task may be due — notified (PostgreSQL), seen by a cheap
        look every LOOK_SEC (SQLite) — on a stop, or after ``poll_sec`` in any case."""
        deadline = time.monotonic() + self.options.poll_sec
        look = self._listener is None
        while not self.stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if self._wake.wait(min(wakeups.LOOK_SEC, left) if look else left):
                self._wake.clear()
                return
            if look and self.queue.has_due(self.options.agent):
                return

    # -- one task ------------------------------------------------------------

    def _process(self, task: Task) -> None:
        """Run one task's calls here, in the main thread; the watchdog keeps its lease."""
        self._reload_if_changed()
        self.log.debug("claimed", task_id=task.id, attempts=task.attempts, token=task.claim_token)
        self.registry.current_task = task.id
        self._beat_if_due(1.0)  # at most once a second: short tasks need no write each
        with self._lock:
            self._running = task
        try:
            result = self.runner.run(task)
        except Exception as exc:  # a bug in our code or a handler: the task errors
            self.log.error(
                "task_crashed",
                task_id=task.id,
                error=repr(exc),
                traceback="".join(traceback.format_exception(exc)),
            )
            self.registry.current_task = None
            self._settle_error(task, exc)
            return
        finally:
            with self._lock:
                self._running = None
        self.registry.current_task = None
        self._settle(task, result)

    def _reload_if_changed(self) -> None:
        """Between calls: a changed config file applies to admission, routing and the
        providers (they read it from ``self.config``). Windows, slots and circuits live
        on (rows keyed by name); calls in flight keep their permits, so a lowered limit
        only holds new calls back. Process settings (lease, client budget) stay."""
        self.config.refresh()

    def _watch(self) -> None:
        """The watchdog thread: renews the leases of held tasks while a call runs, and on
        shutdown gives the running task back once the grace period is over.

        It never dies of an error: each round catches, logs and carries on (a
        database outage longer than ``db_retry_sec`` is retried at the next round).
        Should the thread end anyway, the worker stops claiming and exits non-zero
        rather than run calls whose leases nobody renews.
        """
        try:
            self._watch_rounds()
        except BaseException as exc:  # pragma: no cover - the rounds catch what they raise
            self.log.error("watchdog_died", error=repr(exc))
        finally:
            if not self._finished.is_set():
                self._watchdog_failed = True
                self.stopping.set()

    def _watch_rounds(self) -> None:
        every = self.options.lease_sec / 3
        next_heartbeat = time.monotonic() + every
        grace_ends: float | None = None
        while not self._finished.wait(0.1):
            try:
                with self._lock:
                    running, held = self._running, list(self._held)
                now = time.monotonic()
                self._noticed_stop()
                if self.stopping.is_set() and running is not None:
                    grace_ends = grace_ends or now + self.options.grace_sec
                    if now >= grace_ends:
                        self._abandon(held)
                if now >= next_heartbeat:
                    next_heartbeat = now + every
                    if held:
                        self._heartbeat(held)
                    self._beat()
            except Exception as exc:
                # The database is away (longer than db_retry_sec) or a bug: say so and
                # try again soon; a lease that ran out meanwhile is renewed if still
                # ours, and a claim taken over is reported as lost by the heartbeat.
                self.log.error("watchdog_error", error=f"{type(exc).__name__}: {exc}")
                next_heartbeat = min(next_heartbeat, time.monotonic() + min(every, 1.0))

    def _abandon(self, held: list[Task]) -> None:
        """The running call outlived the grace period: release what we hold and exit now."""
        for task in held:
            self._release(task)
        self.registry.remove()
        self.log.info("shutdown", reason="grace period over; the running call is abandoned")
        os._exit(0)

    def _heartbeat(self, held: list[Task]) -> None:
        """Renew the lease of every task we hold: the running one and those waiting.
        A claim that was taken over is marked lost: its call's result is abandoned."""
        for task in held:
            try:
                self.queue.heartbeat(task.id, task.claim_token, self.options.lease_sec)
            except TransitionRejected as exc:
                with self._lock:
                    still_ours = task in self._held
                    if still_ours:  # not merely settled by the main thread meanwhile
                        self._taken_over.add(task.id)
                if still_ours:
                    self.log.warning("claim_lost", task_id=task.id, detail=exc.message)
                    self._forget(task)

    def _release(self, task: Task) -> None:
        self._forget(task)
        if self._settle_now(task, Settlement(task.id, task.claim_token, Release("shutdown"))):
            self.log.info("task_released", task_id=task.id, reason="shutdown")
        self.registry.current_task = None

    def _settle(self, task: Task, run: Run) -> None:
        """Hand the queue the run's decision; a batch's completions wait for the batch."""
        with self._lock:
            lost = task.id in self._taken_over
            self._taken_over.discard(task.id)
        if lost:  # another claim owns the task now: our result is void
            self.log.warning("result_abandoned", task_id=task.id, reason="the claim was lost")
            return
        d = run.decision
        item = run.settlement(task)
        if isinstance(d, Complete):
            # Acknowledged in the transaction of the next claim (the lease stays renewed
            # meanwhile): one commit per task, or per batch.
            self._acks.append(item)
            return
        self._forget(task)
        if not self._settle_now(task, item):
            return
        match d:
            case Pause():
                resume_in = round(d.resume_after - time.time(), 1)
                self.log.info("task_paused", task_id=task.id, model=d.model, resume_in=resume_in)
            case Requeue():
                run_in = round(d.run_after - time.time(), 1)
                self.log.info("task_retry", task_id=task.id, error=d.error, run_in=run_in)
                self._record(failed=True, why=d.error)
            case Fail():
                self.log.warning("task_failed", task_id=task.id, reason=d.reason)
                self._record(failed=True, why=d.reason)

    def _settle_now(self, task: Task, item: Settlement) -> bool:
        """Settle one claim; False (and a log line) when the claim was lost meanwhile."""
        return not self._lost(self.queue.settle_many([item], worker=self.id))

    def _lost(self, lost: list[TransitionRejected]) -> set[int]:
        """Log each lost claim (our lease ran out and the task went to someone else: our
        work on it is void); returns their task ids."""
        for rejected in lost:
            self.log.warning("claim_lost", task_id=rejected.task_id, detail=rejected.message)
        return {rejected.task_id for rejected in lost}

    def _claim(self, room: int) -> list[Task]:
        """Acknowledge the completed tasks and claim up to ``room`` more, in one
        transaction; returns the tasks claimed."""
        acks, self._acks = self._acks, []
        try:
            rejected, tasks = self.queue.settle_and_claim(
                acks, self.options.agent, self.id, self.options.lease_sec, room
            )
        except BaseException:
            self._acks = acks + self._acks  # not acknowledged: kept (and their leases renewed)
            raise
        lost = self._lost(rejected)
        for ack in acks:
            self._forget_id(ack.task_id)
        done = [ack.task_id for ack in acks if ack.task_id not in lost]
        if len(done) == 1:
            (ack,) = [a for a in acks if a.task_id == done[0]]
            model = ack.decision.model if isinstance(ack.decision, Complete) else None
            calls = sum(1 for route in ack.routes if route.decision == "call")
            self.log.info("task_done", task_id=done[0], model=model, calls=calls)
        elif done:  # one line per batch: short tasks at full speed must not flood the log
            self.log.info("batch_done", tasks=len(done), task_ids=done)
        if done:
            self._record(failed=False)
        return tasks

    def _forget(self, task: Task) -> None:
        self._forget_id(task.id)

    def _forget_id(self, task_id: int) -> None:
        with self._lock:
            self._held = [t for t in self._held if t.id != task_id]

    def _settle_error(self, task: Task, exc: object) -> None:
        self._forget(task)
        message = f"{type(exc).__name__}: {exc}"
        if self._settle_now(task, Settlement(task.id, task.claim_token, Crash(message))):
            self.log.error("task_error", task_id=task.id, error=message)
            self._record(failed=True, why=message)

    # -- failures and backoff ------------------------------------------------

    def _record(self, *, failed: bool, why: str = "") -> None:
        reg = self.registry
        if not failed:
            if reg.consecutive_failures:
                reg.consecutive_failures = 0
                self._beat()
            return
        reg.consecutive_failures += 1
        seconds = policy.backoff_sec(reg.consecutive_failures, self.backoff_steps)
        if not seconds:
            self._beat()
            return
        reg.backoff_until = time.time() + seconds
        self._beat()
        self.log.warning(
            "backoff",
            seconds=seconds,
            consecutive_failures=reg.consecutive_failures,
            last_error=why,
        )
        self.stopping.wait(seconds)
        reg.backoff_until = None
        self._beat()

    def _beat(self) -> None:
        self.registry.beat()
        self._last_beat = time.monotonic()

    def _beat_if_due(self, interval: float | None = None) -> None:
        every = self.options.lease_sec / 3 if interval is None else interval
        if time.monotonic() - self._last_beat >= every:
            self._beat()
