"""A task row written by hand so that no worker can run it: shown flagged, counted
in /metrics, never a traceback or a 503; the sweeper fails it with the reason and an
ops_todo, once; a worker that claims one fails it with the reason."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from agentbus.admin import serve, status
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import ops_todos
from agentbus.sweeper import jobs
from agentbus.sweeper.service import run_once
from tests.support import Proc

#: What each database lets an operator write into a paused task's resume_after.
BAD_RESUME = {
    "sqlite": ("'tomorrow'", "resume_after is not a finite number"),
    "postgresql": ("'NaN'", "resume_after is not a finite number"),
}


def paused_by_hand(db: Database, queue: TaskQueue) -> int:
    """A paused task whose resume_after an operator set by hand to a non-number."""
    task_id = queue.enqueue(TaskSpec(agent="codex", command="t", models=("sim/a",))).id
    (claim,) = queue.claim("codex", "w1", 60)
    queue.pause(task_id, claim.claim_token, queue.clock() + 60, "rate_limited", model="sim/a")
    value, _ = BAD_RESUME[db.dialect]
    db.write(
        lambda conn: conn.execute(
            sa.text(f"UPDATE bus_commands SET resume_after = {value} WHERE id = :i"), {"i": task_id}
        )
    )
    return task_id


@pytest.fixture
def served(db: Database) -> Iterator[str]:
    settings = Settings()
    server = serve.make_server(
        "127.0.0.1", 0, lambda kpis: status.snapshot(db, settings, kpis=kpis)
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def malformed_gauge(base: str) -> dict[str, float]:
    answer = httpx.get(f"{base}/metrics", timeout=10)
    assert answer.status_code == 200, answer.text
    (family,) = [
        f
        for f in text_string_to_metric_families(answer.text)
        if f.name == "agentbus_malformed_rows"
    ]
    return {s.labels["table"]: s.value for s in family.samples}


def test_a_paused_task_with_no_usable_resume_time(
    db: Database, queue: TaskQueue, db_url: str, served: str, run_busctl: Callable[..., Any]
) -> None:
    task_id = paused_by_hand(db, queue)
    _, why = BAD_RESUME[db.dialect]
    for args in (["status"], ["tasks"], ["show", str(task_id)], ["kpi"], ["status", "--json"]):
        done = run_busctl("--db", db_url, *args)
        assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert f"malformed: {why}" in run_busctl("--db", db_url, "show", str(task_id)).stdout
    assert f"[malformed: {why}]" in run_busctl("--db", db_url, "tasks").stdout
    assert httpx.get(f"{served}/workspace/status", timeout=10).status_code == 200
    assert malformed_gauge(served)["bus_commands"] == 0  # the sweeper's to find, once a pass

    sweep = jobs.Sweep(db, LiveConfig.fixed(Settings()))
    first = run_once(sweep)
    assert first["failed_jobs"] == 0 and first["malformed_failed"] == 1
    task = queue.get(task_id)
    assert task.status == "failed" and task.last_error == f"malformed: {why}"
    todos = db.read(lambda conn: conn.execute(sa.select(ops_todos)).mappings().all())
    assert [(t["kind"], t["task_id"]) for t in todos] == [("malformed", task_id)]
    last = reads.task_events(db, task_id)[-1]
    assert (last["from_status"], last["to_status"], last["reason"]) == (
        "paused",
        "failed",
        "malformed",
    )
    assert why in run_busctl("--db", db_url, "status").stdout
    doc = status.snapshot(db, Settings())
    assert doc["malformed"]["counts"]["bus_commands"] == 1
    assert doc["malformed"]["rows"][0] == {
        "table": "bus_commands",
        "key": task_id,
        "problem": why,
        "status": "failed",
        "agent": "codex",
    }
    assert malformed_gauge(served)["bus_commands"] == 1
    assert run_once(sweep)["malformed_failed"] == 0  # once: an ended task is not looked at again
    assert malformed_gauge(served)["bus_commands"] == 1  # until an operator resolves the todo
    db.write(lambda conn: conn.execute(sa.update(ops_todos).values(resolved_at=1.0)))
    assert malformed_gauge(served)["bus_commands"] == 0


#: A queued task's column set by hand to what no worker can use, and the reason it fails
#: with: SQLite keeps text in an INTEGER column; PostgreSQL keeps any JSON in a JSON one.
BAD_QUEUED = {
    "sqlite": ("priority", "'high'", "malformed: priority is not a whole number ('high')"),
    "postgresql": ("models", """'{"a": 1}'""", "the model chain is not a JSON list of model ids"),
}


def test_the_worker_fails_a_task_whose_row_it_cannot_use(
    db: Database, db_url: str, spawn: Callable[..., Proc]
) -> None:
    """The worker claims such a row and fails it with the reason, then runs the rest."""
    queue = TaskQueue(db)  # the database's clock: the worker's
    column, value, why = BAD_QUEUED[db.dialect]
    bad = queue.enqueue(TaskSpec(agent="codex", command="bad", models=("sim/a",))).id
    good = queue.enqueue(TaskSpec(agent="codex", command="good", models=("sim/a",))).id
    db.write(
        lambda conn: conn.execute(
            sa.text(f"UPDATE bus_commands SET {column} = {value} WHERE id = :i"), {"i": bad}
        )
    )
    proc = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert proc.wait() == 0, proc.text()
    failed = queue.get(bad)
    assert failed.status == "failed"
    assert failed.last_error == why
    assert queue.get(good).status == "done"
    assert "Traceback" not in proc.text()
    assert proc.text().count("task_failed") == 1
