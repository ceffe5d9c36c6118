"""Real ``worker`` processes against SQLite and Postgres, asserting on the database."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import model_cooldown, workers
from tests.support import Proc, wait_until

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]
AGENTS = ["analyst-macro", "codex", "ron"]


@pytest.fixture
def queue(db_url: str) -> Iterator[TaskQueue]:
    db = Database(db_url)
    yield TaskQueue(db)
    db.dispose()


def enqueue(
    queue: TaskQueue,
    agent: str,
    payload: dict[str, object],
    n: int = 1,
    models: tuple[str, ...] = ("sim/a", "sim/b"),
    priority: int = 0,
) -> list[int]:
    return [
        queue.enqueue(
            TaskSpec(
                agent=agent,
                command=f"{agent} task {i}",
                models=models,
                payload=payload,
                priority=priority,
            )
        ).id
        for i in range(n)
    ]


def journal_calls(path: Path) -> Counter[str]:
    if not path.exists():
        return Counter()
    return Counter(json.loads(line)["model"] for line in path.read_text().splitlines())


def test_every_model_cooling_pauses_every_task_and_each_model_is_called_once(
    db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    journal = tmp_path / "journal.jsonl"
    env = {"AGENTBUS_SIM_JOURNAL": str(journal)}
    script = {
        "simulate": {
            "sim/a": "rate_limited",
            "sim/b": {"behaviour": "overloaded", "retry_after_s": 400},
        }
    }
    ids = [i for agent in AGENTS for i in enqueue(queue, agent, script, n=5)]

    first = spawn("worker", "--agent", AGENTS[0], "--db", db_url, "--drain", "--log-json", env=env)
    assert first.wait() == 0, first.text()
    # Workers started afterwards (other processes) skip the cooled models without a call.
    second = spawn("worker", "--agent", AGENTS[1], "--db", db_url, "--drain", "--log-json", env=env)
    third = spawn("worker", "--agent", AGENTS[2], "--db", db_url, "--log-json", env=env)
    assert second.wait() == 0, second.text()
    wait_until(lambda: all(queue.get(i).status == "paused" for i in ids))
    with queue.db.engine.connect() as conn:
        row = conn.execute(sa.select(workers).where(workers.c.agent == AGENTS[2])).one()
        cooldowns = dict(
            conn.execute(
                sa.select(model_cooldown.c.model_id, model_cooldown.c.cooldown_until)
            ).all()
        )
    assert (row.consecutive_failures, row.backoff_until) == (0, None)
    third.signal(signal.SIGTERM)
    assert third.wait() == 0

    assert journal_calls(journal) == {"sim/a": 1, "sim/b": 1}
    assert set(cooldowns) == {"sim/a", "sim/b"}
    assert cooldowns["sim/b"] - cooldowns["sim/a"] == pytest.approx(220, abs=1)  # Retry-After 400
    for task_id in ids:
        task = queue.get(task_id)
        assert (task.status, task.attempts) == ("paused", 0)
        assert task.resume_after == cooldowns["sim/a"]  # the earliest expiry
        assert (task.pause_model, task.pause_reason) == (
            "sim/a",
            "all candidate models are cooling down",
        )
        assert [e["to_status"] for e in reads.task_events(queue.db, task_id)] == [
            "queued",
            "claimed",
            "paused",
        ]
    for proc in (first, second, third):
        names = [e["event"] for e in proc.events()]
        assert "backoff" not in names and "task_failed" not in names
        assert "RATE-LIMITED" not in proc.text()
    assert (
        Counter(e["event"] for p in (first, second, third) for e in p.events())["task_paused"] == 15
    )


def test_backoff_at_3_5_10_failures_and_reset_by_success(
    db_url: str, queue: TaskQueue, spawn: Spawn
) -> None:
    fatal = {"simulate": {"sim/a": "fatal"}}
    for i in range(11):  # priorities make the claim order: 11 failures, a success, a failure
        enqueue(queue, "codex", fatal, models=("sim/a",), priority=100 - i)
    enqueue(queue, "codex", {}, models=("sim/a",), priority=50)
    enqueue(queue, "codex", fatal, models=("sim/a",), priority=40)
    env = {"AGENTBUS_BACKOFF_THRESHOLDS": "3:0.03,5:0.06,10:0.12"}
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--drain", "--log-json", env=env)
    assert proc.wait() == 0, proc.text()
    backoffs = [
        (e["consecutive_failures"], e["seconds"]) for e in proc.events() if e["event"] == "backoff"
    ]
    assert backoffs == [
        (3, 0.03),
        (4, 0.03),
        (5, 0.06),
        (6, 0.06),
        (7, 0.06),
        (8, 0.06),
        (9, 0.06),
        (10, 0.12),
        (11, 0.12),
    ]
    assert reads.counts(queue.db) == {("failed", "codex"): 12, ("done", "codex"): 1}


def test_sigterm_lets_a_short_call_finish(
    db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"  # the call lasts until the test opens the gate
    (task_id,) = enqueue(
        queue, "codex", {"simulate": {"sim/a": {"wait_for": str(gate)}}}, models=("sim/a",)
    )
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--grace", "30", "--log-json")
    wait_until(lambda: Path(f"{gate}.waiting").exists())  # the call is running
    proc.signal(signal.SIGTERM)
    wait_until(lambda: "shutdown_requested" in proc.text())
    gate.touch()  # it ends within the grace period
    assert proc.wait() == 0
    assert queue.get(task_id).status == "done"


def run_python(script: str) -> subprocess.CompletedProcess[str]:
    """``script`` run by this interpreter in a process of its own (signals sent there
    reach no test runner)."""
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )


STOP_WHILE_A_LOCK_IS_HELD = """
import os, signal, threading
from agentbus.cli import on_stop_signals

