"""Which due paused tasks go back to the queue, decided from plain values."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agentbus.admission.tokens import Tokens

#: (agent, candidate key)
Key = tuple[str, str]


@dataclass(frozen=True)
class DueTask:
    id: int
    agent: str
    chain: tuple[str, ...] | None  # candidate keys; None: unresolvable (the worker fails it)
    resume_after: float
    paused_at: float | None
    pause_model: str | None
    reentry_count: int
    # What its call holds of each candidate's token windows (absent: none counts it).
    needs: Mapping[str, Tokens] = field(default_factory=dict)


@dataclass
class ResumePlan:
    resume: list[int] = field(default_factory=list)
    postpone: dict[int, float] = field(default_factory=dict)  # every candidate still refused
    hold: dict[int, float] = field(default_factory=dict)  # re-entry rule: spaced out
    room_left: dict[Key, int] = field(default_factory=dict)
    tokens_left: dict[Key, dict[str, int]] = field(default_factory=dict)


def plan_resume(
    due: Sequence[DueTask],
    blocked: Mapping[Key, float],
    *,
    reentry_limit: int,
    reentry_hold_sec: float,
    room: Mapping[Key, int] | None = None,
    recheck_at: float = 0.0,
    tokens: Mapping[Key, Mapping[str, int]] | None = None,
) -> ResumePlan:
    """Resume a due task if admission would let some candidate of its chain through now.

    ``blocked`` maps (agent, candidate key) to when a refused candidate is
    admitted again (a cooldown, an open circuit, a full window, a spent
    budget…). A task whose candidates are all refused gets the earliest of
    those moments as its new resume time (no busy loop). ``room`` says how many
    calls a limited candidate takes now (absent: no limit), ``tokens`` how many
    tokens each of its token windows has left: no more tasks are resumed for it
    than fit (by their ``needs``), the rest wait until ``recheck_at`` (no herd
    of resumed tasks that would only pause again). A task resumes for the first
    candidate of its chain that takes it, and spends that one's room. A task
    that re-entered the cooldown of the same model ``reentry_limit`` times in a
    row stays paused until ``reentry_hold_sec`` after its latest pause.
    """
    plan = ResumePlan()
    left = dict(room or {})
    free = {key: dict(windows) for key, windows in (tokens or {}).items()}

    def fits(task: DueTask, m: str) -> bool:
        need, has = task.needs.get(m), free.get((task.agent, m))
        if left.get((task.agent, m), 1) <= 0:
            return False
        return need is None or has is None or all(need.of(g) <= n for g, n in has.items())

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
        spare = next((m for m in usable if fits(task, m)), None)
        if spare is None:
            plan.postpone[task.id] = recheck_at
            continue
        key = (task.agent, spare)
        if key in left:
            left[key] -= 1
        need, windows = task.needs.get(spare), free.get(key, {})
        if need is not None:
            for gate in windows:
                windows[gate] -= need.of(gate)
        plan.resume.append(task.id)
    plan.room_left, plan.tokens_left = left, free
    return plan
