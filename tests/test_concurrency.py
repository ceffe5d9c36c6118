"""One worker process running many tasks at once (``--concurrency N``), on both databases.

Calls are held in flight by files the test creates (``wait_for``), so overlap is
shown by the simulated provider's journal however slowly the processes run.
"""

from __future__ import annotations

import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.queue import TaskQueue, reads
from agentbus.schema import call_slots
from agentbus.schema import workers as workers_table
from tests.support import Proc, release_two_in_flight, wait_until, waiting
from tests.test_admission_process import (
    CONCURRENCY,
    RPM,
    enqueue,
    journal,
    live_queue,
    most_in_window,
    setup,
    statuses,
    stop,
    workers,
)

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]
__all__ = ["live_queue"]  # the fixture, shared


def held(gate: Path, **more: Any) -> dict[str, Any]:
    """A script whose call on sim/a lasts until ``gate`` exists."""
    return {"sim/a": {"behaviour": "ok", "wait_for": str(gate), **more}}


def worker_row(queue: TaskQueue) -> Any:
    return queue.db.read(lambda conn: conn.execute(sa.select(workers_table)).one_or_none())


def test_n_calls_overlap_in_one_process_and_the_workers_table_lists_them(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, "")
    gates = [tmp_path / f"gate{i}" for i in range(4)]
    ids = [enqueue(queue, 1, held(gate))[0] for gate in gates]
    (proc,) = workers(spawn, db_url, env, 1, "--concurrency", "4")
    wait_until(lambda: len(waiting(gates)) == 4)  # four calls in flight in one process
    wait_until(lambda: sorted(worker_row(queue).running or []) == sorted(ids))
    row = worker_row(queue)
    assert (row.concurrency, row.current_task in ids) == (4, True)
    assert set(statuses(queue.db, ids).values()) == {"claimed"}
    for gate in gates:
        gate.touch()
    wait_until(lambda: set(statuses(queue.db, ids).values()) == {"done"})
    wait_until(lambda: worker_row(queue).running == [])
    stop([proc])
    spans = [(c["started"], c["time"]) for c in journal(calls)]
    assert len(spans) == 4
    assert max(s for s, _ in spans) < min(e for _, e in spans)  # all four overlapped
    assert len({c["worker"] for c in journal(calls)}) == 1
    assert worker_row(queue) is None  # a clean exit removes the row