lock = threading.Lock()  # as the lock of an Event the main thread is waiting on
seen = []
delivered = threading.Event()

def stop(name):
    got = lock.acquire(timeout=20)  # in the main thread, with the lock held: never
    seen.append((name, threading.current_thread().name, got))
    if got:
        lock.release()
    delivered.set()

on_stop_signals(stop)
with lock:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):  # bytecodes run with the lock held: a handler may run here
        pass
delivered.wait(60)
print(seen)
"""


def test_a_stop_signal_is_acted_on_outside_the_signal_handler() -> None:
    """A signal handler runs in the main thread at any bytecode, maybe while that thread
    holds a lock the stop needs (a worker idle in ``Event.wait`` holds the event's
    between its waits): acting there would wait on itself forever."""
    out = run_python(STOP_WHILE_A_LOCK_IS_HELD)
    assert out.stdout.strip() == "[('SIGTERM', 'signals', True)]", out.stderr


STOP_THAT_FAILS_ONCE = """
import os, signal, threading
from agentbus.cli import on_stop_signals

calls = []
second = threading.Event()

def stop(name):
    calls.append(name)
    if len(calls) == 1:
        raise RuntimeError("a bug in the first stop")
    second.set()

on_stop_signals(stop)
os.kill(os.getpid(), signal.SIGTERM)
while not calls:  # the first one was acted on (and failed)
    pass
os.kill(os.getpid(), signal.SIGINT)
second.wait(60)
print(calls)
"""


def test_a_stop_that_fails_is_shown_and_the_next_signal_still_heard() -> None:
    out = run_python(STOP_THAT_FAILS_ONCE)
    assert out.stdout.strip() == "['SIGTERM', 'SIGINT']", out.stderr
    assert "RuntimeError: a bug in the first stop" in out.stderr


START_UP = """
import gc, sys
import click
from agentbus import cli
from agentbus.errors import ConfigError

@click.command()
@click.option("--fail", is_flag=True)
def command(fail):
    started = cli.start_up()
    print("starting", gc.isenabled())
    if fail:
        raise ConfigError("a broken config")
    started()
    print("started", gc.isenabled(), gc.get_freeze_count() > 0)
    return 0

