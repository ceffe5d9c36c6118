"""Dependencies: a task enqueued ``after`` others waits until they have ended, then runs
with their results as its inputs; one that fails cancels it. The queue with an injected
clock, the sweeper's pass and real workers, on SQLite, PostgreSQL and PgBouncer."""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Connection

from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.errors import InvalidTask
from agentbus.queue import TaskQueue, reads
from agentbus.queue.decisions import Complete, Settlement
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import WAITING_DUE, bus_commands, task_dependencies, task_events
from agentbus.sweeper import jobs
from tests.support import FakeClock, Proc, wait_until

Spawn = Callable[..., Proc]
Busctl = Callable[..., subprocess.CompletedProcess[str]]


def enqueue(queue: TaskQueue, *after: int, agent: str = "codex", **more: object) -> int:
    spec = TaskSpec(agent=agent, command="x", models=("sim/a",), after=after, **more)  # type: ignore[arg-type]
    return queue.enqueue(spec).id


def claim(queue: TaskQueue, agent: str = "codex", limit: int = 10) -> list[int]:
    return sorted(t.id for t in queue.claim(agent, "w", 30, limit=limit))


def done(queue: TaskQueue, task_id: int, result: str = "ok") -> None:
    queue.complete(task_id, queue.get(task_id).claim_token, result)


def run(queue: TaskQueue, task_id: int, result: str = "ok") -> None:
    """Claim ``task_id`` (the only one due of its agent) and complete it."""
    agent = queue.get(task_id).agent
    assert claim(queue, agent, limit=1) == [task_id]
    done(queue, task_id, result)


def events_of(db: Database, task_id: int) -> list[tuple[str | None, str, str | None]]:
    return [(e["from_status"], e["to_status"], e["reason"]) for e in reads.task_events(db, task_id)]


def counted(db: Database) -> dict[str, int]:
    out = {}
    for table in (bus_commands, task_events, task_dependencies):
        query = sa.select(sa.func.count()).select_from(table)
        out[table.name] = db.read(lambda conn, q=query: conn.execute(q).scalar())
    awaited = sa.select(sa.func.count()).where(bus_commands.c.awaited)
    out["awaited"] = db.read(lambda conn: conn.execute(awaited).scalar())
    return out


def test_a_task_runs_once_every_task_it_waits_for_is_done_with_their_results(
    queue: TaskQueue, clock: FakeClock
) -> None:
    a, b = enqueue(queue, agent="research"), enqueue(queue, agent="research")
    summary = enqueue(queue, b, a)
    assert queue.get(summary).run_after == WAITING_DUE
    assert queue.get(summary).after_policy == "all_done"
    assert queue.waiting() == {"codex": 1}
    assert queue.dependencies_of(summary) == [b, a]
    assert claim(queue) == [] and not queue.has_due("codex")
    assert claim(queue, "research", limit=1) == [a]
    done(queue, a, "from a")
    assert claim(queue) == []
    clock.advance(5)
    assert claim(queue, "research") == [b]
    done(queue, b, "from b")
    assert queue.get(summary).run_after == clock.now  # due at the moment the last one ended
    assert queue.has_due("codex") and queue.waiting() == {}
    (task,) = queue.claim("codex", "w", 30)
    assert task.id == summary
    assert task.payload["inputs"] == [  # in the order given
        {"task": b, "status": "done", "result": "from b"},
        {"task": a, "status": "done", "result": "from a"},
    ]
    assert "inputs" not in queue.get(summary).payload  # the stored payload is as enqueued


def test_fan_in_of_a_hundred(queue: TaskQueue) -> None:
    parts = [enqueue(queue, agent="research") for _ in range(100)]
    summary = enqueue(queue, *parts)
    claimed = claim(queue, "research", limit=100)
    assert claimed == parts
    for part in parts[:-1]:
        done(queue, part, f"part {part}")
    assert claim(queue) == []
    done(queue, parts[-1], "last")
    (task,) = queue.claim("codex", "w", 30)
    assert task.id == summary
    assert [i["task"] for i in task.payload["inputs"]] == parts
    assert task.payload["inputs"][-1]["result"] == "last"