def test_a_slow_call_holds_nothing_back_pauses_free_their_slot_and_a_crash_errors_one_task(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, _ = setup(tmp_path, "")
    slow_gate = tmp_path / "slow"
    (slow,) = enqueue(queue, 1, held(slow_gate), priority=9)  # claimed first
    cooling = enqueue(queue, 3, {"sim/b": "rate_limited"}, models=("sim/b",), priority=5)
    crash = enqueue(queue, 1, {"sim/a": "crash"}, priority=4)
    fine = enqueue(queue, 3)
    (proc,) = workers(spawn, db_url, env, 1, "--concurrency", "2")
    rest = [*cooling, *crash, *fine]
    settled = {"paused", "error", "done"}
    wait_until(lambda: set(statuses(queue.db, rest).values()) <= settled)
    assert statuses(queue.db, [slow]) == {slow: "claimed"}  # still in its call
    found = statuses(queue.db, rest)
    assert Counter(found.values()) == {"paused": 3, "error": 1, "done": 3}
    (crashed,) = [queue.get(i) for i in crash]
    assert "RuntimeError: simulated crash" in (crashed.last_error or "")
    slow_gate.touch()
    wait_until(lambda: statuses(queue.db, [slow]) == {slow: "done"})
    stop([proc])
    events = [e["event"] for e in proc.events()]
    assert events.count("task_crashed") == 1 and events.count("task_paused") == 3


def test_failures_back_the_whole_worker_off_and_pauses_do_not_count(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, _ = setup(tmp_path, "")
    env["AGENTBUS_BACKOFF_THRESHOLDS"] = "3:0.03,5:0.06"
    fatal = enqueue(queue, 6, {"sim/a": "fatal"})
    paused = enqueue(queue, 4, {"sim/b": "rate_limited"}, models=("sim/b",))
    (proc,) = workers(spawn, db_url, env, 1, "--concurrency", "3", "--drain")
    assert proc.wait() == 0, proc.text()
    backoffs = [
        (e["consecutive_failures"], e["seconds"]) for e in proc.events() if e["event"] == "backoff"
    ]
    assert backoffs == [(3, 0.03), (4, 0.03), (5, 0.06), (6, 0.06)]
    assert set(statuses(queue.db, fatal).values()) == {"failed"}
    assert set(statuses(queue.db, paused).values()) == {"paused"}


def test_sigterm_claims_nothing_more_and_running_calls_finish(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, _ = setup(tmp_path, "")
    gates = [tmp_path / f"gate{i}" for i in range(3)]
    ids = [enqueue(queue, 1, held(gate))[0] for gate in gates]
    (waits,) = enqueue(queue, 1, priority=-1)  # no slot for it until a call ends
    (proc,) = workers(spawn, db_url, env, 1, "--concurrency", "3", "--grace", "60")
    wait_until(lambda: len(waiting(gates)) == 3)
    proc.signal(signal.SIGTERM)
    wait_until(lambda: "shutdown_requested" in proc.text())
    for gate in gates:
        gate.touch()
    assert proc.wait() == 0, proc.text()
    assert set(statuses(queue.db, ids).values()) == {"done"}
    assert queue.get(waits).status == "queued"  # freed slots claimed nothing after SIGTERM


def test_sigterm_gives_back_the_calls_that_outlive_the_grace(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, _ = setup(tmp_path, "")
    gates = [tmp_path / f"never{i}" for i in range(3)]  # never created
    ids = [enqueue(queue, 1, held(gate))[0] for gate in gates]
    (proc,) = workers(spawn, db_url, env, 1, "--concurrency", "3", "--grace", "0.3")
    wait_until(lambda: len(waiting(gates)) == 3)
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.text()
    for task_id in ids:
        task = queue.get(task_id)
        assert (task.status, task.attempts) == ("queued", 0)
        assert reads.task_events(queue.db, task_id)[-1]["reason"] == "shutdown"
    shutdown = [e for e in proc.events() if e["event"] == "shutdown"]
    assert shutdown and shutdown[-1].get("tasks") == 3


def test_concurrency_limit_holds_across_a_concurrent_worker_and_single_slot_workers(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, CONCURRENCY)  # the provider admits two calls at once
    gates = [tmp_path / f"gate{i}" for i in range(10)]
    ids = [enqueue(queue, 1, held(gate))[0] for gate in gates]
    procs = [
        *workers(spawn, db_url, env, 1, "--concurrency", "4"),
        *workers(spawn, db_url, env, 2),
        spawn("sweeper", "--db", db_url, env=env),
    ]
    release_two_in_flight(gates)
    wait_until(lambda: set(statuses(queue.db, ids).values()) == {"done"}, timeout=90)
    stop(procs)
    spans = [(c["started"], c["time"]) for c in journal(calls)]
    assert len(spans) == 10
    overlap = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
    assert overlap == 2


def test_rpm_holds_across_a_concurrent_worker_and_single_slot_workers(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, RPM)  # 10 calls per 4 s window
    ids = enqueue(queue, 25)
    drained = [
        *workers(spawn, db_url, env, 1, "--concurrency", "8", "--drain"),
        *workers(spawn, db_url, env, 2, "--drain"),
    ]
    assert [p.wait() for p in drained] == [0, 0, 0], [p.text()[-2000:] for p in drained]
    assert len(journal(calls)) == 10
    admitted = queue.db.read(
        lambda conn: conn.execute(sa.select(call_slots.c.admitted_at)).scalars().all()
    )
    assert len(admitted) == 10 and most_in_window(admitted, 4) == 10
    assert Counter(statuses(queue.db, ids).values()) == {"done": 10, "paused": 15}
