"""Migrations: the schema they build is the models', they go down and up, and
they adopt the older system's bus_commands table in place."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext

from agentbus.db import Database
from agentbus.db.compiled import prepared
from agentbus.errors import NotMigrated
from agentbus.migrations import HEAD, downgrade, head_revision, migrate
from agentbus.queue import TaskQueue
from agentbus.queue.inserts import ENQUEUE_ONE, INSERT_EVENT
from agentbus.queue.statements import SETTLE, claim_statement
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import metadata
from tests import legacy_db
from tests.support import clean_env


def schema_diff(db: Database) -> list[object]:
    with db.engine.connect() as conn:
        return list(compare_metadata(MigrationContext.configure(conn), metadata))


def test_upgrade_builds_exactly_the_models(empty_db_url: str) -> None:
    db = Database(empty_db_url)
    migrate(db)
    assert db.current_revision() == head_revision() == HEAD
    assert schema_diff(db) == []
    db.dispose()


def test_down_and_up_again(empty_db_url: str) -> None:
    db = Database(empty_db_url)
    migrate(db)
    queue = TaskQueue(db)
    queue.enqueue(TaskSpec(agent="codex", command="keep me", models=("sim/a",)))
    task_id = queue.enqueue(TaskSpec(agent="codex", command="pause me", models=("sim/a",))).id
    (first, second) = queue.claim("codex", "w", 30, limit=2)
    queue.pause(second.id, second.claim_token, 1e10, "cooldown", model="sim/a")
    downgrade(db, "0001")
    with db.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, command, status FROM bus_commands ORDER BY id"))
        # The older shape has no paused state: the paused task is handed back to the queue.
        assert [tuple(r) for r in rows] == [
            (first.id, "keep me", "claimed"),
            (task_id, "pause me", "queued"),
        ]
    downgrade(db, "base")
    assert not sa.inspect(db.engine).has_table("bus_commands")
    migrate(db)
    assert schema_diff(db) == []
    db.dispose()


def test_legacy_database_is_adopted_in_place(empty_db_url: str) -> None:
    db = Database(empty_db_url)
    legacy_db.build(db)
    with db.engine.connect() as conn:
        before = conn.execute(
            sa.text(
                "SELECT CAST(created_at AS DOUBLE PRECISION) AS created_at,"
                " CAST(updated_at AS DOUBLE PRECISION) AS updated_at FROM bus_commands ORDER BY id"
            )
        ).all()
    with pytest.raises(NotMigrated):
        db.require_migrated()
    migrate(db)
    db.require_migrated()
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.text(
                "SELECT id, agent, command, status, result_note, origin, created_at, updated_at,"
                " priority, attempts, max_attempts, claim_token, pause_count, run_after,"
                " lease_until FROM bus_commands ORDER BY id"
            )
        ).all()
    assert [tuple(r[:6]) for r in rows] == legacy_db.TASKS
    # Every old column keeps its value (a Postgres REAL column is widened, not rounded).
    assert [(r.created_at, r.updated_at) for r in rows] == [
        (b.created_at, b.updated_at) for b in before
    ]
    for row in rows:
        assert (row.priority, row.attempts, row.max_attempts, row.claim_token) == (0, 0, 3, 0)
        assert (row.pause_count, row.run_after) == (0, 0)
        # The older system's claimed rows have no lease: one already expired, for the sweeper.
        assert (row.lease_until is not None) == (row.status == "claimed")

    queue = TaskQueue(db)
    # Old queued rows are claimable; the legacy text column is the task text.
    (claimed,) = queue.claim("ron", "w", 30)
    assert (claimed.id, claimed.command, claimed.payload, claimed.models) == (
        4,
        "summarise",
        {},
        None,
    )
    queue.pause(claimed.id, claimed.claim_token, 2e9, "cooldown", model="sim/a")
    assert queue.get(4).status == "paused"
    new_id = queue.enqueue(TaskSpec(agent="codex", command="new", models=("sim/a",))).id
    assert new_id > 9
    with db.engine.connect() as conn:
        origin = conn.execute(
            sa.text("SELECT origin FROM bus_commands WHERE id = :i"), {"i": new_id}
        ).scalar()
    assert origin == "orchestrator"  # the extra column keeps its own default
    db.dispose()


def test_busctl_migrate_adopts_a_legacy_sqlite_file(tmp_path: object, run_busctl: object) -> None:
    path = tmp_path / "ops_multiagent.db"  # type: ignore[operator]
    db = Database(f"sqlite:///{path}")
    legacy_db.build(db)
    db.dispose()
    result = run_busctl("--db", f"sqlite:///{path}", "migrate")  # type: ignore[operator]
    assert result.returncode == 0, result.stderr
    assert f"to {head_revision()}" in result.stdout
    shown = run_busctl("--db", f"sqlite:///{path}", "show", "2", "--json")  # type: ignore[operator]
    task = json.loads(shown.stdout)["task"]
    assert (task["status"], task["result_note"]) == (
        "failed",
        "all candidate models are cooling down",
    )


def _plan(db: Database, sql: str, params: dict[str, object]) -> str:
    with db.engine.connect() as conn:
        if db.dialect == "sqlite":
            rows = conn.execute(sa.text("EXPLAIN QUERY PLAN " + sql), params)
            return "\n".join(str(r[-1]) for r in rows)
        rows = conn.execute(sa.text("EXPLAIN " + sql), params)
        return "\n".join(r[0] for r in rows)


def test_the_calls_already_made_are_numbered_in_their_windows(empty_db_url: str) -> None:
    """Upgrading past 0016 numbers each call of ``call_slots`` in its account's and its
    agent's window, in admission order (a tie by time: by id)."""
    db = Database(empty_db_url)
    migrate(db, "0015")
    calls = [  # provider, account, agent, admitted_at
        ("sim", "a", "codex", 30.0),
        ("sim", "a", "review", 10.0),
        ("sim", "b", "codex", 20.0),
        ("sim", "a", "codex", 10.0),
        ("edge", "a", "codex", 40.0),
    ]
    with db.engine.begin() as conn:
        for provider, account, agent, at in calls:
            conn.execute(
                sa.text(
                    "INSERT INTO call_slots (provider, account, model, agent, admitted_at,"
                    " lease_until) VALUES (:p, :a, 'm', :g, :at, :at)"
                ),
                {"p": provider, "a": account, "g": agent, "at": at},
            )
    migrate(db)
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT account_seq, agent_seq FROM call_slots ORDER BY id")
        ).all()
    assert [tuple(r) for r in rows] == [(3, 3), (1, 1), (1, 2), (2, 1), (1, 4)]
    db.dispose()


