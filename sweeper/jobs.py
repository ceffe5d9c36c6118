"""The sweeper's jobs: plain functions of a ``Sweep`` context that return counts.

Each job reads the rows it needs through an index (due pauses by
``resume_after``, expired claims by ``lease_until``) and changes them in
batches through ``agentbus.queue``, whose guarded writes make two sweepers
running at once harmless. Rescue runs before stale worker rows are pruned.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

from agentbus.admission.admission import Admission
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Refusal
from agentbus.admission.routing import Candidate
from agentbus.admission.tokens import Request
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.errors import ConfigError
from agentbus.logging import get_logger
from agentbus.queue import TaskQueue, retention
from agentbus.queue import counts as task_counts
from agentbus.queue import malformed as bad_rows
from agentbus.queue import workers as worker_rows
from agentbus.queue.decisions import ALL_REFUSED
from agentbus.queue.sweeps import DuePause
from agentbus.schema import bus_commands, model_cooldown, workers
from agentbus.sweeper import schedules as timetable
from agentbus.sweeper.policy import DueTask, plan_resume

log = get_logger("agentbus.sweeper")
MAX_ROUNDS = 1000  # batches per pass: a bound, far above what one pass meets


class Sweep:
    """What the jobs share: the database, the live config, the queue and admission."""

    def __init__(
        self, db: Database, config: LiveConfig, *, clock: Callable[[], float] | None = None
    ) -> None:
        self.db = db
        self.config = config  # reloaded when its file changes (``resume`` looks)
        self.clock = clock or db.clock
        self.queue = TaskQueue(self.db, clock=self.clock, max_attempts=self.settings.max_attempts)
        # The sweeper reads the tables once at the start of each pass (``fresh``),
        # never from an older cache: a pass over 1,000 due tasks is not 1,000 reads.
        self.cooldowns = CooldownStore(
            self.db, clock=self.clock, cache_sec=float("inf"), slow_read_ms=float("inf")
        )
        self.admission = Admission(
            self.db,
            config,
            worker="sweeper",
            cooldowns=self.cooldowns,
            environ=None,  # the sweeper needs no keys: workers check credentials
            clock=self.clock,
            cache_sec=float("inf"),
        )

    @property
    def settings(self) -> Settings:
        return self.config.settings

    def fresh(self) -> None:
        self.cooldowns.refresh()
        self.admission.refresh()


def resume(s: Sweep) -> dict[str, int]:
    """Re-queue due pauses that admission would let through; move the others' resume time."""
    s.config.refresh()
    s.fresh()
    counts = {"resumed": 0, "postponed": 0, "held": 0}
    batch = s.settings.sweep_batch
    # Admission is asked once per candidate and pass; the room it reports is
    # spent by the tasks resumed for it, over all batches of the pass.
    seen: set[tuple[str, str]] = set()
    blocked: dict[tuple[str, str], float] = {}
    room: dict[tuple[str, str], int] = {}
    free: dict[tuple[str, str], dict[str, int]] = {}  # token windows: tokens left
    for _ in range(MAX_ROUNDS):
        rows = s.queue.due_pauses(batch)
        if not rows:
            break
        requests = _Requests(s, rows)
        chains = [_candidates(s, r) for r in rows]
        due = [_due(s, r, chain, requests) for r, chain in zip(rows, chains, strict=True)]
        # Each candidate is asked once a pass per agent, for the smallest call of the
        # agent's tasks here.
        for r, chain in zip(rows, chains, strict=True):
            for candidate in chain or ():
                key = (r.agent, candidate.key)
                if key not in blocked and key not in seen:
                    seen.add(key)
                    sizes = [
                        d.needs[candidate.key]
                        for d in due
                        if d.agent == r.agent and candidate.key in d.needs
                    ]
                    need = min(sizes, key=lambda n: n.input + n.output) if sizes else None
                    answer = s.admission.peek(candidate, agent=r.agent, need=need)
                    if isinstance(answer, Refusal):
                        blocked[key] = answer.retry_after
                    else:
                        if answer.room is not None:
                            room[key] = answer.room
                        if answer.tokens is not None:
                            free[key] = dict(answer.tokens)
        plan = plan_resume(
            due,
            blocked,
            reentry_limit=s.settings.reentry_limit,
            reentry_hold_sec=s.settings.reentry_hold_sec,
            room=room,
            recheck_at=s.clock() + s.settings.admission_recheck_sec,
            tokens=free,
        )
        # What these resumes take is gone for the next batch.
        room, free = plan.room_left, plan.tokens_left
        agents = {d.id: d for d in due}
        ended = _past_deadline(s, rows, plan.postpone, plan.hold)
        if ended:  # counted where a pass counts the tasks a deadline ended
            counts["expired"] = counts.get("expired", 0) + ended
        for task_id in s.queue.resume(plan.resume):
            log.info(
                f"[cooldown-resume] task_id={task_id} agent={agents[task_id].agent} → re-queued"
            )
            counts["resumed"] += 1
        counts["postponed"] += len(s.queue.postpone(plan.postpone, ALL_REFUSED))
        for task_id, until in plan.hold.items():
            task = agents[task_id]
            why = (
                f"re-entered the cooldown of {task.pause_model} {task.reentry_count} times "
                f"in a row: resume held until {_iso(until)}"
            )
            if s.queue.postpone({task_id: until}, why):
                log.warning(
                    f"[reentry-hold] task_id={task_id} agent={task.agent} "
                    f"model={task.pause_model} reentries={task.reentry_count} "
                    f"→ resume at {_iso(until)}"
                )
                counts["held"] += 1
        if len(rows) < batch:
            break
    return counts


