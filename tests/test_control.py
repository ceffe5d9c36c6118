"""Operators steer tasks (cancel, resume, cooldowns clear) and busctl's exit statuses."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.admission.cooldowns import CooldownStore
from agentbus.db import Database
from agentbus.errors import TransitionRejected
from agentbus.queue import TaskQueue, reads
from agentbus.queue.decisions import Complete, Settlement
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_events, route_log
from tests.support import FakeClock

Busctl = Callable[..., subprocess.CompletedProcess[str]]


def spec(agent: str = "codex", **more: object) -> TaskSpec:
    return TaskSpec(agent=agent, command="x", models=("sim/a",), **more)  # type: ignore[arg-type]


def paused_task(queue: TaskQueue, clock: FakeClock, agent: str = "codex") -> int:
    task_id = queue.enqueue(spec(agent)).id
    (task,) = queue.claim(agent, "w", 30)
    queue.pause(task.id, task.claim_token, clock.now + 600, "cooldown")
    return task_id


def test_cancel_takes_queued_paused_and_claimed_tasks_and_names_who(
    queue: TaskQueue, clock: FakeClock
) -> None:
    waiting = queue.enqueue(spec()).id
    paused = paused_task(queue, clock, "ron")
    running = queue.enqueue(spec("analyst")).id
    (claim,) = queue.claim("analyst", "w1", 30)
    done = queue.enqueue(spec("writer")).id
    (finished,) = queue.claim("writer", "w1", 30)
    queue.complete(finished.id, finished.claim_token, "the answer")
    moved = queue.cancel([waiting, paused, running, done], by="ops")
    assert moved == sorted([waiting, paused, running])
    assert queue.get(done).status == "done"  # settled: nothing to cancel
    for task_id in moved:
        task = queue.get(task_id)
        assert task.status == "cancelled" and task.result_note == "cancelled by ops"
        last = reads.task_events(queue.db, task_id)[-1]
        assert (last["to_status"], last["reason"], last["worker"]) == ("cancelled", "cancel", "ops")
    # The worker of the claimed task: its completion and its lease renewal land nowhere.
    lost = queue.settle(
        [Settlement(claim.id, claim.claim_token, Complete("late", "sim/a"))], worker="w1"
    )
    assert [r.task_id for r in lost] == [running] and "cancelled" in lost[0].message
    with pytest.raises(TransitionRejected):
        queue.heartbeat(running, claim.claim_token, 30)
    assert queue.claim("codex", "w2", 30) == []  # a cancelled task is never claimed
    assert queue.cancel([waiting], by="ops") == []  # already cancelled: nothing moves
    queue.retry(waiting, by="ops")  # an operator may put it back
    assert queue.get(waiting).status == "queued"


def test_busctl_cancel_resume_retry_and_their_exit_statuses(
    db_url: str, run_busctl: Busctl, clock: FakeClock
) -> None:
    db = Database(db_url)
    queue = TaskQueue(db, clock=clock)
    first, second = queue.enqueue(spec()).id, queue.enqueue(spec()).id
    paused = paused_task(queue, clock, "ron")
    other = queue.enqueue(spec("analyst")).id

    out = run_busctl("--db", db_url, "cancel", str(first))
    assert (out.returncode, out.stdout.strip()) == (0, "cancelled 1 task"), out.stderr
    last = reads.task_events(db, first)[-1]
    assert last["reason"] == "cancel" and last["worker"].startswith("busctl:")
    again = run_busctl("--db", db_url, "cancel", str(first), str(second))
    assert again.returncode == 1 and "not cancelled: " + str(first) in again.stderr
    assert queue.get(second).status == "cancelled"  # the one that could, did
    missing = run_busctl("--db", db_url, "cancel", str(other), "999999")
    assert missing.returncode == 4 and "no task 999999" in missing.stderr
    assert queue.get(other).status == "queued"  # nothing changed
    by_agent = run_busctl("--db", db_url, "cancel", "--agent", "analyst", "--status", "queued")
    assert (by_agent.returncode, by_agent.stdout.strip()) == (0, "cancelled 1 task")
    usage = run_busctl("--db", db_url, "cancel")
    assert usage.returncode == 2 and len(usage.stderr.strip().splitlines()) == 1

    resumed = run_busctl("--db", db_url, "resume", str(paused))
    assert (resumed.returncode, resumed.stdout.strip()) == (0, "resumed 1 task"), resumed.stderr
    task = queue.get(paused)
    assert (task.status, task.resume_after) == ("queued", None)
    last = reads.task_events(db, paused)[-1]
    assert (last["from_status"], last["reason"]) == ("paused", "resume")
    assert last["worker"].startswith("busctl:")
    assert run_busctl("--db", db_url, "resume", str(paused)).returncode == 1  # not paused

    assert run_busctl("--db", db_url, "retry", str(first)).returncode == 0
    assert queue.get(first).status == "queued"
    assert run_busctl("--db", db_url, "retry", str(first)).returncode == 1  # queued already
    assert run_busctl("--db", db_url, "retry", "999999").returncode == 4
    assert run_busctl("--db", db_url, "show", "999999").returncode == 4
    db.dispose()


def test_busctl_cooldowns_clear_ends_a_cooldown_and_says_who(
    db_url: str, run_busctl: Busctl
) -> None:
    db = Database(db_url)
    store = CooldownStore(db)
    future = store.clock() + 600
    for key in ("sim/a", "sim/a@second", "sim/b"):
        store.set(key, future, reason="rate_limited", source="w1")
    one = run_busctl("--db", db_url, "cooldowns", "clear", "sim/a@second")
    assert (one.returncode, one.stdout.strip()) == (0, "cleared sim/a@second"), one.stderr
    both = run_busctl("--db", db_url, "cooldowns", "clear", "sim/a")
    assert (both.returncode, both.stdout.strip()) == (0, "cleared sim/a")
    assert run_busctl("--db", db_url, "cooldowns", "clear", "sim/a").returncode == 4
    assert set(CooldownStore(db, cache_sec=1e-9).cooling(["sim/a", "sim/b"])) == {"sim/b"}
    listed = json.loads(run_busctl("--db", db_url, "cooldowns", "--json").stdout)
    assert [r["model_id"] for r in listed] == ["sim/b"]
    cleared = db.read(
        lambda conn: conn.execute(
            sa.select(bus_events.c.source, bus_events.c.detail).where(
                bus_events.c.kind == "cooldown_cleared"
            )
        ).all()
    )
    assert sorted(d["model"] for _, d in cleared) == ["sim/a", "sim/a@second"]
    assert all(source.startswith("busctl:") for source, _ in cleared)
    # A worker's new 429 cools the model again, as before.
    assert store.set("sim/a", future, reason="rate_limited") == future
    db.dispose()


CONFIG = """
[agents.codex]
models = ["sim/a", "sim/b"]

