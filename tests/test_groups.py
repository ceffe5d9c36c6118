"""Groups: the tasks of one group (a conversation) run at most the agent's
``group_concurrency`` at once, in enqueue order. The claim with an injected clock on
SQLite, PostgreSQL and PgBouncer; real workers with slots; the config's refusals."""

from __future__ import annotations

import itertools
import signal
import subprocess
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.catalog import parse_catalog
from agentbus.db import Database
from agentbus.errors import ConfigError, InvalidTask
from agentbus.queue import TaskQueue
from agentbus.queue.groups import ANY, GroupRule
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands, task_events
from tests.support import FakeClock, Proc, wait_until

Spawn = Callable[..., Proc]
Busctl = Callable[..., subprocess.CompletedProcess[str]]
ONE = GroupRule(1)


def enqueue(queue: TaskQueue, group: str | None, **more: object) -> int:
    spec = TaskSpec(agent="codex", command="x", models=("sim/a",), group=group, **more)  # type: ignore[arg-type]
    return queue.enqueue(spec).id


def claim(queue: TaskQueue, rule: GroupRule | None = ONE, limit: int = 10) -> list[int]:
    return sorted(t.id for t in queue.claim("codex", "w", 30, limit=limit, groups=rule))


def done(queue: TaskQueue, task_id: int) -> None:
    queue.complete(task_id, queue.get(task_id).claim_token, "ok")


def test_one_at_a_time_in_enqueue_order_whatever_the_priority(
    queue: TaskQueue, clock: FakeClock
) -> None:
    a1, a2 = enqueue(queue, "a"), enqueue(queue, "a")
    a3 = enqueue(queue, "a", priority=9)  # a later turn: priority does not put it first
    b1, loose = enqueue(queue, "b"), enqueue(queue, None)
    assert queue.has_due("codex", groups=ONE)
    assert claim(queue) == [a1, b1, loose]
    assert claim(queue) == []  # every group has its turn running
    assert not queue.has_due("codex", groups=ONE)  # an idle worker sees nothing to claim
    assert queue.due_in("codex", groups=ONE) is None
    done(queue, a1)
    assert claim(queue) == [a2]
    # A paused turn keeps its group's turn: the next one waits for it.
    queue.pause(a2, queue.get(a2).claim_token, clock.now + 60, "cooling", model="sim/a")
    assert claim(queue) == []
    # ... unless the order is "any": then only the turns due now or running hold one.
    assert claim(queue, GroupRule(1, ANY)) == [a3]
    # Without the rule (an agent with no group_concurrency), groups do not hold back.
    assert claim(queue, None) == []  # a3's group-mates are paused or running


def test_a_retrying_turn_keeps_the_turn_and_an_ended_one_frees_it(
    queue: TaskQueue, clock: FakeClock
) -> None:
    first, second = enqueue(queue, "g"), enqueue(queue, "g")
    assert claim(queue) == [first]
    queue.requeue(first, queue.get(first).claim_token, clock.now + 30, "503")
    assert claim(queue) == []  # first waits for its retry and keeps the turn
    assert claim(queue, GroupRule(1, ANY)) == [second]  # "any": a waiting retry does not
    clock.advance(31)
    assert claim(queue, GroupRule(1, ANY)) == []  # first is due: second runs, one at a time
    queue.fail(second, queue.get(second).claim_token, "bad")
    assert claim(queue, GroupRule(1, ANY)) == [first]


def test_n_at_a_time(queue: TaskQueue) -> None:
    turns = [enqueue(queue, "g") for _ in range(5)]
    two = GroupRule(2)
    assert claim(queue, two) == turns[:2]
    done(queue, turns[1])
    assert claim(queue, two) == [turns[2]]
    assert claim(queue, two) == []


