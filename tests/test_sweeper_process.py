"""Real ``sweeper`` processes (with real workers) against SQLite and Postgres."""

from __future__ import annotations

import signal
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import ops_todos, task_events
from tests.support import Proc, wait_until

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]


def test_two_sweepers_racing_apply_each_transition_once(db_url: str, spawn: Spawn) -> None:
    db = Database(db_url)
    long_ago = time.time() - 49 * 3600
    old = TaskQueue(db, clock=lambda: long_ago)
    queue = TaskQueue(db)
    specs = [TaskSpec(agent="codex", command=str(i), models=("sim/a",)) for i in range(1030)]
    ids = queue.enqueue_many(specs)
    claimed = queue.claim("codex", "w", 60, limit=1030)
    stale = {t.id for t in claimed[:30]}
    for task in claimed:
        if task.id in stale:  # paused 49 h ago, not due again for a long time
            old.pause(task.id, task.claim_token, time.time() + 3600, "cooldown", model="sim/a")
        else:  # due now
            queue.pause(task.id, task.claim_token, time.time() - 1, "cooldown", model="sim/a")
    env = {"AGENTBUS_SWEEP_BATCH": "20"}  # small batches: the two passes interleave
    racers = [spawn("sweeper", "--db", db_url, "--once", env=env) for _ in range(2)]
    assert [p.wait(120) for p in racers] == [0, 0], [p.text() for p in racers]

    with db.engine.connect() as conn:
        moves = Counter(
            conn.execute(
                sa.select(task_events.c.task_id, task_events.c.reason).where(
                    task_events.c.from_status == "paused"
                )
            ).all()
        )
        todos = conn.execute(sa.select(ops_todos.c.task_id)).scalars().all()
    resumed = {task_id for (task_id, reason), n in moves.items() if reason == "resume"}
    demoted = {task_id for (task_id, reason), n in moves.items() if reason == "demoted"}
    assert set(moves.values()) == {1}, "a transition was applied twice"
    assert resumed == set(ids) - stale
    assert demoted == stale
    assert sorted(todos) == sorted(stale)
    lines = sum(p.text().count("[cooldown-resume]") for p in racers)
    assert lines == 1000  # one log line per task, from whichever sweeper moved it
    db.dispose()


def test_paused_task_is_resumed_after_its_cooldown_and_completed(
    db_url: str, db: Database, spawn: Spawn, tmp_path: Path
) -> None:
    queue = TaskQueue(db)
    env = {
        "AGENTBUS_MODEL_COOLDOWN_SEC": "1.5",
        "AGENTBUS_SWEEP_PEEK_SEC": "0.2",
        "AGENTBUS_POLL_SEC": "0.1",
    }
    worker = spawn("worker", "--agent", "codex", "--db", db_url, "--log-json", env=env)
    sweeper = spawn("sweeper", "--db", db_url, "--interval", "60", "--log-json", env=env)
    # The model answers 429 until the test has seen the task paused: however slowly
    # the processes start, the pause happens, and the resume after it.
    limited_until = tmp_path / "limit-over"
    script = {
        "simulate": {"sim/a": {"behaviour": "rate_limited", "until_file": str(limited_until)}}
    }
    task_id = queue.enqueue(
        TaskSpec(agent="codex", command="x", models=("sim/a",), payload=script)
    ).id
    wait_until(lambda: queue.get(task_id).status == "paused", timeout=60)
    limited_until.touch()
    wait_until(lambda: queue.get(task_id).status == "done", timeout=60)
    for proc in (worker, sweeper):
        proc.signal(signal.SIGTERM)
    assert worker.wait() == 0 and sweeper.wait() == 0
    events = reads.task_events(db, task_id)
    assert [(e["from_status"], e["to_status"]) for e in events] == [
        (None, "queued"),
        ("queued", "claimed"),
        ("claimed", "paused"),
        ("paused", "queued"),
        ("queued", "claimed"),
        ("claimed", "done"),
    ]
    paused, resumed = events[2], events[3]
    # Not before the cooldown's end; and well before the next 60 s pass, or
    # wait_until above would have given up (the latency itself is measured by
    # scripts/bench.py).
    assert resumed["at"] >= paused["detail"]["resume_after"]
    logged = [e["event"] for e in sweeper.events()]
    assert f"[cooldown-resume] task_id={task_id} agent=codex → re-queued" in logged
    assert "sweeper_stopped" in logged


@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (["--interval", "0"], "Invalid value for '--interval'", 2),
        (["--db", "postgresql://u:hunter2@127.0.0.1:1/x"], "cannot connect", 3),
        (["--nope"], "No such option", 2),
    ],
)
def test_sweeper_bad_input_is_one_line(
    spawn: Spawn, args: list[str], message: str, status: int
) -> None:
    proc = spawn("sweeper", *args)
    assert proc.wait() == status  # 2 bad input; 3 the database is away (retry later)
    lines = proc.text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("sweeper: error: ") and message in lines[0]
    assert "hunter2" not in lines[0]


def test_sweeper_refuses_an_unmigrated_database(spawn: Spawn, empty_db_url: str) -> None:
    proc = spawn("sweeper", "--db", empty_db_url, "--once")
    assert proc.wait() == 3 and "run `busctl migrate`" in proc.text()
