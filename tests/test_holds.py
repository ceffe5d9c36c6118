"""Holds on agents' queues (``busctl agents pause``): no claim of a held agent's
tasks, the idle look sees none, who and why in the events and the status; real
workers and busctl on SQLite, PostgreSQL and PgBouncer."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.admin import render, status
from agentbus.admission import workspace_events
from agentbus.config import Settings
from agentbus.db import Database
from agentbus.errors import BusError, UnknownAgent
from agentbus.queue import TaskQueue, holds
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import agent_holds, bus_events
from tests.support import FakeClock, Proc, wait_until

Spawn = Callable[..., Proc]
Busctl = Callable[..., subprocess.CompletedProcess[str]]


def enqueue(queue: TaskQueue, agent: str, **more: object) -> int:
    spec = TaskSpec(agent=agent, command="x", models=("sim/a",), **more)  # type: ignore[arg-type]
    return queue.enqueue(spec).id


def rows(db: Database, table: sa.Table) -> list[dict[str, object]]:
    return db.read(lambda conn: [dict(r._mapping) for r in conn.execute(sa.select(table))])


def test_no_claim_takes_a_held_agent_s_task_until_the_hold_is_lifted(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    held, other = enqueue(queue, "codex"), enqueue(queue, "writer")
    assert holds.hold(db, "codex", "model misbehaves", "ops", clock.now)
    assert not holds.hold(db, "codex", "again", "someone", clock.now + 1)  # left as it was
    assert queue.claim("codex", "w1", 30) == []
    assert queue.claim("codex", "w1", 30, limit=10) == []
    assert not queue.has_due("codex")  # an idle worker's look sees nothing either
    assert [t.id for t in queue.claim("writer", "w2", 30)] == [other]  # others go on
    assert queue.get(held).status == "queued"  # not the task state paused
    (row,) = rows(db, agent_holds)
    assert row == {
        "agent": "codex",
        "reason": "model misbehaves",
        "held_by": "ops",
        "held_at": clock.now,
    }
    assert holds.lift(db, "codex", "ops2", clock.now + 5)
    assert not holds.lift(db, "codex", "ops2", clock.now + 6)
    assert queue.has_due("codex")
    assert [t.id for t in queue.claim("codex", "w1", 30)] == [held]
    kinds = [(e["kind"], e["source"], e["detail"]) for e in workspace_events.recent(db)]
    assert kinds == [
        ("agent_held", "ops", {"agent": "codex", "reason": "model misbehaves"}),
        ("agent_hold_lifted", "ops2", {"agent": "codex"}),
    ]


def test_an_unknown_agent_or_a_bad_reason_is_refused_and_nothing_written(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    for name in ("ghost", "bad name", "", 7):
        with pytest.raises(UnknownAgent):
            holds.hold(db, name, None, "ops", clock.now)  # type: ignore[arg-type]
        with pytest.raises(UnknownAgent):
            holds.lift(db, name, "ops", clock.now)  # type: ignore[arg-type]
    with pytest.raises(BusError, match="at most 500 characters"):
        holds.hold(db, "codex", "x" * 501, "ops", clock.now, configured={"codex"})
    assert rows(db, agent_holds) == [] and rows(db, bus_events) == []
    # Named by the config alone: known. A secret in the reason
    # is masked, and the reason kept on one line.
    assert holds.hold(db, "codex", "key sk-abcdefghijklmnop1234\nleaked", "ops", 1.0, {"codex"})
    (row,) = rows(db, agent_holds)
    assert row["reason"] == "key sk-*** leaked"


def test_status_metrics_and_render_show_who_holds_an_agent_and_why(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    from prometheus_client.core import Metric

    from agentbus.admin import serve

    enqueue(queue, "codex")
    holds.hold(db, "codex", "bad answers", "busctl:ops@host", clock.now)
    doc = status.snapshot(db, Settings(), clock.now, kpis=False)
    assert doc["holds"] == [
        {
            "agent": "codex",
            "reason": "bad answers",
            "held_by": "busctl:ops@host",
            "held_at": clock.now,
        }
    ]
    text = render.status(doc, Settings())
    assert "agent codex on hold since" in text and "by busctl:ops@host: bad answers" in text
    collector = serve.SnapshotCollector(lambda _kpis: doc, lambda: [])
    families: list[Metric] = list(collector.collect())
    (held,) = [m for m in families if m.name == "agentbus_agent_on_hold"]
    assert [(s.labels, s.value) for s in held.samples] == [({"agent": "codex"}, 1)]


@pytest.mark.process
def test_busctl_holds_an_agent_and_its_workers_claim_nothing_until_resumed(
    db_url: str, spawn: Spawn, run_busctl: Busctl, tmp_path: Path
) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    gate = tmp_path / "go"
    running = enqueue(queue, "codex", payload={"simulate": {"sim/a": {"wait_for": str(gate)}}})
    worker = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    wait_until(lambda: Path(f"{gate}.waiting").exists(), timeout=60)  # its call is in flight
    base = ["--db", db_url]
    paused = run_busctl(*base, "agents", "pause", "codex", "--reason", "model misbehaves")
    assert paused.returncode == 0, paused.stderr
    assert paused.stdout.strip() == "codex: on hold; no worker claims its tasks"
    later = enqueue(queue, "codex")
    gate.touch()  # the running call finishes; the worker claims nothing more and drains
    assert worker.wait() == 0, worker.text()
    assert queue.get(running).status == "done"
    assert queue.get(later).status == "queued"
    listed = json.loads(run_busctl(*base, "agents", "--json").stdout)
    assert [(h["agent"], h["reason"]) for h in listed] == [("codex", "model misbehaves")]
    assert listed[0]["held_by"].startswith("busctl:")
    again = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert again.wait() == 0, again.text()
    assert queue.get(later).status == "queued"  # a worker started later claims nothing
    assert "agent_on_hold" in again.text() and "model misbehaves" in again.text()  # and says why
    resumed = run_busctl(*base, "agents", "resume", "codex")
    assert resumed.stdout.strip() == "codex: hold lifted; its workers claim again"
    last = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert last.wait() == 0, last.text()
    assert queue.get(later).status == "done"
    assert "agent_on_hold" not in last.text()
    assert run_busctl(*base, "agents").stdout.strip() == "no agent is on hold"
    # An agent no config, task or worker names: one line, exit 2, nothing written.
    unknown = run_busctl(*base, "agents", "pause", "ghost")
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        "busctl: error: unknown agent 'ghost': no config, task or worker names it"
    ]
    assert rows(db, agent_holds) == []
    db.dispose()
