"""The workspace client budget on SQLite and Postgres."""

from __future__ import annotations

import json
import multiprocessing as mp
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from agentbus.admission.budget import Reserve, SessionBudget, WorkspaceBudget, client_budget
from agentbus.admission.budget_setting import (
    BudgetSetting,
    disagreement,
    read_setting,
    write_setting,
)
from agentbus.config import Settings
from agentbus.db import Database
from agentbus.errors import ConfigError
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_events
from tests import procs
from tests.support import FakeClock, Proc, clean_env, enqueue_held, free_port, wait_until


def events(db: Database, kind: str) -> list[dict[str, Any]]:
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(bus_events).where(bus_events.c.kind == kind).order_by(bus_events.c.id)
        ).all()
    )
    return [dict(r._mapping) for r in rows]


def workspace_budget(
    db: Database, mode: str, size: int, *holders: str, clock: FakeClock | None = None
) -> list[WorkspaceBudget]:
    """Set the workspace's budget as ``busctl budget set`` does, and open it as ``holders``."""
    write_setting(db, mode=mode, size=size, by="test")
    return [WorkspaceBudget(db, holder=h, clock=clock or FakeClock()) for h in holders]


def test_hysteresis_warns_once_per_rise_across_processes(db: Database, clock: FakeClock) -> None:
    one, two = workspace_budget(db, "warn", 8, "p1", "p2", clock=clock)
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
    budget, other = workspace_budget(db, "enforce", 2, "p1", "p2", clock=clock)
    assert budget.try_reserve("a", lease_sec=600) is Reserve.RESERVED
    assert other.try_reserve("b", lease_sec=60) is Reserve.RESERVED
    assert budget.try_reserve("c") is Reserve.REFUSED
    clock.advance(61)  # p2 died holding b: its lease ran out, the slot is free again
    assert budget.try_reserve("c") is Reserve.RESERVED
    assert other.try_reserve("d") is Reserve.REFUSED
    write_setting(db, mode="warn", size=None, by="operator")  # busctl budget set --mode warn
    assert other.try_reserve("d") is Reserve.REFUSED  # read again only after a second…
    clock.advance(1)
    assert other.try_reserve("d") is Reserve.RESERVED  # …then warn never refuses
    assert (budget.mode, budget.budget) == ("enforce", 2)  # not asked since the change
    clock.advance(1)
    assert budget.snapshot()["mode"] == "warn" and budget.snapshot()["set_by"] == "operator"


def test_refusals_in_nested_passes_are_one_batch_and_stay_visible(
    db: Database, clock: FakeClock
) -> None:
    budget, other = workspace_budget(db, "enforce", 1, "p1", "p2", clock=clock)
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
    assert other.snapshot()["last_refused"] == ["e"]  # the whole workspace sees it
    budget.begin_pass()
    assert budget.last_refused() == []  # cleared when the next pass begins
    budget.end_pass()


def test_calls_of_one_process_share_its_hold_and_threads_have_passes_of_their_own(
    db: Database, clock: FakeClock
) -> None:
    """A worker running several calls on one provider holds the name once, until the last
    of them ends; each slot thread's refusals are a batch of its own."""
    (budget,) = workspace_budget(db, "enforce", 1, "p1", clock=clock)
    own = Settings(budget_mode="enforce", client_budget=1, no_workspace_budget=True)
    session = client_budget(db, own, holder="p2")
    for each in (budget, session):
        assert each.try_reserve("sim") is Reserve.RESERVED
        assert each.try_reserve("sim") is Reserve.ALREADY_HELD  # a second call, same process
        assert each.release("sim") and each.reserved() == ["sim"]  # the other still runs
        assert each.release("sim") and each.reserved() == []
        assert not each.release("sim")
    budget.try_reserve("held")
    refused: list[list[str]] = []

    def slot(name: str) -> None:
        with budget.bulk_pass():
            budget.try_reserve(name)
            refused.append(budget.pending)

    with budget.bulk_pass():  # this thread's pass stays open while the other's ends
        budget.try_reserve("mine")
        thread = threading.Thread(target=slot, args=("theirs",))
        thread.start()
        thread.join()
        assert refused == [["theirs"]] and budget.pending == ["mine"]
        assert [e["detail"]["names"] for e in events(db, "refused_batch")] == [["theirs"]]
    assert [e["detail"]["names"] for e in events(db, "refused_batch")][-1] == ["mine"]


def test_off_mode_does_nothing_and_session_scope_stays_in_the_process(db: Database) -> None:
    off = client_budget(db, Settings(budget_mode="warn", client_budget=1), holder="p1")
    assert isinstance(off, WorkspaceBudget) and off.mode == "off"  # never set: off, flags or not
    with off.bulk_pass():
        assert all(off.try_reserve(str(i)) is Reserve.RESERVED for i in range(50))
    assert off.reserved() == [] and events(db, "budget_warning") == []
    assert not off.release("1")  # nothing was held: no write
    own = Settings(budget_mode="enforce", client_budget=1, no_workspace_budget=True)
    session = client_budget(db, own, holder="p1")
    assert isinstance(session, SessionBudget)
    assert session.try_reserve("a") is Reserve.RESERVED
    assert session.try_reserve("b") is Reserve.REFUSED
    (warning,) = events(db, "budget_warning")
    (batch,) = events(db, "refused_batch")
    assert warning["scope"] == batch["scope"] == "session"
    assert session.snapshot()["last_refused"] == ["b"]