def enqueue_chain(db: Database, queue: TaskQueue, length: int) -> list[int]:
    """A chain of ``length`` tasks, each after the one before, in one transaction."""

    def work(conn: Connection) -> list[int]:
        chain: list[int] = []
        for _ in range(length):
            spec = TaskSpec(agent="codex", command="x", models=("sim/a",), after=tuple(chain[-1:]))
            chain.append(queue.enqueue_on(conn, [spec])[0].id)
        return chain

    return db.write(work)


# Not through the pooler as well: the release is the server's (a trigger), and the
# pooled path is the one the process test below takes (20 s more for nothing new).
@pytest.mark.parametrize("backend", ["sqlite", "postgresql"])
def test_a_chain_of_a_thousand_runs_in_order(db: Database, queue: TaskQueue) -> None:
    chain = enqueue_chain(db, queue, 1000)
    assert queue.waiting() == {"codex": 999}
    acks: list[Settlement] = []
    for n, task_id in enumerate(chain):  # as a worker runs: acknowledge and claim at once
        lost, tasks = queue.settle_and_claim(acks, "codex", "w", 30, 10)
        if not tasks and acks:  # PostgreSQL: the claim in the ack's statement could not
            tasks = queue.claim("codex", "w", 30, 10)  # see what it freed (as a worker does)
        assert not lost and [t.id for t in tasks] == [task_id]  # only the next link is due
        if n:
            previous = {"task": chain[n - 1], "status": "done", "result": str(n - 1)}
            assert tasks[0].payload["inputs"] == [previous]
        acks = [Settlement(task_id, tasks[0].claim_token, Complete(str(n)))]
    assert queue.settle_and_claim(acks, "codex", "w", 30, 10) == ([], [])


def test_a_failed_dependency_cancels_the_chain_after_it_in_one_sweep(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    """A chain of 300 and a fork off it: the whole tree after the failure is cancelled by
    one pass, each naming the task it waited for (the chain of 1,000 above runs through
    the same release; a cancel's cascade is the same step at any depth)."""
    chain = enqueue_chain(db, queue, 300)
    head = chain[0]
    tolerant = enqueue(queue, chain[150], after_policy="any_end")
    fork = [enqueue(queue, chain[10]) for _ in range(3)]
    assert claim(queue) == [head]
    queue.fail(head, queue.get(head).claim_token, "bad input")
    counts = jobs.dependencies(jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock))
    assert counts == {"dependency_cancelled": 299 + 3}
    assert {queue.get(f).result_note for f in fork} == {
        f"dependency: task {chain[10]} ended cancelled"
    }
    second, last = queue.get(chain[1]), queue.get(chain[-1])
    assert (
        second.status == "cancelled"
        and second.result_note == f"dependency: task {head} ended failed"
    )
    assert last.result_note == f"dependency: task {chain[-2]} ended cancelled"
    assert events_of(db, chain[1])[-1] == ("queued", "cancelled", "dependency")
    # One that waits for any end runs when its dependency is cancelled.
    assert claim(queue) == [tolerant]
    assert queue.waiting() == {}


def test_any_end_runs_after_a_failure(queue: TaskQueue) -> None:
    a, b = enqueue(queue, agent="research"), enqueue(queue, agent="research")
    after = enqueue(queue, a, b, after_policy="any_end")
    claim(queue, "research")
    queue.fail(a, queue.get(a).claim_token, "no")
    assert claim(queue) == []
    done(queue, b, "yes")
    (task,) = queue.claim("codex", "w", 30)
    assert task.id == after
    assert [(i["status"], i["result"]) for i in task.payload["inputs"]] == [
        ("failed", None),
        ("done", "yes"),
    ]


def test_waiting_for_tasks_already_ended(db: Database, queue: TaskQueue, clock: FakeClock) -> None:
    ok, bad = enqueue(queue, agent="research"), enqueue(queue, agent="research")
    claim(queue, "research")
    done(queue, ok)
    queue.fail(bad, queue.get(bad).claim_token, "no")
    ready = enqueue(queue, ok)
    assert queue.get(ready).run_after == clock.now and claim(queue) == [ready]
    doomed = enqueue(queue, ok, bad)  # cancelled at once, in the enqueue's transaction
    task = queue.get(doomed)
    assert task.status == "cancelled" and task.result_note == f"dependency: task {bad} ended failed"
    assert [e[2] for e in events_of(db, doomed)] == ["enqueue", "dependency"]
    assert queue.get(enqueue(queue, bad, after_policy="any_end")).run_after == clock.now


