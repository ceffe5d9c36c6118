"""One clock for the fleet: processes whose host clocks are off by ±90 s or 10 min
share PostgreSQL's clock, so no lease is rescued early and no pause resumes early."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.clock import SKEW_ENV, DatabaseClock, offset_of
from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import task_events, workers
from tests.support import Proc, enqueue_held, wait_until

pytestmark = pytest.mark.process
# SQLite serves one host, whose processes share its clock: these are PostgreSQL's.
POSTGRES_ONLY = pytest.mark.parametrize("backend", ["postgresql"])


def test_the_fleet_clock_is_the_databases_on_postgresql_and_the_hosts_on_sqlite(
    db: Database,
) -> None:
    if db.dialect == "sqlite":
        assert db.clock is time.time and offset_of(db.clock) == 0.0
        return
    assert isinstance(db.clock, DatabaseClock)
    skewed = DatabaseClock(db, host=lambda: time.time() + 90)  # a host 90 s ahead
    assert abs(skewed() - time.time()) < 1.0  # the database's time, not the host's
    assert skewed.offset == pytest.approx(-90, abs=1.0)
    jumped = [0.0]
    moving = DatabaseClock(db, host=lambda: time.time() + jumped[0], resync_sec=3600)
    moving()
    jumped[0] = -600.0  # the host's clock steps back 10 min (a VM resumed, say)
    assert abs(moving() - time.time()) < 1.0  # noticed at once, not at the next resync


@POSTGRES_ONLY
def test_a_process_of_one_connection_reads_the_clock_again_between_transactions(
    db_url: str,
) -> None:
    """A sweeper's one connection is in use while it reads the time in a transaction:
    the clock's re-reading waits for a call made with it free, instead of waiting for
    a second connection the process may not open."""
    db = Database(db_url, connections=1, retry_for=1.0)
    clock = DatabaseClock(db, host=lambda: time.time() + 90)  # never measured: off by 90 s
    tries: list[float] = []
    measure = clock._measure
    clock._measure = lambda: tries.append(time.time()) or measure()  # type: ignore[method-assign]
    try:
        inside = db.write(lambda conn: clock())
        assert tries == [] and inside - time.time() == pytest.approx(90, abs=1.0)
        assert clock() - time.time() == pytest.approx(0, abs=1.0)  # free: measured now
        assert len(tries) == 1 and clock.offset == pytest.approx(-90, abs=1.0)
    finally:
        db.dispose()


def journal(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@POSTGRES_ONLY
def test_hosts_whose_clocks_are_off_never_run_a_task_twice_nor_resume_it_early(
    db_url: str, spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    gates = [tmp_path / f"gate{i}" for i in range(4)]
    held = enqueue_held(queue, gates)
    ok = tmp_path / "rate-limit-over"  # the provider answers 429 until it exists
    cooled = queue.enqueue(
        TaskSpec(
            agent="ron",
            command="cooled",
            models=("sim/b",),
            payload={"simulate": {"sim/b": {"behaviour": "rate_limited", "until_file": str(ok)}}},
        )
    ).id
    calls = tmp_path / "journal.jsonl"
    env = {
        "AGENTBUS_SIM_JOURNAL": str(calls),
        "AGENTBUS_LEASE_SEC": "3",  # renewed every second; a 90 s skew would expire it
        "AGENTBUS_MODEL_COOLDOWN_SEC": "3",
        "AGENTBUS_SWEEP_INTERVAL_SEC": "0.3",
        "AGENTBUS_SWEEP_PEEK_SEC": "0.2",
        "AGENTBUS_POLL_SEC": "0.1",
        "AGENTBUS_CALL_RETRIES": "0",
    }

    def process(program: str, skew: str, *args: str) -> Proc:
        argv = [*args, "--db", db_url, "--log-json"]
        return spawn(program, *argv, env={**env, SKEW_ENV: skew})

    procs = [
        process("worker", "-90", "--agent", "codex", "--concurrency", "2"),
        process("worker", "600", "--agent", "codex", "--concurrency", "2"),
        process("worker", "-600", "--agent", "ron"),
        process("sweeper", "90"),
    ]
    wait_until(lambda: all(Path(f"{g}.waiting").exists() for g in gates), timeout=60)
    # Held calls while the sweeper, 90 s ahead by its host, runs pass after pass.
    wait_until(lambda: procs[3].text().count('"sweep_pass"') >= 10, timeout=60)
    wait_until(lambda: queue.get(cooled).status == "paused", timeout=60)
    ok.touch()  # the provider is fine again; the task waits out its cooldown all the same
    wait_until(lambda: queue.get(cooled).status == "done", timeout=60)
    offsets = db.read(lambda conn: conn.execute(sa.select(workers.c.clock_offset)).scalars().all())
    assert sorted(round(o) for o in offsets) == [-600, 90, 600]  # what status shows
    for gate in gates:
        gate.touch()
    wait_until(lambda: all(queue.get(i).status == "done" for i in held), timeout=60)
    for proc in procs:
        proc.signal(signal.SIGTERM)
    assert [p.wait() for p in procs] == [0, 0, 0, 0]
    ran = [c["task_id"] for c in journal(calls)]
    assert sorted(i for i in ran if i in held) == sorted(held)  # each held task called once
    rescued = db.read(
        lambda conn: conn.execute(
            sa.select(sa.func.count()).where(task_events.c.reason == "lease expired")
        ).scalar_one()
    )
    assert rescued == 0
    events = reads.task_events(db, cooled)
    pause = next(e for e in events if e["to_status"] == "paused")
    resume = next(e for e in events if e["reason"] == "resume")
    assert resume["at"] >= pause["detail"]["resume_after"] - 0.01  # not before the cooldown end
    for proc in procs[:3]:
        assert "clock_off" in proc.text()  # each says its host clock is off
    db.dispose()


RPM = """
rpm_window_sec = 4
[providers.sim]
kind = "simulated"
rpm = 5
"""


@POSTGRES_ONLY
def test_rate_windows_stay_exact_across_hosts_whose_clocks_disagree(
    db_url: str, spawn: Callable[..., Proc], tmp_path: Path
) -> None:
    config = tmp_path / "agentbus.toml"
    config.write_text(RPM)
    calls = tmp_path / "journal.jsonl"
    env = {"AGENTBUS_CONFIG": str(config), "AGENTBUS_SIM_JOURNAL": str(calls)}
    db = Database(db_url)
    queue = TaskQueue(db)
    skews = {"ahead": "90", "behind": "-90", "far": "600"}  # one agent per host
    ids = [
        queue.enqueue(TaskSpec(agent=agent, command=str(i), models=("sim/a",))).id
        for agent in skews
        for i in range(4)
    ]
    drained = [
        spawn("worker", "--agent", agent, "--db", db_url, "--drain", env={**env, SKEW_ENV: skew})
        for agent, skew in skews.items()
    ]
    assert [p.wait() for p in drained] == [0, 0, 0], [p.text()[-1500:] for p in drained]
    assert len(journal(calls)) == 5  # one window's worth, whatever each host's clock says
    statuses = [queue.get(i).status for i in ids]
    assert statuses.count("done") == 5 and statuses.count("paused") == 7
    demoted = [e for i in ids for e in reads.task_events(db, i) if e["reason"] == "demoted"]
    assert demoted == []
    db.dispose()


@POSTGRES_ONLY
def test_reading_the_clock_never_fails_while_the_database_is_away(db: Database) -> None:
    gone = Database("postgresql+psycopg://nobody@127.0.0.1:1/none")
    clock = DatabaseClock(gone, host=lambda: time.time() + 90)
    assert abs(clock() - (time.time() + 90)) < 1.0  # the host's, until it can measure
    assert clock.offset == 0.0
    gone.dispose()