def test_an_invalid_workspace_budget_is_refused_and_changes_nothing(db: Database) -> None:
    with pytest.raises(ConfigError, match="enforce needs a positive size"):
        write_setting(db, mode="enforce", size=None, by="t")
    with pytest.raises(ConfigError, match="budget mode must be one of"):
        write_setting(db, mode="strict", size=3, by="t")
    assert read_setting(db) == BudgetSetting() and events(db, "budget_set") == []
    with pytest.raises(ConfigError, match="enforce needs a positive client budget"):
        SessionBudget(db, mode="enforce", budget=0, holder="p1")
    before, after = write_setting(db, mode="enforce", size=6, by="t")
    assert (before.mode, after.mode, after.size) == ("off", "enforce", 6)
    with pytest.raises(ConfigError, match="enforce needs a positive size"):
        write_setting(db, mode=None, size=0, by="t")
    assert read_setting(db).size == 6
    (event,) = events(db, "budget_set")
    assert event["detail"] == {"mode": "enforce", "size": 6, "was": ["off", 0]}


def test_flags_that_disagree_with_the_workspace_are_named() -> None:
    shared = BudgetSetting("warn", 6)
    assert disagreement(Settings(), shared) is None  # no flag given
    assert disagreement(Settings(budget_mode="warn", client_budget=6), shared) is None
    line = disagreement(Settings(budget_mode="enforce", client_budget=2), shared)
    assert line is not None and "\n" not in line
    assert line.startswith("--budget-mode enforce --client-budget 2 ignored: ")
    assert "the workspace's (warn, size 6)" in line
    own = Settings(budget_mode="enforce", client_budget=2, no_workspace_budget=True)
    assert disagreement(own, shared) is None  # the kill switch: the flags are the budget


@pytest.mark.process
def test_two_processes_racing_for_the_last_slot_one_wins(db: Database, db_url: str) -> None:
    write_setting(db, mode="enforce", size=1, by="test")
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
    write_setting(db, mode="warn", size=8, by="test")
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
    write_setting(db, mode="enforce", size=1, by="test")  # busctl budget set: no flags needed
    flags = ("--drain", "--log-json")
    first = spawn("worker", "--agent", "a", "--db", db_url, *flags, env=env)
    wait_until(lambda: WorkspaceBudget(db, holder="t").reserved() == ["sim"])
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
    assert WorkspaceBudget(db, holder="t").reserved() == []  # released


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


@pytest.mark.process
def test_running_workers_and_serve_follow_busctl_budget_set(
    db_url: str,
    db: Database,
    spawn: Callable[..., Proc],
    tmp_path: Path,
    run_busctl: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    env = {"AGENTBUS_POLL_SEC": "0.05", "AGENTBUS_CONFIG_CHECK_SEC": "0.01"}
    port = free_port()
    serve = spawn("busctl", "--db", db_url, "serve", "--port", str(port), env=env)
    workers = [
        spawn("worker", "--agent", "codex", "--db", db_url, "--log-json", env=env) for _ in range(2)
    ]
    for proc in workers:
        wait_until(lambda proc=proc: "worker_started" in proc.text())
    status_url = f"http://127.0.0.1:{port}/workspace/status"

    def served_budget() -> dict[str, Any] | None:
        try:
            return dict(httpx.get(status_url, timeout=2).json()["budget"])
        except httpx.TransportError:
            return None

    assert wait_until(served_budget)["mode"] == "off"  # never set
    done = run_busctl("--db", db_url, "budget", "set", "--mode", "warn", "--size", "6")
    assert (done.returncode, done.stdout.strip()) == (0, "client budget: warn, size 6 (was off)")

    # Each worker holds one call (a gate file per task), so each admits once after the set.
    gates = [tmp_path / f"gate-{i}" for i in range(2)]
    queue = TaskQueue(db)
    ids = enqueue_held(queue, gates)
    for gate in gates:
        wait_until(lambda gate=gate: Path(f"{gate}.waiting").exists())
    for proc in workers:
        changed = [
            json.loads(line) for line in proc.text().splitlines() if "client_budget_changed" in line
        ]
        assert [(c["mode"], c["size"], c["was"]) for c in changed] == [("warn", 6, "off/0")]
    budget = served_budget()
    assert budget is not None
    assert {k: budget[k] for k in ("mode", "budget", "scope", "reserved", "count")} == {
        "mode": "warn",
        "budget": 6,
        "scope": "workspace",
        "reserved": ["sim"],  # both workers call provider sim: one name
        "count": 1,
    }
    shown = json.loads(run_busctl("--db", db_url, "budget", "show", "--json").stdout)
    assert (shown["mode"], shown["budget"], shown["reserved"]) == ("warn", 6, ["sim"])

    # A worker given flags that disagree says so in one line, and applies the workspace's.
    odd = spawn(
        "worker", "--agent", "other", "--db", db_url, "--log-json",
        "--budget-mode", "enforce", "--client-budget", "2", "--drain", env=env,
    )  # fmt: skip
    assert odd.wait() == 0, odd.text()
    (ignored,) = [json.loads(x) for x in odd.text().splitlines() if "flags_ignored" in x]
    assert ignored["detail"].startswith("--budget-mode enforce --client-budget 2 ignored: ")
    (started,) = [json.loads(x) for x in odd.text().splitlines() if "worker_started" in x]
    assert (started["client_budget"], started["client_budget_size"]) == ("warn", 6)

    for gate in gates:
        gate.touch()
    wait_until(lambda: {queue.get(i).status for i in ids} == {"done"})
    for proc in [*workers, serve]:
        proc.signal(signal.SIGTERM)
        assert proc.wait() == 0, proc.text()[-2000:]