@pytest.mark.parametrize(
    ("after", "more", "message"),
    [
        ((99_999,), {}, "after: task 99999 does not exist"),
        ((0,), {}, "after: 0 is not a task id"),
        ((True,), {}, "after: True is not a task id"),
        (("1",), {}, "after: '1' is not a task id"),
        ((-1,), {}, "is not a task id"),
        (("dup",), {}, "names a task twice"),
        (("known",), {"delay_sec": 5}, "give no run-after"),
        (("known",), {"after_policy": "some"}, "after_policy must be one of all_done, any_end"),
        (tuple(range(1, 1002)), {}, "more than 1000"),
    ],
)
def test_bad_dependencies_are_refused_and_nothing_is_written(
    db: Database, queue: TaskQueue, after: tuple[object, ...], more: dict[str, object], message: str
) -> None:
    known = enqueue(queue)
    given = {("known",): (known,), ("dup",): (known, known)}.get(after, after)
    before = counted(db)
    with pytest.raises(InvalidTask, match=message):
        enqueue(queue, *given, **more)  # type: ignore[arg-type]
    assert counted(db) == before


def test_the_sweeper_makes_due_a_waiter_no_trigger_released(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    dep = enqueue(queue)
    run(queue, dep)
    waiter = enqueue(queue)
    # Written by hand: a task that waits for one already done (as after a restore).
    db.write(
        lambda conn: (
            conn.execute(
                sa.update(bus_commands)
                .where(bus_commands.c.id == waiter)
                .values(run_after=WAITING_DUE, after_policy="all_done")
            ),
            conn.execute(
                sa.insert(task_dependencies), {"task_id": waiter, "position": 0, "after_id": dep}
            ),
        )
    )
    assert claim(queue) == []
    assert jobs.dependencies(jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)) == {
        "dependency_released": 1
    }
    assert claim(queue) == [waiter]


FLOWS = """
[agents.research]
models = ["sim/a"]

[agents.codex]
models = ["sim/a"]
"""


def _claimed_and_ended(db: Database) -> tuple[dict[int, int], dict[int, int]]:
    """Each task's (last) claim event id and its end's event id."""
    e = task_events
    rows = db.read(lambda conn: conn.execute(sa.select(e.c.task_id, e.c.id, e.c.to_status)).all())
    claimed = {task: event for task, event, to in rows if to == "claimed"}
    ended = {task: event for task, event, to in rows if to in ("done", "failed", "cancelled")}
    return claimed, ended


@pytest.mark.process
def test_workers_run_a_fan_in_and_a_chain_and_the_sweeper_cancels_what_a_failure_dooms(
    db_url: str, spawn: Spawn, tmp_path: Path
) -> None:
    """Three research tasks and a summary after them, a chain of 20 after the summary,
    one task after a research task that fails (and one that takes any end): real
    workers of two agents run each task only after what it waits for is done, the
    summary's model gets the three results; ``sweeper --once`` cancels the doomed one."""
    config = tmp_path / "agentbus.toml"
    config.write_text(FLOWS)
    db = Database(db_url)
    queue = TaskQueue(db)
    parts = [enqueue(queue, agent="research") for _ in range(3)]
    bad = queue.enqueue(
        TaskSpec(
            agent="research",
            command="x",
            models=("sim/a",),
            payload={"simulate": {"sim/a": "permanent"}},
        )
    ).id
    summary = enqueue(queue, *parts)
    chain = [summary]
    for _ in range(20):
        chain.append(enqueue(queue, chain[-1]))
    doomed = enqueue(queue, parts[0], bad)
    tolerant = enqueue(queue, parts[0], bad, after_policy="any_end")
    common = ("--db", db_url, "--config", str(config), "--poll", "0.5")
    workers = [
        spawn("worker", "--agent", "codex", *common),  # idle first: woken by the releases
        spawn("worker", "--agent", "research", "--concurrency", "3", *common),
    ]
    ends = sa.select(sa.func.count()).where(bus_commands.c.status.in_(["done", "failed"]))
    try:
        wait_until(lambda: db.read(lambda conn: conn.execute(ends).scalar()) == 26, timeout=90)
    finally:
        for worker in workers:
            worker.signal(signal.SIGTERM)
        for worker in workers:
            assert worker.wait(60) == 0, worker.text()
    assert queue.get(bad).status == "failed" and queue.get(tolerant).status == "done"
    assert queue.get(doomed).status == "queued"  # the sweeper's to cancel
    claimed, ended = _claimed_and_ended(db)
    assert all(claimed[summary] > ended[p] for p in parts)
    assert queue.get(summary).result == "[sim/a] done: x [3 inputs]"
    for before, after in itertools.pairwise(chain):
        assert claimed[after] > ended[before]
        assert queue.get(after).result == "[sim/a] done: x [1 inputs]"
    assert claimed[tolerant] > ended[bad]
    sweeper = spawn("sweeper", "--db", db_url, "--config", str(config), "--once")
    assert sweeper.wait(60) == 0, sweeper.text()
    cancelled = queue.get(doomed)
    assert cancelled.status == "cancelled"
    assert cancelled.result_note == f"dependency: task {bad} ended failed"
    assert doomed not in claimed
    db.dispose()


