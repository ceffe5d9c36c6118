"""scripts/fleet_checks.py, the checks of scripts/fleet.py: each catches what it is there
to catch (the run itself is a benchmark: ``python scripts/bench.py fleet``; ``.ci/run``
runs a short one)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import ClassVar

import pytest

from tests.support import script

fleet = script("fleet_checks")


def test_the_most_in_a_window_counts_a_half_open_minute() -> None:
    assert fleet.most_in_window([], 60) == 0
    assert fleet.most_in_window([0, 30, 59.9], 60) == 3
    assert fleet.most_in_window([0, 30, 60], 60) == 2  # 60 is the next window's
    assert fleet.most_in_window([100, 0, 30, 61, 80], 60) == 3  # 30, 61, 80 in any order


def test_the_most_at_once_does_not_overlap_an_end_with_a_start() -> None:
    assert fleet.most_at_once([]) == 0
    assert fleet.most_at_once([(0, 1), (1, 2), (2, 3)]) == 1
    assert fleet.most_at_once([(0, 5), (1, 2), (1.5, 3), (4, 6)]) == 3
    assert fleet.most_at_once([(0, 10), (0, 10)]) == 2


def _call(task: int, provider: str = "p0", started: float = 0.0, ended: float = 1.0) -> object:
    return fleet.Call(task, provider, "a0", started, ended)


def test_a_run_that_held_passes_and_every_breach_fails_its_own_check() -> None:
    tasks = [1, 2, 3]
    calls = [_call(1, started=0, ended=1), _call(2, started=1, ended=2), _call(3, "p1")]
    admissions = {("p0", "a0"): [0.0, 1.0], ("p1", "a0"): [0.0]}
    held = fleet.judge(tasks, Counter(done=3), Counter(tasks), calls, admissions, 1, 2)
    assert held.ok, held.lines

    def failed(**changed: object) -> list[str]:
        given: dict[str, object] = {
            "tasks": tasks,
            "statuses": Counter(done=3),
            "done_events": Counter(tasks),
            "calls": calls,
            "admissions": admissions,
            "concurrency": 1,
            "rpm": 2,
        }
        verdict = fleet.judge(**{**given, **changed})
        assert not verdict.ok
        return [what for what, _, ok in verdict.lines if not ok]

    assert failed(statuses=Counter(done=2, paused=1)) == ["tasks done"]
    twice = [*calls, _call(2, "p1", 5, 6)]
    assert failed(calls=twice) == [
        "calls at the model: each task once",
        "admissions recorded = calls at the model",
    ]
    assert failed(done_events=Counter([1, 2, 3, 3])) == ["done events: each task once"]
    overlapping = [_call(1, started=0, ended=1.5), *calls[1:]]
    assert failed(calls=overlapping) == ["calls in flight per provider, limit 1"]
    assert failed(rpm=1) == ["admissions per account in any 60 s window, rpm 1"]


def test_the_journal_reads_what_the_model_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = script("fleet_model")
    journal = tmp_path / "journal.txt"
    monkeypatch.setenv(model.JOURNAL, str(journal))

    class Request:
        task_id = 7
        model = "p1/m"
        account = "a1"
        payload: ClassVar[dict[str, float]] = {"sleep": 0.001}

    assert model.answer(Request()) == "ok"
    assert model.answer(Request()) == "ok"
    calls = fleet.read_journal(journal)
    assert [(c.task_id, c.provider, c.account) for c in calls] == [(7, "p1", "a1")] * 2
    assert all(c.started < c.ended for c in calls)
