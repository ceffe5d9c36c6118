"""The worker loop: claim -> run -> settle, for one agent, up to N tasks at once.

The main thread claims. With ``concurrency`` 1 it runs each task itself, as
``claim_batch`` tasks per claim in turn; with N above 1 each task runs in a
slot thread of its own (threads, not asyncio: the providers are blocking
httpx and subprocess calls, and admission is synchronous SQL), and the main
thread claims as many tasks as there are free slots, waking when a slot
frees or a task is queued. A completion is acknowledged in the transaction of
the next claim; a pause, retry or failure is settled by its slot at once.
While calls run, a watchdog thread renews the leases of every task held and
the worker's heartbeat (with the ids it is running).

A pause is not a failure: only genuine failures, counted across the process,
back the whole worker off — no new claim until the backoff is over (a stop
request ends it); calls already running go on. On SIGTERM the loop claims
nothing more and lets the running calls finish within the grace period; after
that the watchdog gives their tasks back to the queue and ends the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from agentbus.admission.admission import Admission
from agentbus.admission.budget import client_budget
from agentbus.admission.cooldowns import CooldownStore
from agentbus.config import LiveConfig
from agentbus.db import Database
from agentbus.errors import TransitionRejected
from agentbus.logging import get_logger
from agentbus.process_metrics import Observations
from agentbus.providers import Providers
from agentbus.queue import TaskQueue
from agentbus.queue.decisions import (
    Complete,
    Crash,
    Expire,
    Fail,
    Pause,
    Release,
    Requeue,
    Settlement,
)
from agentbus.queue.groups import GroupRule
from agentbus.queue.tasks import Task
from agentbus.queue.workers import WorkerRegistry, new_worker_id
from agentbus.worker import policy
from agentbus.worker.announce import announce
from agentbus.worker.idle import Idle
from agentbus.worker.runner import Run, Runner
from agentbus.worker.watchdog import Watchdog

log = get_logger("agentbus.worker")


@dataclass(frozen=True)
class Options:
    agent: str
    lease_sec: float
    poll_sec: float
    grace_sec: float
    drain: bool = False
    max_tasks: int | None = None
    batch: int = 1  # tasks per claim (concurrency 1); their completions are acknowledged together
    concurrency: int = 1  # tasks running at once, each in a slot thread


class Worker:
    def __init__(self, config: LiveConfig, db: Database, options: Options) -> None:
        settings = config.settings
        self.options = options
        self.id = new_worker_id(options.agent)
        self.log = log.bind(worker=self.id)
        self.queue = TaskQueue(db, max_attempts=settings.max_attempts)
        self.registry = WorkerRegistry(db, self.id, options.agent, concurrency=options.concurrency)
        self.config = config
        self.providers = Providers(config, os.environ)
        self.backoff_steps = settings.backoff_steps()
        cooldowns = CooldownStore.configured(db, settings)
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
        self.observed = Observations()  # call and task times, added to the database by the watchdog
        self.runner = Runner(
            admission=self.admission,
            providers=self.providers,
            worker_id=self.id,
            observed=self.observed,
            clock=db.clock,
        )
        self.stopping = threading.Event()
        self.idle = Idle(
            self.queue,
            options.agent,
            options.poll_sec,
            stopping=self.stopping,
            listen=not options.drain,
            peers=lambda: self.registry.idle_peers,
            groups=self.groups,
            log=self.log,
        )
        self._slots = (
            ThreadPoolExecutor(options.concurrency, thread_name_prefix="slot")
            if options.concurrency > 1
            else None
        )
        self.finished = threading.Event()  # the loop is over: the watchdog ends too
        self.last_beat = 0.0
        self._beat_running: list[int] = []  # the running ids the last heartbeat wrote
        self._lock = threading.Lock()  # guards the state below (threads share it)
        self._running: dict[int, Task] = {}  # tasks whose call is under way
        self._held: dict[int, Task] = {}  # claimed by us and not yet settled in the database
        self._in_slots: set[int] = set()  # handed to a slot thread and not back yet
        self._acks: list[Settlement] = []  # done, to acknowledge with the next claim
        self._acked_turns = False  # the last claim acknowledged grouped or awaited tasks
        self._backoff_ends = 0.0  # time.monotonic(): no claim before
        self._slot_error: BaseException | None = None  # a slot could not settle its task
        self._stop_reason: str | None = None
        self._stop_logged = False
        self._taken_over: set[int] = set()  # claims the watchdog found lost (ids)
        self._watchdog = Watchdog(self)

    def request_stop(self, reason: str = "signal") -> None:
        """Ask the worker to stop (from any thread: the signals thread on SIGTERM): it
        records the reason and wakes the loop, which says it noticed."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self.stopping.set()
        self.idle.wake()

    def noticed_stop(self) -> None:
        """Say once that a stop was asked for (the loop or the watchdog, whichever sees it
        first: the watchdog does while the main thread is in a long call)."""
        with self._lock:
            first = self.stopping.is_set() and not self._stop_logged
            self._stop_logged = self._stop_logged or first
        if first:
            self.log.info("shutdown_requested", reason=self._stop_reason or "stop")

    def run(self) -> int:
        self.registry.register()
        self._watchdog.start()
        announce(self)
        self.idle.start()
        processed = 0
        try:
            while not self.stopping.is_set():
                self.noticed_stop()
                if self._slot_error is not None:
                    raise self._slot_error
                if self._backing_off():
                    continue
                room = self._room(processed)
                if room is None:  # --max-tasks reached
                    break
                if room == 0:  # every slot busy: wait for one to free
                    self.idle.wait(self.options.poll_sec)
                    continue
                self._reload_if_changed()
                tasks = self._claim(room)  # acknowledging the last completions with it
                while not tasks and self._acked_turns:
                    # Acks may free a group's next turn or a waiter, which a claim in their
                    # statement (PostgreSQL) cannot see: again while a claim acked some.
                    tasks = self._claim(room)
                if not tasks:
                    self.idle.found_nothing(running=bool(self._in_slots))
                    if self.options.drain and not self._in_slots:
                        with self._lock:  # a slot's last completion may free a group's turn
                            acked = not self._acks
                        if acked:
                            break
                        continue
                    self.idle.wait_for_work()
                    continue
                self.idle.found_work()
                processed += len(tasks)
                with self._lock:
                    self._held.update((task.id, task) for task in tasks)
                if self._slots is not None:
                    for task in tasks:
                        self._in_slots.add(task.id)
                        self._slots.submit(self._slot, task)
                else:
                    self._run_in_turn(tasks)
        finally:
            self.idle.close()
            self.noticed_stop()
            if self._slots is not None:
                self._finish_slots()
            try:
                self._claim(0)  # the completions not yet acknowledged
            except Exception as exc:  # their leases run out: the sweeper re-queues them
                self.log.error("ack_failed", tasks=len(self._acks), error=repr(exc))
            self.finished.set()
            with contextlib.suppress(Exception):  # the database away: they are only lost
                self.observed.flush(self.queue.db)
            self.registry.remove()
            self.providers.close()
            self.log.info("shutdown", processed=processed)
        if self._watchdog.failed:
            self.log.error("exit", reason="the watchdog stopped: leases were no longer renewed")
            return 1
        return 0

    def _room(self, processed: int) -> int | None:
        """How many tasks to claim now: the batch, or the free slots, within --max-tasks
        (None: that many were run, and none is still running)."""
        room = self.options.batch
        if self._slots is not None:
            room = self.options.concurrency - len(self._in_slots)
        if self.options.max_tasks is not None:
            left = self.options.max_tasks - processed
            if left <= 0:
                return None if not self._in_slots else 0
            room = min(room, left)
        return room

    def _backing_off(self) -> bool:
        """After genuine failures: acknowledge what is done and wait (no claim) until the
        backoff is over or a stop; True while it lasts."""
        left = self._backoff_ends - time.monotonic()
        if left > 0:
            if self._acks:
                self._claim(0)
            self.idle.wait(left)
            return True
        if self.registry.backoff_until is not None:
            self.registry.backoff_until = None
            self.beat()
        return False

    # -- one task ------------------------------------------------------------

    def _run_in_turn(self, tasks: list[Task]) -> None:
        """Concurrency 1: run a claim's tasks here, one after the other; give back those
        a stop left unstarted."""
        for task in tasks:
            if self.stopping.is_set():
                break
            while self._backing_off() and not self.stopping.is_set():
                pass
            if self.stopping.is_set():
                break
            self._process(task)
        self.noticed_stop()
        with self._lock:
            acked = {ack.task_id for ack in self._acks}
            unstarted = [task for task in self._held.values() if task.id not in acked]
        for task in unstarted:
            self._release(task)

    def _slot(self, task: Task) -> None:
        """A slot thread: one task. A failure to settle it (the database gone for longer
        than ``db_retry_sec``) stops the worker, as it would with one slot."""
        try:
            self._process(task)
        except BaseException as exc:
            with self._lock:
                self._slot_error = self._slot_error or exc
            self.request_stop("slot_error")
        finally:
            with self._lock:
                self._in_slots.discard(task.id)
            self.idle.wake()

    def _finish_slots(self) -> None:
        """Stopping: the running calls finish (the watchdog ends them when the grace
        period is over); their completions are acknowledged as they come."""
        assert self._slots is not None
        while self._in_slots:
            self.idle.wait(0.1)
            if self._acks:
                try:
                    self._claim(0)
                except Exception as exc:  # kept: tried again below, or the sweeper rescues
                    self.log.error("ack_failed", tasks=len(self._acks), error=repr(exc))
        self._slots.shutdown(wait=True)

    def _process(self, task: Task) -> None:
        """Run one task's calls in this thread; the watchdog keeps its lease."""
        self.log.debug("claimed", task_id=task.id, attempts=task.attempts, token=task.claim_token)
        with self._lock:
            self._running[task.id] = task
            self.registry.running[task.id] = None
        try:
            result = self.runner.run(task, gone=lambda: task.id in self._taken_over)
        except Exception as exc:  # a bug in our code or a handler: the task errors
            self.log.error(
                "task_crashed",
                task_id=task.id,
                error=repr(exc),
                traceback="".join(traceback.format_exception(exc)),
            )
            self._stopped_running(task)
            self._crash(task, exc)
            return
        self._stopped_running(task)
        self._finish(task, result)

    def _stopped_running(self, task: Task) -> None:
        with self._lock:
            self._running.pop(task.id, None)
            self.registry.running.pop(task.id, None)

    def _reload_if_changed(self) -> None:
        """Between calls: a changed config file applies to admission, routing and the
        providers (they read it from ``self.config``). Windows, slots and circuits live
        on (rows keyed by name); calls in flight keep their permits, so a lowered limit
        only holds new calls back. Process settings (lease, client budget, concurrency)
        stay. The providers of a replaced catalog are closed once no call uses them."""
        self.config.refresh()
        if not self._running:
            self.providers.close_retired()

    def watched(self) -> tuple[bool, list[Task], bool]:
        """For the watchdog: whether a call runs, the tasks held, and whether the running
        ids changed since the last heartbeat."""
        with self._lock:
            changed = list(self.registry.running) != self._beat_running
            return bool(self._running), list(self._held.values()), changed

    def abandon(self) -> None:
        """Running calls outlived the grace period: acknowledge the tasks done, release
        the rest and exit now."""
        with self._lock:
            acks, self._acks = self._acks, []
        if acks:
            self._lost(self.queue.settle(acks, worker=self.id))
            for ack in acks:
                self._forget_id(ack.task_id)
        with self._lock:
            held = list(self._held.values())
        for task in held:
            self._release(task)
        self.registry.remove()
        self.log.info(
            "shutdown", reason="grace period over; the running calls are abandoned", tasks=len(held)
        )
        os._exit(0)

    def renew(self, held: list[Task]) -> None:
        """Renew the lease of every task we hold: the running one and those waiting.
        A claim that was taken over is marked lost: its call's result is abandoned."""
        for task in held:
            try:
                self.queue.heartbeat(task.id, task.claim_token, self.options.lease_sec)
            except TransitionRejected as exc:
                with self._lock:
                    still_ours = task.id in self._held
                    if still_ours:  # not merely settled by the main thread meanwhile
                        self._taken_over.add(task.id)
                if still_ours:
                    self.log.warning("claim_lost", task_id=task.id, detail=exc.message)
                    self._forget(task)

    def _release(self, task: Task) -> None:
        self._forget(task)
        if self._settle(task, Settlement(task.id, task.claim_token, Release("shutdown"))):
            self.log.info("task_released", task_id=task.id, reason="shutdown")

    def _finish(self, task: Task, run: Run) -> None:
        """Hand the queue the run's decision; a completion waits for the next claim."""
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
            with self._lock:
                self._acks.append(item)
            return
        self._forget(task)
        if not self._settle(task, item):
            return
        match d:
            case Pause():
                resume_in = round(d.resume_after - self.queue.clock(), 1)
                self.log.info("task_paused", task_id=task.id, model=d.model, resume_in=resume_in)
            case Requeue():
                run_in = round(d.run_after - self.queue.clock(), 1)
                self.log.info("task_retry", task_id=task.id, error=d.error, run_in=run_in)
                self._record(failed=True, why=d.error)
            case Fail():
                self.log.warning("task_failed", task_id=task.id, reason=d.reason)
                self._record(failed=True, why=d.reason)
            case Crash():
                self.log.error("task_error", task_id=task.id, error=d.error)
                self._record(failed=True, why=d.error)
            case Expire():
                self.log.info("task_expired", task_id=task.id, reason=d.reason)

    def _settle(self, task: Task, item: Settlement) -> bool:
        """Settle one claim; False (and a log line) when the claim was lost meanwhile."""
        return not self._lost(self.queue.settle([item], worker=self.id))

    def _lost(self, lost: list[TransitionRejected]) -> set[int]:
        """Log each lost claim (our lease ran out and the task went to someone else: our
        work on it is void); returns their task ids."""
        for rejected in lost:
            self.log.warning("claim_lost", task_id=rejected.task_id, detail=rejected.message)
        return {rejected.task_id for rejected in lost}

    def _claim(self, room: int) -> list[Task]:
        """Acknowledge the completed tasks and claim up to ``room`` more, in one transaction."""
        with self._lock:
            acks, self._acks = self._acks, []
        try:
            rejected, tasks = self.queue.settle_and_claim(
                acks,
                self.options.agent,
                self.id,
                self.options.lease_sec,
                room,
                groups=self.groups(),
            )
        except BaseException:
            with self._lock:  # not acknowledged: kept (and their leases renewed)
                self._acks = acks + self._acks
            raise
        lost = self._lost(rejected)
        with self._lock:  # still held: forgotten below
            grouped = [self._held.get(a.task_id) for a in acks if a.task_id not in lost]
        freed = [t for t in grouped if t is not None and (t.group_key or t.awaited)]
        self._acked_turns = room > 0 and bool(freed)
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

    def groups(self) -> GroupRule | None:
        """The agent's rule for its tasks' groups, from the live config."""
        return GroupRule.of(self.config.catalog.agents.get(self.options.agent))

    def _forget(self, task: Task) -> None:
        self._forget_id(task.id)

    def _forget_id(self, task_id: int) -> None:
        with self._lock:
            self._held.pop(task_id, None)

    def _crash(self, task: Task, exc: object) -> None:
        self._forget(task)
        message = f"{type(exc).__name__}: {exc}"
        if self._settle(task, Settlement(task.id, task.claim_token, Crash(message))):
            self.log.error("task_error", task_id=task.id, error=message)
            self._record(failed=True, why=message)

    # -- failures and backoff ------------------------------------------------

    def _record(self, *, failed: bool, why: str = "") -> None:
        """Count a task's end: genuine failures in a row, whichever slot ran them, back
        the worker off (the main thread claims nothing until the backoff is over)."""
        reg = self.registry
        with self._lock:
            if not failed and not reg.consecutive_failures:
                return
            reg.consecutive_failures = reg.consecutive_failures + 1 if failed else 0
            failures = reg.consecutive_failures
            seconds = policy.backoff_sec(failures, self.backoff_steps) if failed else 0.0
            if seconds:
                reg.backoff_until = self.queue.clock() + seconds
                self._backoff_ends = time.monotonic() + seconds
                self.log.warning(  # in the lock: the lines come in the order of the count
                    "backoff", seconds=seconds, consecutive_failures=failures, last_error=why
                )
        self.beat()

    def beat(self) -> None:
        """Write the heartbeat (and the running ids, the backoff) now."""
        with self._lock:
            self._beat_running = list(self.registry.running)
        self.registry.beat()
        self.last_beat = time.monotonic()
