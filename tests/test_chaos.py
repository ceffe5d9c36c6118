"""The short chaos run (scripts/chaos.py) on both backends, and a kill in the middle of a call."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads, retention
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands
from tests import shown_counts
from tests.support import Proc, script, wait_until

pytestmark = pytest.mark.process


def test_short_chaos_run_loses_nothing(db_url: str, tmp_path: Path) -> None:
    chaos = script("chaos")
    report = chaos.run(
        db_url,
        tasks=300,
        duration=10,
        kill_every=1.2,
        settle=90,  # type: ignore[attr-defined]
        seed=11,
        workdir=tmp_path,
        say=print,
    )
    print("\n".join(report.lines()))
    assert report.kills >= 5
    assert report.ok, report.lines()
    assert sum(report.statuses.values()) == 300
    # Every count operators read is the table's, after the kills, and after cancels,
    # retries, resumes and retention on top.
    db = Database(db_url)
    assert shown_counts.differences(db) == []
    queue = TaskQueue(db)
    by_state = {
        state: db.read(
            lambda conn, s=state: (
                conn.execute(sa.select(bus_commands.c.id).where(bus_commands.c.status == s))
                .scalars()
                .all()
            )
        )
        for state in ("paused", "failed", "done")
    }
    assert queue.cancel(by_state["paused"][:3], by="test") or not by_state["paused"]
    for task_id in by_state["failed"][:3]:
        queue.retry(task_id)
    queue.resume(by_state["paused"][3:])
    gone = retention.prune(db, time.time() + 1e6, done_sec=1, failed_sec=1, batch=20, max_batches=2)
    assert gone > 0
    assert shown_counts.differences(db) == []
    db.dispose()


@pytest.mark.parametrize("slots", [1, 3])
def test_a_worker_killed_mid_call_loses_nothing(
    db_url: str, spawn: Callable[..., Proc], tmp_path: Path, slots: int
) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    nevers = [tmp_path / f"never{i}" for i in range(slots)]  # files nobody creates
    ids = [
        queue.enqueue(
            TaskSpec(
                agent="codex",
                command="x",
                models=("sim/a",),
                payload={"simulate": {"sim/a": {"wait_for": str(never)}}},
            )
        ).id
        for never in nevers
    ]
    env = {"AGENTBUS_LEASE_SEC": "1", "AGENTBUS_SWEEP_INTERVAL_SEC": "0.5"}
    argv = ["worker", "--agent", "codex", "--db", db_url, "--concurrency", str(slots)]
    doomed = spawn(*argv, env=env)
    # Every call in flight at once, in the one process.
    wait_until(lambda: all(Path(f"{never}.waiting").exists() for never in nevers))
    first = {task_id: queue.get(task_id) for task_id in ids}
    assert {task.status for task in first.values()} == {"claimed"}
    doomed.popen.send_signal(signal.SIGKILL)
    doomed.wait()
    sweeper = spawn("sweeper", "--db", db_url, env=env)
    wait_until(
        lambda: all(queue.get(i).status == "queued" and queue.get(i).rescue_count for i in ids)
    )
    sweeper.signal(signal.SIGTERM)
    assert sweeper.wait() == 0
    # The rescued tasks run again elsewhere (at-least-once), under new tokens.
    with db.engine.begin() as conn:
        conn.exec_driver_sql("UPDATE bus_commands SET payload = NULL")
    rerun = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert rerun.wait() == 0
    for task_id in ids:
        done = queue.get(task_id)
        assert done.status == "done" and done.claim_token == first[task_id].claim_token + 1
        reasons = [e["reason"] for e in reads.task_events(db, task_id)]
        assert reasons == ["enqueue", "claim", "lease expired", "claim", "done"]
    db.dispose()