def test_the_group_is_checked_at_enqueue_and_stored(queue: TaskQueue) -> None:
    task_id = enqueue(queue, "conversation-42")
    many = queue.enqueue_many(
        [TaskSpec(agent="codex", command="x", models=("sim/a",), group=g) for g in ("a", None)]
    )
    assert [queue.get(i).group_key for i in (task_id, *many)] == ["conversation-42", "a", None]
    for bad, message in (
        (7, "the group must be a string"),
        ("", "the group must be a string"),
        ("x" * 256, "1 to 255 characters"),
        ("a\x00b", "NUL"),
    ):
        with pytest.raises(InvalidTask, match=message):
            enqueue(queue, bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"group_concurrency": 0}, "group_concurrency must be a whole number of at least 1"),
        ({"group_concurrency": -2}, "group_concurrency must be a whole number of at least 1"),
        ({"group_concurrency": 1.5}, "group_concurrency must be a whole number"),
        ({"group_concurrency": 1, "group_order": "fifo"}, "group_order must be 'enqueue' or 'any'"),
    ],
)
def test_a_bad_group_setting_is_refused(body: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_catalog({"agents": {"codex": {"models": ["sim/a"], **body}}})


def test_an_agent_s_rule_from_its_config() -> None:
    catalog = parse_catalog(
        {"agents": {"codex": {"models": ["sim/a"], "group_concurrency": 2, "group_order": "any"}}}
    )
    assert GroupRule.of(catalog.agents["codex"]) == GroupRule(2, ANY)
    assert GroupRule.of(parse_catalog({"agents": {"w": {"models": ["sim/a"]}}}).agents["w"]) is None


GROUPED = """
[agents.codex]
models = ["sim/a"]
group_concurrency = 1
"""


def _turns(db: Database) -> dict[str, list[tuple[int, int, int]]]:
    """Per group, each turn's (task id, its claim's event id, its end's event id)."""
    t, e = bus_commands, task_events
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(t.c.group_key, t.c.id, e.c.id, e.c.to_status)
            .join(e, e.c.task_id == t.c.id)
            .where(e.c.to_status.in_(["claimed", "done"]))
            .order_by(e.c.id)
        ).all()
    )
    claimed: dict[int, int] = {}
    turns: dict[str, list[tuple[int, int, int]]] = defaultdict(list)
    for group, task_id, event_id, status in rows:
        if status == "claimed":
            claimed[task_id] = event_id
        else:
            turns[group].append((task_id, claimed.pop(task_id), event_id))
    return turns


@pytest.mark.process
def test_four_workers_of_four_slots_run_each_conversation_in_order_one_turn_at_a_time(
    db_url: str, spawn: Spawn, tmp_path: Path
) -> None:
    """50 groups of 10 turns, enqueued group by group (a claim in enqueue order meets
    the later turns of the groups running first), run by 4 workers with 4 slots each
    until every task is done: by the event log, no turn is claimed before the one
    before it in its group is done, and every group ran in enqueue order. (Without
    group_concurrency the same run has a group's turns side by side.)"""
    config = tmp_path / "agentbus.toml"
    config.write_text(GROUPED)
    db = Database(db_url)
    queue = TaskQueue(db)
    latency = {"simulate": {"sim/a": {"behaviour": "ok", "latency_ms": 20}}}
    specs = [
        TaskSpec(agent="codex", command=f"g{g} turn {k}", group=f"g{g}", payload=latency)
        for g in range(50)
        for k in range(10)
    ]
    ids = queue.enqueue_many(specs)
    args = ("--agent", "codex", "--db", db_url, "--config", str(config), "--concurrency", "4")
    workers = [spawn("worker", *args, "--poll", "0.2") for _ in range(4)]
    done = sa.select(sa.func.count()).where(bus_commands.c.status == "done")
    try:
        wait_until(
            lambda: db.read(lambda conn: conn.execute(done).scalar()) == len(ids), timeout=240
        )
    finally:
        for worker in workers:
            worker.signal(signal.SIGTERM)
        for worker in workers:
            assert worker.wait(60) == 0, worker.text()
    turns = _turns(db)
    assert sorted(turns) == sorted(f"g{g}" for g in range(50))
    for group, ran in turns.items():
        assert len(ran) == 10, group
        assert [task for task, _, _ in ran] == sorted(task for task, _, _ in ran), group
        for (_, _, ended), (_, next_claimed, _) in itertools.pairwise(ran):
            assert next_claimed > ended, group  # the next turn began after this one ended
    db.dispose()


def test_status_metrics_and_render_show_the_groups(db: Database, queue: TaskQueue) -> None:
    from agentbus.admin import render, serve, status
    from agentbus.config import Settings

    for group in ("a", "a", "b"):
        enqueue(queue, group)
    enqueue(queue, None)
    claim(queue)
    doc = status.snapshot(db, Settings(), kpis=False)
    assert doc["groups"] == {"codex": {"groups": 2, "queued": 1, "claimed": 2, "paused": 0}}
    assert "groups of codex: 2 with unfinished tasks; 2 running, 1 queued, 0 paused" in (
        render.status(doc, Settings())
    )
    families = {m.name: m for m in serve.SnapshotCollector(lambda _k: doc, lambda: []).collect()}
    samples = {tuple(s.labels.values()): s.value for s in families["agentbus_group_tasks"].samples}
    assert samples == {("codex", "queued"): 1, ("codex", "claimed"): 2, ("codex", "paused"): 0}
    (active,) = families["agentbus_groups_active"].samples
    assert (active.labels, active.value) == ({"agent": "codex"}, 2)