def test_the_idempotency_key_index_holds_only_the_keyed_tasks(empty_db_url: str) -> None:
    """Upgrading past 0020 makes the keys' uniqueness a partial index: the rows, their
    keys and the ids' high-water mark stay; a key still names one task."""
    db = Database(empty_db_url)
    migrate(db, "0019")
    insert = sa.text(
        "INSERT INTO bus_commands (agent, command, idempotency_key) VALUES (:a, 'x', :k)"
    )
    with db.engine.begin() as conn:
        for agent, key in [("codex", "k1"), ("codex", None), ("review", None), ("gone", None)]:
            conn.execute(insert, {"a": agent, "k": key})
        conn.execute(sa.text("DELETE FROM bus_commands WHERE agent = 'gone'"))
    migrate(db)
    assert schema_diff(db) == []
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.text("SELECT id, agent, idempotency_key FROM bus_commands ORDER BY id")
        )
        assert [tuple(r) for r in rows] == [
            (1, "codex", "k1"),
            (2, "codex", None),
            (3, "review", None),
        ]
        if db.dialect == "sqlite":
            made, where = "SELECT sql FROM sqlite_master WHERE name = :n", "WHERE {}"
        else:
            made, where = "SELECT indexdef FROM pg_indexes WHERE indexname = :n", "WHERE ({})"
        index = conn.execute(sa.text(made), {"n": "uq_bus_commands_idempotency_key"}).scalar_one()
        assert index.endswith(where.format("idempotency_key IS NOT NULL")), index
    with db.engine.begin() as conn:
        conn.execute(insert, [{"a": "codex", "k": None}, {"a": "codex", "k": "k2"}])
        assert conn.execute(sa.text("SELECT max(id) FROM bus_commands")).scalar_one() == 6  # not 4
    with pytest.raises(sa.exc.IntegrityError), db.engine.begin() as conn:
        conn.execute(insert, {"a": "review", "k": "k1"})
    # "k2" is in the task table and not yet among the kept keys: the insert meets the index.
    queue = TaskQueue(db)
    again = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",), key="k2"))
    assert (again.id, again.created) == (6, False)
    db.dispose()


