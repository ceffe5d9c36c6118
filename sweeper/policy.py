"""Which due paused tasks go back to the queue, decided from plain values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DueTask:
    id: int
    agent: str
    chain: tuple[str, ...] | None  # candidate keys; None: unresolvable (the worker fails it)
    resume_after: float
    paused_at: float | None
    pause_model: str | None
    reentry_count: int


@dataclass
class ResumePlan:
    resume: list[int] = field(default_factory=list)
    postpone: dict[int, float] = field(default_factory=dict)  # every candidate still refused
    hold: dict[int, float] = field(default_factory=dict)  # re-entry rule: spaced out
    room_left: dict[tuple[str, str], int] = field(default_factory=dict)


def plan_resume(
    due: Sequence[DueTask],
    blocked: Mapping[tuple[str, str], float],
    *,
    reentry_limit: int,
    reentry_hold_sec: float,
    room: Mapping[tuple[str, str], int] | None = None,
    recheck_at: float = 0.0,
) -> ResumePlan:
    """Resume a due task if admission would let some candidate of its chain through now.

    ``blocked`` maps (agent, candidate key) to when a refused candidate is
    admitted again (a cooldown, an open circuit, a full window, a spent
    budget…). A task whose candidates are all refused gets the earliest of
    those moments as its new resume time (no busy loop). ``room`` says how many
    calls a limited candidate takes now (absent: no limit): no more tasks are
    resumed for it than that, the rest wait until ``recheck_at`` (no herd of
    resumed tasks that would only pause again). A task that re-entered the
    cooldown of the same model ``reentry_limit`` times in a row stays paused
    until ``reentry_hold_sec`` after its latest pause.
    """
    plan = ResumePlan()
    left = dict(room or {})
    for task in due:
        if task.reentry_count >= reentry_limit and task.paused_at is not None:
            hold_until = task.paused_at + reentry_hold_sec
            if task.resume_after < hold_until:
                plan.hold[task.id] = hold_until
                continue
        if not task.chain:  # unresolvable or empty: the worker fails it with the reason
            plan.resume.append(task.id)
            continue
        usable = [m for m in task.chain if (task.agent, m) not in blocked]
        if not usable:
            plan.postpone[task.id] = min(blocked[task.agent, m] for m in task.chain)
            continue
        if any((task.agent, m) not in left for m in usable):
            plan.resume.append(task.id)
            continue
        spare = next((m for m in usable if left[task.agent, m] > 0), None)
        if spare is None:
            plan.postpone[task.id] = recheck_at
            continue
        left[task.agent, spare] -= 1
        plan.resume.append(task.id)
    plan.room_left = left
    return plan