def test_busctl_enqueue_after_and_its_refusals(db_url: str, run_busctl: Busctl) -> None:
    db = Database(db_url)
    first = run_busctl("--db", db_url, "enqueue", "--agent", "codex", "--models", "sim/a", "one")
    assert first.returncode == 0, first.stderr
    dep = int(first.stdout)
    base = ("--db", db_url, "enqueue", "--agent", "codex", "--models", "sim/a")
    ok = run_busctl(*base, "--after", f"{dep}", "two")
    assert ok.returncode == 0, ok.stderr
    waiter = int(ok.stdout)
    shown = run_busctl("--db", db_url, "show", str(waiter))
    assert f"waits for: {dep}" in shown.stdout, shown.stdout
    before = counted(db)
    for bad, said in [
        (("--after", "99999"), "after: task 99999 does not exist"),
        (("--after", "1,x"), "--after: 'x' is not a task id"),
        (("--after", f"{dep}", "--run-after", "5"), "give no run-after"),
        (("--after", f"{dep}", "--after-policy", "some"), "Invalid value for '--after-policy'"),
    ]:
        refused = run_busctl(*base, *bad, "t")
        assert refused.returncode == 2, (bad, refused.stdout, refused.stderr)
        assert said in refused.stderr and "Traceback" not in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert counted(db) == before
    db.dispose()


def test_status_metrics_and_render_show_the_tasks_waiting_for_others(
    db: Database, queue: TaskQueue
) -> None:
    from agentbus.admin import render, serve, status

    dep = enqueue(queue, agent="research")
    enqueue(queue, dep), enqueue(queue, dep), enqueue(queue, dep, agent="writer")
    doc = status.snapshot(db, Settings(), kpis=False)
    assert doc["waiting"] == {"codex": 2, "writer": 1}
    assert doc["queue"]["codex"]["queued"] == 2  # still queued: waiting is not a state
    shown = render.status(doc, Settings())
    assert "waiting for other tasks (of the queued): codex 2, writer 1" in shown
    families = {m.name: m for m in serve.SnapshotCollector(lambda _k: doc, lambda: []).collect()}
    samples = families["agentbus_tasks_waiting_for_dependencies"].samples
    assert {s.labels["agent"]: s.value for s in samples} == {"codex": 2, "writer": 1}
    run(queue, dep)
    assert status.snapshot(db, Settings(), kpis=False)["waiting"] == {}


def test_retention_deletes_what_a_pruned_task_waited_for(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    from agentbus.queue import retention

    dep = enqueue(queue)
    waiter = enqueue(queue, dep)
    run(queue, dep)
    run(queue, waiter)
    assert counted(db)["task_dependencies"] == 1
    clock.advance(3600)
    assert retention.prune(db, clock.now, done_sec=60, failed_sec=60, batch=100) == 2
    assert counted(db)["task_dependencies"] == 0