def test_claim_and_due_queries_are_index_range_scans(db: Database) -> None:
    """The claim and "paused and due" lookups read an index, not the table."""
    with db.engine.begin() as conn:
        done = [
            {"agent": f"a{i % 7}", "command": "x", "status": "done", "run_after": 0}
            for i in range(5000)
        ]
        live = [
            {
                "agent": "codex",
                "command": "y",
                "status": s,
                "run_after": 0,
                "resume_after": 100.0 + i,
            }
            for i, s in enumerate(["queued", "paused"] * 20)
        ]
        conn.execute(
            sa.text(
                "INSERT INTO bus_commands (agent, command, status, run_after, resume_after)"
                " VALUES (:agent, :command, :status, :run_after, :resume_after)"
            ),
            [{**d, "resume_after": None} for d in done] + live,
        )
        conn.exec_driver_sql("ANALYZE")
    claim = _plan(
        db,
        "SELECT id FROM bus_commands WHERE status = 'queued' AND agent = :agent"
        " AND run_after <= :now ORDER BY priority DESC, run_after, id LIMIT 10",
        {"agent": "codex", "now": 1e10},
    )
    due = _plan(
        db,
        "SELECT id FROM bus_commands WHERE status = 'paused' AND resume_after <= :now"
        " ORDER BY resume_after LIMIT 500",
        {"now": 120.0},
    )
    assert "ix_bus_commands_claim" in claim, claim
    assert "ix_bus_commands_paused_due" in due, due
    for plan in (claim, due):
        assert "SCAN bus_commands" not in plan.replace("USING INDEX", "")
        assert "Seq Scan" not in plan
        assert "TEMP B-TREE" not in plan  # the index gives the order: no sort


def test_the_status_check_allows_the_statuses_and_nothing_else(db: Database) -> None:
    insert = sa.text("INSERT INTO bus_commands (agent, command, status) VALUES ('codex', 'x', :s)")
    with db.engine.begin() as conn:
        for status in TaskStatus:
            conn.execute(insert, {"s": status.value})
    with pytest.raises(sa.exc.IntegrityError), db.engine.begin() as conn:
        conn.execute(insert, {"s": "bogus"})
    with pytest.raises(sa.exc.IntegrityError), db.engine.begin() as conn:
        conn.execute(sa.text("UPDATE bus_commands SET status = 'bogus' WHERE status = 'done'"))
    with db.engine.connect() as conn:
        held = conn.execute(sa.text("SELECT status FROM bus_commands ORDER BY id")).scalars()
        assert list(held) == [s.value for s in TaskStatus]


@pytest.mark.parametrize("backend", ["sqlite"])
def test_sqlite_builds_no_table_of_a_list_in_a_hot_statement(db: Database) -> None:
    """SQLite evaluates ``x IN (a, b, c)`` (and an IN over a subquery) by building a
    temporary b-tree at every row: a task's status check, the counting trigger's
    condition on every event and a single claim compare in place instead. What is left
    is the one that buffers a RETURNING clause's rows. The trigger that makes due the
    tasks waiting for a task that ended builds one only when such a task ends (past its
    WHEN: the program of a trigger is listed after the statement's, from its Init)."""

    def tables(statement: object, trigger: str | None = None) -> int:
        sql = prepared(db.engine.dialect, statement).sql
        with db.engine.connect() as conn:
            ops = conn.exec_driver_sql("EXPLAIN " + sql, (None,) * sql.count("?")).all()
        program, counted = None, 0
        for op in ops:
            if op[1] == "Init" and isinstance(op[5], str) and op[5].startswith("-- TRIGGER "):
                program = op[5].removeprefix("-- TRIGGER ")
            counted += op[1] == "OpenEphemeral" and program == trigger
        return counted

    assert tables(SETTLE["complete"]) == 0  # its status check
    assert tables(SETTLE["complete"], "count_tasks_moved") == 0
    assert tables(SETTLE["complete"], "release_waiters") == 1  # only for an awaited task
    assert tables(INSERT_EVENT) == 0  # the counting trigger's condition
    assert tables(ENQUEUE_ONE) == 0  # its status check; its id is the cursor's lastrowid
    assert tables(claim_statement("sqlite", single=True)) == 1  # RETURNING the task
    assert tables(claim_statement("sqlite")) == 3  # a batch's IN (subquery): two more


def test_alembic_upgrade_head_from_the_checkout(empty_db_url: str) -> None:
    """`alembic upgrade head` in the repository does what `busctl migrate` does."""
    root = Path(__file__).resolve().parent.parent
    env = {**clean_env(), "AGENTBUS_DATABASE_URL": empty_db_url}
    done = subprocess.run(
        [command("alembic"), "upgrade", "head"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert_at_head(empty_db_url)


def command(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def assert_at_head(url: str) -> None:
    db = Database(url)
    try:
        assert db.current_revision() == HEAD
        assert schema_diff(db) == []
    finally:
        db.dispose()


def test_concurrent_migrations_take_turns(empty_db_url: str) -> None:
    """Three `busctl migrate` at once on a fresh database: every one exits 0."""
    argv = [command("busctl"), "--db", empty_db_url, "migrate"]
    procs = [
        subprocess.Popen(argv, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(3)
    ]
    results = [(p.wait(timeout=120), *p.communicate()) for p in procs]
    assert [code for code, _, _ in results] == [0, 0, 0], results
    assert_at_head(empty_db_url)