[roles.writer]
models = ["sim/b"]
"""


def test_enqueue_is_checked_against_the_config_and_takes_the_agents_chain(
    db_url: str, run_busctl: Busctl, spawn: Callable[..., object], tmp_path: Path
) -> None:
    config = tmp_path / "agentbus.toml"
    config.write_text(CONFIG)
    db = Database(db_url)
    for args, message in [
        (["--agent", "nobody", "--models", "sim/a"], "unknown agent 'nobody'"),
        (["--agent", "codex", "--role", "nope"], "nope"),
        (["--agent", "codex", "--models", "gpt-9"], "gpt-9"),
    ]:
        out = run_busctl("--db", db_url, "--config", str(config), "enqueue", *args, "hi")
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], lines
    assert reads.counts(db) == {}
    chained = run_busctl(
        "--db", db_url, "--config", str(config), "enqueue", "--agent", "codex", "hi"
    )
    assert chained.returncode == 0, chained.stderr
    task_id = int(chained.stdout)
    assert TaskQueue(db).get(task_id).models is None  # its agent's chain, when it runs
    worker = spawn(  # type: ignore[operator]
        "worker", "--agent", "codex", "--db", db_url, "--config", str(config), "--drain"
    )
    assert worker.wait() == 0
    assert TaskQueue(db).get(task_id).status == "done"
    assert [r["model"] for r in reads.routes(db, task_id=task_id)] == ["sim/a"]
    # Without a config file nothing names the agent's chain: one line, nothing written.
    bare = run_busctl("--db", db_url, "enqueue", "--agent", "codex", "hi", cwd=tmp_path / "..")
    assert bare.returncode == 2 and "--models" in bare.stderr
    db.dispose()


def test_enqueue_reads_its_text_and_payload_from_stdin_and_files(
    db_url: str, run_busctl: Busctl, tmp_path: Path
) -> None:
    db = Database(db_url)
    payload = tmp_path / "p.json"
    payload.write_text('{"ticker": "KOSPI"}')
    base = ["--db", db_url, "enqueue", "--agent", "codex", "--models", "sim/a"]
    from_stdin = run_busctl(*base, "--payload", f"@{payload}", "-", input="a long\nbrief\n")
    assert from_stdin.returncode == 0, from_stdin.stderr
    task = TaskQueue(db).get(int(from_stdin.stdout))
    assert (task.command, task.payload) == ("a long\nbrief\n", {"ticker": "KOSPI"})
    piped = run_busctl(*base, "--payload", "-", "text", input='{"n": 1}')
    assert TaskQueue(db).get(int(piped.stdout)).payload == {"n": 1}
    gone = run_busctl(*base, "--payload", f"@{tmp_path / 'missing.json'}", "text")
    assert gone.returncode == 2 and "cannot read the payload file" in gone.stderr
    both = run_busctl(*base, "--payload", "-", "-", input="{}")
    assert both.returncode == 2
    assert len(reads.counts(db)) == 1 and sum(reads.counts(db).values()) == 2
    db.dispose()


def test_exit_statuses_say_retry_later_not_found_and_problem_found(
    db_url: str, run_busctl: Busctl, tmp_path: Path
) -> None:
    absent = run_busctl("--db", f"sqlite:///{tmp_path / 'none.db'}", "status")
    assert absent.returncode == 3 and "busctl migrate" in absent.stderr
    down = run_busctl("--db", "postgresql+psycopg://u:pw@127.0.0.1:1/x", "status")
    assert down.returncode == 3 and "pw" not in down.stderr
    assert run_busctl("--db", db_url, "kpi").returncode == 0  # nothing measured: no failure
    db = Database(db_url)
    with db.engine.begin() as conn:  # a skip no cooldown explains: KPI 3 below its target
        conn.execute(
            sa.insert(route_log).values(
                task_id=1, claim_token=1, agent="codex", model="sim/a", decision="skip", at=1.0
            )
        )
    failing = run_busctl("--db", db_url, "kpi")
    assert failing.returncode == 1 and "cooldown consistency" in failing.stderr
    assert "Exit status: 0 ok; 1" in run_busctl("cancel", "--help").stdout
    db.dispose()