def _past_deadline(s: Sweep, rows: list[DuePause], *waits: dict[int, float]) -> int:
    """End the tasks that would wait until their deadline or after it (taken out of
    ``waits``, the new resume times): they would never start in time."""
    late = {
        r.id: at
        for r in rows
        if r.expires_at is not None
        for wait in waits
        if (at := wait.get(r.id)) is not None and at >= r.expires_at
    }
    ended = s.queue.lapse(late)
    for wait in waits:
        for task_id in late:
            wait.pop(task_id, None)
    for task_id in ended:
        log.info("task_expired", task_id=task_id, reason="its resume would come after its deadline")
    return len(ended)


def expire(s: Sweep) -> dict[str, int]:
    """End the queued and paused tasks whose deadline has passed (never started)."""
    total = 0
    for _ in range(MAX_ROUNDS):
        ended = s.queue.lapse_due(s.settings.sweep_batch)
        for task_id in ended:
            log.info("task_expired", task_id=task_id, reason="its deadline passed")
        total += len(ended)
        if len(ended) < s.settings.sweep_batch:
            break
    return {"expired": total}


class _Requests:
    """The calls of a batch of due tasks, read the first time a token window asks."""

    def __init__(self, s: Sweep, rows: list[DuePause]) -> None:
        self.s, self.ids = s, [r.id for r in rows]
        self._read: dict[int, tuple[str, Mapping[str, Any]]] | None = None

    def of(self, task_id: int) -> Request | None:
        if self._read is None:
            self._read = self.s.queue.requests(self.ids)
        said = self._read.get(task_id)
        return None if said is None else Request(*said)


def _due(
    s: Sweep, r: DuePause, chain: tuple[Candidate, ...] | None, requests: _Requests
) -> DueTask:
    """A due pause as the resume plan sees it: its chain and what its call needs of
    each candidate's token windows."""
    needs = {}
    for c in chain or ():
        need = s.admission.estimate(c, r.agent, lambda: requests.of(r.id))
        if need is not None:
            needs[c.key] = need
    keys = tuple(c.key for c in chain) if chain is not None else None
    return DueTask(
        r.id, r.agent, keys, r.resume_after, r.paused_at, r.pause_model, r.reentry_count, needs
    )


def _candidates(s: Sweep, task: DuePause) -> tuple[Candidate, ...] | None:
    try:
        resolved = s.admission.resolve(models=task.models, role=task.role, agent=task.agent)
    except ConfigError:
        return None
    return resolved.candidates


def next_wake(s: Sweep) -> float | None:
    """The earliest pending resume_after, deadline or schedule's occurrence, or None when
    there is none."""
    pending = (s.queue.next_resume_at(), s.queue.next_deadline(), timetable.next_at(s))
    return min((at for at in pending if at is not None), default=None)


def schedules(s: Sweep) -> dict[str, int]:
    """Enqueue the schedules' due occurrences, each once (``agentbus.sweeper.schedules``)."""
    s.config.refresh()
    return timetable.enqueue_due(s)


def purge(s: Sweep) -> dict[str, int]:
    """Delete cooldowns that have ended, and call slots no limit counts any more; add the
    server processes' task counts up (``counts.fold``)."""
    task_counts.fold(s.db)
    return {"purged": s.cooldowns.purge_expired(), "slots_purged": s.admission.purge()}