for args in (["--fail"], []):
    try:
        cli.run(command, "t", args)
    except SystemExit as exc:
        print("exit", exc.code, gc.isenabled())
"""


def test_a_start_up_runs_without_the_collector_and_leaves_it_on() -> None:
    """A worker's and the sweeper's start-up run with the cyclic garbage collector off;
    it is on again once they have started, or once their command failed before."""
    out = run_python(START_UP)
    assert out.stdout.split("\n")[:-1] == [
        "starting False",
        "exit 2 True",
        "starting False",
        "started True True",
        "exit 0 True",
    ], out.stderr


def test_sigterm_releases_a_call_that_outlives_the_grace(
    db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    never = tmp_path / "never-created"  # the call lasts until the worker gives it up
    (task_id,) = enqueue(
        queue, "codex", {"simulate": {"sim/a": {"wait_for": str(never)}}}, models=("sim/a",)
    )
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--grace", "0.3", "--log-json")
    wait_until(lambda: Path(f"{never}.waiting").exists())  # the call is running
    proc.signal(signal.SIGTERM)
    assert proc.wait(timeout=15) == 0
    task = queue.get(task_id)
    assert (task.status, task.attempts) == ("queued", 0)
    assert reads.task_events(queue.db, task_id)[-1]["reason"] == "shutdown"
    assert "task_released" in [e["event"] for e in proc.events()]


def test_retryable_error_spends_an_attempt_then_fails(
    db_url: str, queue: TaskQueue, spawn: Spawn
) -> None:
    (task_id,) = enqueue(queue, "codex", {"simulate": {"sim/a": "error"}}, models=("sim/a",))
    env = {"AGENTBUS_RETRY_BACKOFF_SEC": "0.01", "AGENTBUS_CALL_RETRY_WAIT_SEC": "0.01"}
    for attempt in (1, 2, 3):
        proc = spawn("worker", "--agent", "codex", "--db", db_url, "--max-tasks", "1", env=env)
        assert proc.wait() == 0
        assert queue.get(task_id).attempts == attempt
    task = queue.get(task_id)
    assert task.status == "failed"
    assert task.last_error == "attempts exhausted (3/3): simulated error from sim/a"


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"payload": {"simulate": ["nope"]}}, "payload.simulate must be an object"),
        ({"payload": {"simulate": {"sim/a": "melt"}}}, "unknown behaviour 'melt'"),
        ({"models": ("gpt-unknown",)}, "unknown model 'gpt-unknown'"),
        ({"models": None, "role": "writer"}, "unknown role 'writer'"),
    ],
)
def test_tasks_the_worker_cannot_run_fail_with_a_reason(
    db_url: str, queue: TaskQueue, spawn: Spawn, spec: dict[str, object], reason: str
) -> None:
    fields = {"agent": "codex", "command": "x", "models": ("sim/a",), **spec}
    task_id = queue.enqueue(TaskSpec(**fields)).id  # type: ignore[arg-type]
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert proc.wait() == 0, proc.text()
    task = queue.get(task_id)
    assert task.status == "failed"
    assert reason in (task.last_error or "")
    assert "Traceback" not in proc.text()


@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (["--agent", "codex", "--lease", "-1"], "Invalid value for '--lease'", 2),
        (["--agent", "bad name"], "invalid agent name", 2),
        (["--agent", "codex", "--db", "postgresql://u:hunter2@127.0.0.1:1/x"], "cannot connect", 3),
        (["--agent", "codex", "--bogus"], "No such option", 2),
        (["--agent", "codex", "--concurrency", "0"], "Invalid value for '--concurrency'", 2),
        (["--agent", "codex", "--concurrency", "4", "--batch", "2"], "cannot both be above 1", 2),
    ],
)
def test_worker_bad_input_is_one_line(
    spawn: Spawn, args: list[str], message: str, status: int
) -> None:
    proc = spawn("worker", *args)
    assert proc.wait() == status  # 2 bad input; 3 the database is away (retry later)
    lines = proc.text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("worker: error: ") and message in lines[0]
    assert "hunter2" not in lines[0]


def test_worker_refuses_an_unknown_agent_and_an_unmigrated_db(
    spawn: Spawn, tmp_path: Path, empty_db_url: str
) -> None:
    config = tmp_path / "agentbus.toml"
    config.write_text('[agents.codex]\nmodels = ["sim/a"]\n')
    proc = spawn("worker", "--agent", "ron", "--config", str(config), "--db", empty_db_url)
    assert proc.wait() == 2 and "unknown agent 'ron'" in proc.text()
    proc = spawn("worker", "--agent", "codex", "--db", empty_db_url)
    assert proc.wait() == 3 and "run `busctl migrate`" in proc.text()


# Postgres refuses invalid json itself: there the malformed payload is a JSON string.
MALFORMED = {
    "not-json": {
        "sqlite": ("not json at all", "the payload is not valid JSON"),
        "postgresql": ('"just text"', "the payload is a JSON str, not a JSON object"),
    },
    "array": {"sqlite": ("[1, 2]", "the payload is a JSON list, not a JSON object")},
}


@pytest.mark.parametrize(
    ("case", "models", "reason"),
    [
        ("not-json", '["sim/a"]', None),
        ("array", '["sim/a"]', None),
        ("{}", '"sim/a"', "the model chain is not a JSON list"),
    ],
)
def test_malformed_rows_written_by_hand_fail_their_task_not_the_worker(
    db_url: str, queue: TaskQueue, spawn: Spawn, case: str, models: str, reason: str | None
) -> None:
    db = queue.db
    variants = MALFORMED.get(case, {})
    payload, expected = variants.get(db.dialect, variants.get("sqlite", (case, reason)))
    with db.engine.begin() as conn:
        cast = "CAST(:p AS json)" if db.dialect == "postgresql" else ":p"
        mcast = "CAST(:m AS json)" if db.dialect == "postgresql" else ":m"
        conn.execute(
            sa.text(
                "INSERT INTO bus_commands (agent, command, status, payload, models, created_at, "
                f"updated_at) VALUES ('codex', 'hand-written', 'queued', {cast}, {mcast}, 0, 0)"
            ),
            {"p": payload, "m": models},
        )
    good = enqueue(queue, "codex", {}, models=("sim/a",))[0]
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert proc.wait() == 0, proc.text()
    (bad,) = [t for t in reads.list_tasks(db) if t.command == "hand-written"]
    assert bad.status == "failed" and str(expected) in (bad.last_error or "")
    assert queue.get(good).status == "done"
    assert "Traceback" not in proc.text()


def test_batch_claims_are_acknowledged_together_and_released_on_sigterm(
    db_url: str, queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    gate = tmp_path / "gate"  # every call lasts until the test opens the gate
    held = {"simulate": {"sim/a": {"wait_for": str(gate)}}}
    ids = enqueue(queue, "codex", held, n=8, models=("sim/a",))
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--batch", "4", "--log-json")
    wait_until(lambda: Path(f"{gate}.waiting").exists())  # the batch's first call runs
    assert sum(queue.get(i).status == "claimed" for i in ids) == 4
    proc.signal(signal.SIGTERM)
    wait_until(lambda: "shutdown_requested" in proc.text())
    gate.touch()  # the running call finishes within the grace period
    assert proc.wait() == 0, proc.text()
    statuses = Counter(queue.get(i).status for i in ids)
    assert statuses == {"done": 1, "queued": 7}  # nothing lost: the batch's rest went back
    released = [e for i in ids for e in reads.task_events(queue.db, i) if e["reason"] == "shutdown"]
    assert len(released) == 3
    rest = spawn("worker", "--agent", "codex", "--db", db_url, "--batch", "4", "--drain")
    assert rest.wait() == 0
    assert all(queue.get(i).status == "done" for i in ids)
