"""The workspace client budget on SQLite and Postgres."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.admission.budget import Reserve, SessionBudget, WorkspaceBudget, client_budget
from agentbus.db import Database
from agentbus.errors import ConfigError
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_events
from tests import procs
from tests.support import FakeClock, Proc, clean_env, wait_until


def events(db: Database, kind: str) -> list[dict[str, Any]]:
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(bus_events).where(bus_events.c.kind == kind).order_by(bus_events.c.id)
        ).all()
    )
    return [dict(r._mapping) for r in rows]


def test_hysteresis_warns_once_per_rise_across_processes(db: Database, clock: FakeClock) -> None:
    one = WorkspaceBudget(db, mode="warn", budget=8, holder="p1", clock=clock)
    two = WorkspaceBudget(db, mode="warn", budget=8, holder="p2", clock=clock)
    for name in "abc":
        assert one.try_reserve(name) is Reserve.RESERVED
    two.try_reserve("d"), two.try_reserve("e")
    assert events(db, "budget_warning") == []
    assert two.try_reserve("f") is Reserve.RESERVED  # 6/8 = 75 %: the first warning
    assert len(events(db, "budget_warning")) == 1
    assert (
        one.try_reserve("a") is Reserve.ALREADY_HELD
        and two.try_reserve("a") is Reserve.ALREADY_HELD
    )
    assert not one.release("f") and two.release("f") and not two.release("f")  # idempotent
    assert one.try_reserve("g") is Reserve.RESERVED  # back at 6/8: not re-armed, no warning
    one.release("g"), one.release("c")
    two.try_reserve("h"), two.try_reserve("i")  # oscillating around 75 %
    assert len(events(db, "budget_warning")) == 1
    for name in "hide":
        two.release(name)
    assert sorted(one.reserved()) == ["a", "b"]  # 2/8 = 25 % < 37.5 %: re-armed
    for name in "wxyz":
        one.try_reserve(name)
    warnings = events(db, "budget_warning")
    assert len(warnings) == 2 and warnings[1]["scope"] == "workspace"
    assert warnings[1]["detail"]["names"] == ["a", "b", "w", "x", "y", "z"]


def test_enforce_refuses_above_the_budget_and_a_dead_holders_slot_expires(
    db: Database, clock: FakeClock
) -> None:
    budget = WorkspaceBudget(db, mode="enforce", budget=2, holder="p1", clock=clock)
    other = WorkspaceBudget(db, mode="enforce", budget=2, holder="p2", clock=clock)
    assert budget.try_reserve("a", lease_sec=600) is Reserve.RESERVED
    assert other.try_reserve("b", lease_sec=60) is Reserve.RESERVED
    assert budget.try_reserve("c") is Reserve.REFUSED
    clock.advance(61)  # p2 died holding b: its lease ran out, the slot is free again
    assert budget.try_reserve("c") is Reserve.RESERVED
    assert other.try_reserve("d") is Reserve.REFUSED
    warn = WorkspaceBudget(db, mode="warn", budget=1, holder="p3", clock=clock)
    assert warn.try_reserve("e") is Reserve.RESERVED  # warn never refuses


def test_refusals_in_nested_passes_are_one_batch_and_stay_visible(
    db: Database, clock: FakeClock
) -> None:
    budget = WorkspaceBudget(db, mode="enforce", budget=1, holder="p1", clock=clock)
    budget.try_reserve("held")
    with budget.bulk_pass():
        with budget.bulk_pass():
            assert budget.try_reserve("c") is Reserve.REFUSED
        assert events(db, "refused_batch") == []  # the inner pass does not emit
        assert budget.try_reserve("d") is Reserve.REFUSED
    (batch,) = events(db, "refused_batch")
    assert batch["detail"]["names"] == ["c", "d"] and batch["scope"] == "workspace"
    assert budget.last_refused() == ["c", "d"]  # visible after the emit
    assert budget.try_reserve("e") is Reserve.REFUSED  # outside any pass: a batch of one
    assert events(db, "refused_batch")[-1]["detail"]["names"] == ["e"]
    other = WorkspaceBudget(db, mode="enforce", budget=1, holder="p2", clock=clock)
    assert other.snapshot()["last_refused"] == ["e"]  # the whole workspace sees it
    budget.begin_pass()
    assert budget.last_refused() == []  # cleared when the next pass begins
    budget.end_pass()


def test_off_mode_does_nothing_and_session_scope_stays_in_the_process(db: Database) -> None:
    off = WorkspaceBudget(db, mode="off", budget=0, holder="p1")
    with off.bulk_pass():
        assert all(off.try_reserve(str(i)) is Reserve.RESERVED for i in range(50))
    assert off.reserved() == [] and events(db, "budget_warning") == []
    session = client_budget(db, mode="enforce", budget=1, holder="p1", per_process=True)
    assert isinstance(session, SessionBudget)
    assert session.try_reserve("a") is Reserve.RESERVED
    assert session.try_reserve("b") is Reserve.REFUSED
    (warning,) = events(db, "budget_warning")
    (batch,) = events(db, "refused_batch")
    assert warning["scope"] == batch["scope"] == "session"
    assert session.snapshot()["last_refused"] == ["b"]


def test_enforce_without_a_budget_is_a_config_error(db: Database) -> None:
    with pytest.raises(ConfigError, match="enforce needs a positive client budget"):
        WorkspaceBudget(db, mode="enforce", budget=0, holder="p1")
    with pytest.raises(ConfigError, match="budget mode must be one of"):
        WorkspaceBudget(db, mode="strict", budget=3, holder="p1")


@pytest.mark.process
def test_two_processes_racing_for_the_last_slot_one_wins(db: Database, db_url: str) -> None:
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:
        for round_ in range(4):
            start = ctx.Manager().Event()
            futures = [
                pool.submit(procs.reserve_one, db_url, f"p{i}", f"r{round_}-{i}", start)
                for i in range(2)
            ]
            start.set()
            answers = sorted(f.result(timeout=60) for f in futures)
            assert answers == ["refused", "reserved"], answers
            db.write(lambda conn: conn.execute(sa.text("DELETE FROM budget_slots")))


@pytest.mark.process
def test_two_processes_rising_together_warn_once(db: Database, db_url: str) -> None:
    ctx = mp.get_context("spawn")
    start = ctx.Manager().Event()
    with ProcessPoolExecutor(2, mp_context=ctx) as pool:
        futures = [
            pool.submit(procs.reserve_many, db_url, f"p{i}", [f"{i}-{n}" for n in range(4)], start)
            for i in range(2)
        ]
        start.set()
        assert all(f.result(timeout=60) == ["reserved"] * 4 for f in futures)
    assert len(events(db, "budget_warning")) == 1  # 8/8 reserved, one warning between them


@pytest.mark.process
def test_a_worker_refused_by_the_client_budget_pauses_its_task(
    db_url: str, db: Database, spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    config = tmp_path / "agentbus.toml"
    config.write_text(
        '[providers.other]\nkind = "simulated"\n[models."sim/o"]\nprovider = "other"\n'
    )
    env = {
        "AGENTBUS_CONFIG": str(config),
        "AGENTBUS_ADMISSION_RECHECK_SEC": "60",
        "AGENTBUS_POLL_SEC": "0.1",
    }
    queue = TaskQueue(db)
    gate = tmp_path / "holder-may-finish"  # the holder's call lasts until the test says so
    slow = {"simulate": {"sim/a": {"behaviour": "ok", "wait_for": str(gate)}}}
    holder = queue.enqueue(TaskSpec(agent="a", command="x", models=("sim/a",), payload=slow)).id
    refused = queue.enqueue(TaskSpec(agent="b", command="y", models=("sim/o",))).id
    flags = ("--budget-mode", "enforce", "--client-budget", "1", "--drain", "--log-json")
    first = spawn("worker", "--agent", "a", "--db", db_url, *flags, env=env)
    wait_until(lambda: WorkspaceBudget(db, mode="warn", budget=1, holder="t").reserved() == ["sim"])
    second = spawn("worker", "--agent", "b", "--db", db_url, *flags, env=env)
    assert second.wait() == 0, second.text()
    task = queue.get(refused)
    assert task.status == "paused" and "client_budget" in (task.pause_reason or "")
    (batch,) = events(db, "refused_batch")
    assert batch["detail"]["names"] == ["other"] and batch["source"].startswith("b@")
    assert len(events(db, "budget_warning")) == 1  # 1 of 1 reserved: 100 %
    gate.touch()
    assert first.wait() == 0, first.text()
    assert queue.get(holder).status == "done"
    assert WorkspaceBudget(db, mode="warn", budget=1, holder="t").reserved() == []  # released


@pytest.mark.parametrize(
    "argv",
    [
        ["worker", "--agent", "codex", "--budget-mode", "enforce"],
        ["busctl", "serve", "--budget-mode", "enforce", "--port", "0"],
    ],
)
def test_enforce_without_a_budget_stops_start_up(db_url: str, argv: list[str]) -> None:
    exe = str(Path(sys.executable).with_name(argv[0]))
    env = clean_env()
    run = subprocess.run(
        [exe, "--db", db_url, *argv[1:]], capture_output=True, text=True, timeout=60, env=env
    )
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line == (
        f"{argv[0]}: error: budget mode enforce needs a positive client budget "
        "(--client-budget N or AGENTBUS_CLIENT_BUDGET)"
    )
