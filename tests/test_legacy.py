"""Adopting the older system's database: every legacy shape of ops_todos and
model_cooldown migrates, every sweeper job then works on it, the older tasks
outlive retention and can be retried, and a downgrade gives the tables back row
for row. On SQLite and PostgreSQL."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.migrations import downgrade, migrate
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import adopted_tables, model_cooldown, ops_todos
from agentbus.sweeper import jobs
from tests import legacy_db
from tests.legacy_db import LEGACY_TABLES, VARIANTS, Variant
from tests.support import FakeClock, clean_env

DAY = 86400.0

#: What each variant's rows become in agentbus's tables: (kind, task_id, agent, why)
#: and (model_id, cooldown_until, source).
TODOS = {
    "keyed": [
        ("demoted", 2, None, "id=1; note=paused too long; owner=ops"),
        ("review", 7, None, "id=3; note=crashed"),
    ],
    "unkeyed": [
        ("demoted", 4, None, "stuck"),
        ("demoted", None, None, "no task"),
        ("demoted", None, None, "no task"),
    ],
    "foreign": [
        ("legacy", None, None, "todo_id=10; title=rotate the keys; priority=1; done=False"),
        ("legacy", None, None, "todo_id=11; title=rotate the keys; priority=1; done=False"),
    ],
}
COOLDOWNS = {
    "keyed": [("sim/a", 1755400500.0, "legacy"), ("sim/b", 2000000000.0, "legacy")],
    "unkeyed": [("sim/a", 1900000000.0, "legacy")],
    "foreign": [],
}


def _todos(db: Database) -> list[tuple[object, ...]]:
    query = sa.select(ops_todos.c.kind, ops_todos.c.task_id, ops_todos.c.agent, ops_todos.c.why)
    with db.engine.connect() as conn:
        return [tuple(r) for r in conn.execute(query.order_by(ops_todos.c.id))]


def _cooldowns(db: Database) -> list[tuple[object, ...]]:
    c = model_cooldown.c
    with db.engine.connect() as conn:
        rows = conn.execute(sa.select(c.model_id, c.cooldown_until, c.source).order_by(c.model_id))
        return [tuple(r) for r in rows]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_a_legacy_database_adopts_works_and_goes_back(
    empty_db_url: str, variant: Variant, clock: FakeClock
) -> None:
    db = Database(empty_db_url)
    legacy_db.build(db, variant)
    found = {
        name: legacy_db.snapshot(db, name)
        for name in LEGACY_TABLES
        if sa.inspect(db.engine).has_table(name)
    }
    migrate(db)

    # Adopted: the tables found are kept aside untouched, their rows copied once.
    for name, rows in found.items():
        assert legacy_db.snapshot(db, f"legacy_{name}") == rows
    assert _todos(db) == TODOS[variant.name]
    assert _cooldowns(db) == COOLDOWNS[variant.name]
    with db.engine.connect() as conn:
        record = {r.name: r for r in conn.execute(sa.select(adopted_tables))}
    assert record["bus_commands"].max_id == 7 and record["bus_commands"].found_rows == 5
    assert {n: r.kept_as for n, r in record.items() if n != "bus_commands"} == {
        name: f"legacy_{name}" for name in found
    }

    # Every sweeper job works on the adopted schema.
    sweep = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)
    paused = sweep.queue.enqueue(TaskSpec(agent="ron", command="p", models=("sim/a",))).id
    (claimed,) = [t for t in sweep.queue.claim("ron", "w", 30, limit=5) if t.id == paused]
    sweep.queue.pause(paused, claimed.claim_token, clock.now + 99 * 3600, "cooldown")
    own_done = sweep.queue.enqueue(TaskSpec(agent="codex", command="d", models=("sim/a",))).id
    (task,) = [t for t in sweep.queue.claim("codex", "w", 30, limit=5) if t.id == own_done]
    sweep.queue.complete(task.id, task.claim_token, "ok")
    sweep.cooldowns.set("sim/z", clock.now + 5, reason="429")
    clock.advance(49 * 3600)  # past the 48 h demotion and every cooldown
    results = {job.__name__: job(sweep) for job in jobs.ALL}
    assert results["demote"] == {"demoted": 1}
    assert results["purge"]["purged"] >= 1
    clock.advance(8 * DAY)  # past the done retention: agentbus's own done task goes
    assert jobs.prune(sweep) == {"pruned": 1}
    assert sweep.queue.get(paused).status == "failed"
    assert ("demoted", paused, "ron") in [r[:3] for r in _todos(db)]
    # Ended cooldowns are purged, the older system's too; one still running stays.
    live = [c for c in COOLDOWNS[variant.name] if float(c[1]) > clock.now]  # type: ignore[arg-type]
    assert _cooldowns(db) == live
    with db.engine.connect() as conn:
        ids = conn.execute(sa.text("SELECT id FROM bus_commands ORDER BY id")).scalars().all()
    assert ids[:5] == [1, 2, 3, 4, 7] and own_done not in ids

    # The older system's failed task is still there, and retries.
    sweep.queue.retry(2)
    assert sweep.queue.get(2).status == "queued"

    # Back to the older shape: its tables as they were found, agentbus's gone.
    downgrade(db, "0001")
    inspector = sa.inspect(db.engine)
    for name in LEGACY_TABLES:
        if name in found:
            assert legacy_db.snapshot(db, name) == found[name]
        else:
            assert not inspector.has_table(name)
        assert not inspector.has_table(f"legacy_{name}")
    assert not inspector.has_table("adopted_tables")
    columns = {c["name"] for c in inspector.get_columns("bus_commands")}
    assert columns == {
        "id",
        "agent",
        "command",
        "status",
        "result_note",
        "created_at",
        "updated_at",
        "origin",
    }
    db.dispose()


def test_retention_deletes_adopted_tasks_only_when_asked(
    empty_db_url: str, clock: FakeClock
) -> None:
    db = Database(empty_db_url)
    legacy_db.build(db)
    migrate(db)
    keep = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)
    assert jobs.prune(keep) == {"pruned": 0}
    asked = Settings(prune_adopted_tasks=True)
    assert jobs.prune(jobs.Sweep(db, LiveConfig.fixed(asked), clock=clock)) == {"pruned": 3}
    with db.engine.connect() as conn:
        left = conn.execute(sa.text("SELECT id, status FROM bus_commands ORDER BY id")).all()
    assert [tuple(r) for r in left] == [(3, "claimed"), (4, "queued")]
    db.dispose()


def test_busctl_retries_an_adopted_failed_task_after_a_sweep(
    tmp_path: Path, run_busctl: Callable[..., subprocess.CompletedProcess[str]]
) -> None:
    url = f"sqlite:///{tmp_path / 'ops_multiagent.db'}"
    db = Database(url)
    legacy_db.build(db, VARIANTS[0])  # its tasks finished in 2025: past every retention
    db.dispose()
    assert run_busctl("--db", url, "migrate").returncode == 0
    sweeper = Path(sys.executable).with_name("sweeper")
    swept = subprocess.run(
        [str(sweeper), "--db", url, "--once"], capture_output=True, text=True, env=clean_env()
    )
    assert swept.returncode == 0, swept.stdout + swept.stderr
    done = run_busctl("--db", url, "retry", "2")
    assert (done.returncode, done.stdout.strip(), done.stderr) == (0, "task 2 re-queued", "")
    shown = json.loads(run_busctl("--db", url, "show", "2", "--json").stdout)
    assert (shown["task"]["status"], shown["task"]["command"]) == ("queued", "macro brief")


def test_tables_an_earlier_release_adopted_in_place_are_set_aside(
    db_url: str, clock: FakeClock
) -> None:
    """An earlier release added its columns to the older ops_todos and model_cooldown but
    no keys: the demotion's and the cooldowns' upserts failed. Migrating repairs that."""
    db = Database(db_url)
    downgrade(db, "0008")
    real = "REAL" if db.dialect == "sqlite" else "DOUBLE PRECISION"
    with db.engine.begin() as conn:
        for sql in (
            "DROP TABLE adopted_tables",
            "DROP VIEW active_cooldowns",
            "DROP TABLE ops_todos",
            "DROP TABLE model_cooldown",
            f"CREATE TABLE ops_todos (note TEXT NOT NULL, kind TEXT, task_id BIGINT,"
            f" agent TEXT, why TEXT, created_at {real}, resolved_at {real})",
            "INSERT INTO ops_todos VALUES ('n', 'demoted', 5, 'ron', 'old', 1, NULL),"
            " ('n', 'demoted', 5, 'ron', 'old', 1, NULL)",
            f"CREATE TABLE model_cooldown (model_id TEXT, cooldown_until {real},"
            f" updated_at {real}, reason TEXT, source TEXT)",
            "INSERT INTO model_cooldown VALUES ('sim/a', 1, 1, '429', 'w'),"
            " ('sim/a', 2, 1, '429', 'w')",
            "CREATE VIEW active_cooldowns AS SELECT model_id FROM model_cooldown",
        ):
            conn.exec_driver_sql(sql)
    found = {name: legacy_db.snapshot(db, name) for name in LEGACY_TABLES}
    migrate(db)
    for name, rows in found.items():
        assert legacy_db.snapshot(db, f"legacy_{name}") == rows
    assert _todos(db) == [("demoted", 5, "ron", "old")]
    assert _cooldowns(db) == [("sim/a", 2.0, "w")]

    sweep = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)
    sweep.cooldowns.set("sim/a", clock.now + 60, reason="429")  # the upsert works again
    with db.engine.connect() as conn:
        active = conn.execute(sa.text("SELECT model_id, seconds_left FROM active_cooldowns"))
        assert [r.model_id for r in active] == ["sim/a"]  # the view reads agentbus's table
    task_id = sweep.queue.enqueue(TaskSpec(agent="ron", command="p", models=("sim/a",))).id
    (task,) = sweep.queue.claim("ron", "w", 30)
    sweep.queue.pause(task_id, task.claim_token, clock.now + 99 * 3600, "cooldown")
    clock.advance(49 * 3600)
    assert jobs.demote(sweep) == {"demoted": 1}
    assert ("demoted", task_id, "ron") in [r[:3] for r in _todos(db)]
    db.dispose()
