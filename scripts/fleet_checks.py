"""The checks of scripts/fleet.py: pure functions over what a fleet run recorded (the
model's journal of calls, the admissions copied from ``call_slots``, the tasks' states and
events). Each check fails on its own breach (tests/test_fleet_checks.py)."""

from __future__ import annotations

import bisect
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

WINDOW = 60.0  # rpm_window_sec's default: the window every check counts in


def most_in_window(times: Iterable[float], window: float) -> int:
    """The most of ``times`` in any half-open window ``[t, t + window)``."""
    ordered = sorted(times)
    return max(
        (bisect.bisect_left(ordered, t + window) - i for i, t in enumerate(ordered)), default=0
    )


def most_at_once(intervals: Iterable[tuple[float, float]]) -> int:
    """The most of ``intervals`` (start, end) open at one moment; one that ends when
    another starts does not overlap it."""
    edges = sorted([(end, -1) for _, end in intervals] + [(start, 1) for start, _ in intervals])
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return most


@dataclass(frozen=True)
class Call:
    task_id: int
    provider: str
    account: str
    started: float
    ended: float


def read_journal(path: Path) -> list[Call]:
    if not path.exists():
        return []
    calls = []
    for line in path.read_text().splitlines():
        task, provider, account, started, ended, _pid = line.split(" ")
        calls.append(Call(int(task), provider, account, float(started), float(ended)))
    return calls


@dataclass
class Verdict:
    lines: list[tuple[str, str, bool]] = field(default_factory=list)

    def check(self, what: str, figure: str, ok: bool) -> None:
        self.lines.append((what, figure, ok))

    @property
    def ok(self) -> bool:
        return all(ok for _, _, ok in self.lines)


def judge(
    tasks: Sequence[int],
    statuses: Counter[str],
    done_events: Counter[int],
    calls: Sequence[Call],
    admissions: dict[tuple[str, str], list[float]],
    concurrency: int,
    rpm: int,
) -> Verdict:
    """The run's checks from its records: the tasks enqueued, their statuses, the
    ``done`` events per task, the model's journal and the admissions per account."""
    v = Verdict()
    per_task = Counter(c.task_id for c in calls)
    never = [t for t in tasks if per_task[t] == 0]
    twice = sorted(t for t, n in per_task.items() if n > 1)
    v.check(
        "tasks done",
        f"{statuses.get('done', 0):,} of {len(tasks):,} ({dict(statuses)})",
        statuses.get("done", 0) == len(tasks),
    )
    v.check(
        "calls at the model: each task once",
        f"{len(calls):,} calls; {len(never)} tasks never called, {len(twice)} called twice"
        + (f" (e.g. {twice[:5]})" if twice else ""),
        not never and not twice,
    )
    events_off = sorted(t for t in tasks if done_events[t] != 1)
    v.check(
        "done events: each task once",
        f"{len(events_off)} tasks with other than one"
        + (f" (e.g. {events_off[:5]})" if events_off else ""),
        not events_off,
    )
    by_provider: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for c in calls:
        by_provider[c.provider].append((c.started, c.ended))
    peaks = {p: most_at_once(spans) for p, spans in sorted(by_provider.items())}
    v.check(
        f"calls in flight per provider, limit {concurrency}",
        ", ".join(f"{p} {n}" for p, n in peaks.items()) or "none",
        all(n <= concurrency for n in peaks.values()),
    )
    windows = {a: most_in_window(ts, WINDOW) for a, ts in sorted(admissions.items())}
    v.check(
        f"admissions per account in any {WINDOW:.0f} s window, rpm {rpm}",
        ", ".join(f"{p}/{a} {n}" for (p, a), n in windows.items()) or "none",
        all(n <= rpm for n in windows.values()),
    )
    admitted = sum(len(ts) for ts in admissions.values())
    v.check(
        "admissions recorded = calls at the model",
        f"{admitted:,} / {len(calls):,}",
        admitted == len(calls),
    )
    return v