def demote(s: Sweep) -> dict[str, int]:
    """Fail tasks paused longer than ``demote_after_sec`` since their episode began."""
    hours = s.settings.demote_after_sec / 3600
    total = 0
    for _ in range(MAX_ROUNDS):
        cutoff = s.clock() - s.settings.demote_after_sec
        old_pauses = s.queue.long_pauses(cutoff, s.settings.sweep_batch)
        if not old_pauses:
            break
        why = f"paused for more than {hours:g} h with no usable model"
        moved = s.queue.demote(old_pauses, why)
        for task_id in moved:
            log.warning("task_demoted", task_id=task_id, why=why)
        total += len(moved)
        if len(old_pauses) < s.settings.sweep_batch:
            break
    return {"demoted": total}


def dependencies(s: Sweep) -> dict[str, int]:
    """Cancel the tasks waiting for a task that failed, erred or was cancelled (and those
    waiting for them); make due any waiting task whose dependencies have all ended
    (``agentbus.queue.dependencies``). Counts only what it did."""
    cancelled = s.queue.cancel_doomed()
    for task_id in cancelled:
        log.info("task_cancelled", task_id=task_id, reason="a task it waited for did not succeed")
    released = s.queue.release_ready()
    counts = {"dependency_cancelled": len(cancelled), "dependency_released": len(released)}
    return {name: n for name, n in counts.items() if n}


def malformed(s: Sweep) -> dict[str, int]:
    """Rows written by hand that no worker can use: fail such tasks (with an ops_todo),
    delete such cooldowns and worker rows; one log line per row, once."""
    batch = s.settings.sweep_batch
    failed = dropped = 0
    for _ in range(MAX_ROUNDS):
        rows = s.db.read(lambda conn: bad_rows.found(conn, bus_commands, batch))
        moved = s.queue.fail_malformed(rows)
        for row in rows:
            if row["key"] in moved:
                log.warning("task_malformed", task_id=row["key"], why=row["problem"])
        failed += len(moved)
        if len(rows) < batch or not moved:
            break
    cooling = s.db.read(lambda conn: bad_rows.found(conn, model_cooldown, batch))
    why = {r["key"]: r["problem"] for r in cooling}
    for key in s.cooldowns.drop(why, by="sweeper"):
        log.warning("cooldown_malformed", model=key, why=why[key])
        dropped += 1
    beats = s.db.read(lambda conn: bad_rows.found(conn, workers, batch))
    for row in beats:
        log.warning("worker_row_malformed", worker=row["key"], why=row["problem"])
    dropped += worker_rows.drop(s.db, [r["key"] for r in beats])
    return {"malformed_failed": failed, "malformed_dropped": dropped}


def rescue(s: Sweep) -> dict[str, int]:
    """Re-queue claims whose lease expired (poison pills fail), then prune silent workers."""
    requeued = poisoned = 0
    for _ in range(MAX_ROUNDS):
        out = s.queue.rescue_expired(
            limit=s.settings.sweep_batch, rescue_limit=s.settings.rescue_limit
        )
        for task_id in out.requeued:
            log.warning("task_rescued", task_id=task_id)
        for task_id in out.poisoned:
            log.error("task_poisoned", task_id=task_id)
        requeued += len(out.requeued)
        poisoned += len(out.poisoned)
        if len(out.requeued) + len(out.poisoned) < s.settings.sweep_batch:
            break
    stale = worker_rows.prune_stale(s.db, s.clock() - s.settings.worker_stale_sec)
    return {"rescued": requeued, "poisoned": poisoned, "workers_pruned": stale}


def prune(s: Sweep) -> dict[str, int]:
    """Delete finished tasks past their retention, with their events."""
    gone = retention.prune(
        s.db,
        s.clock(),
        done_sec=s.settings.done_retention_sec,
        failed_sec=s.settings.failed_retention_sec,
        routes_sec=s.settings.route_retention_sec,
        keys_sec=s.settings.key_retention_sec,
        adopted=s.settings.prune_adopted_tasks,
        batch=s.settings.sweep_batch,
    )
    return {"pruned": gone}


#: The order of a full pass: malformed rows first (no other job can read them right),
#: rescue before pruning workers (inside ``rescue``), expire before resume (a task past
#: its deadline is not resumed), resume before demote (a task due now is resumed, not
#: failed), dependencies after both (a task they end dooms its waiters in the same pass).
ALL = (malformed, rescue, expire, resume, schedules, demote, dependencies, purge, prune)


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
