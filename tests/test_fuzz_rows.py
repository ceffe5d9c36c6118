"""Rows written by hand (hypothesis): operators write SQL as well as read it, and
SQLite keeps whatever a column is given. One column of one row of ``bus_commands``,
``model_cooldown``, ``workers``, ``task_events`` or ``ops_todos`` set to anything the
database lets in must not crash ``busctl`` (status, tasks, show, cooldowns, kpi,
events), the dashboard's documents, ``/metrics`` or a sweeper pass."""

from __future__ import annotations

import contextlib
import io
import json
import time
from typing import Any

import pytest
import sqlalchemy as sa
import structlog
from hypothesis import given, reject
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest

from agentbus import cli
from agentbus.admin import kpi, serve, status
from agentbus.admin.busctl import busctl
from agentbus.admission.cooldowns import CooldownStore
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.queue import TaskQueue, reads, todos
from agentbus.queue.tasks import TaskSpec
from agentbus.queue.workers import WorkerRegistry
from agentbus.schema import bus_commands, model_cooldown, ops_todos, task_events, workers
from agentbus.sweeper import jobs
from agentbus.sweeper.service import run_once
from tests.fuzzing import FUZZ

TABLES = {t.name: t for t in (bus_commands, model_cooldown, workers, task_events, ops_todos)}
#: What may be written into a column by hand (the database refuses what it must).
hostile = st.one_of(
    st.sampled_from(["tomorrow", "", "1e999", "NaN", "-", "{", "[1, 2]", '"text"', "null"]),
    st.text(max_size=12),
    st.binary(max_size=8),
    st.none(),
    st.sampled_from([2**62, -(2**62), -1, 0, 10**12]),
    st.floats(),
)
# Every column but the keys a row is found by.
targets = st.sampled_from(
    [
        (name, column.name)
        for name, table in TABLES.items()
        for column in table.columns
        if not column.primary_key
    ]
)


def populate(db: Database) -> list[int]:
    """A task in each state, a cooldown, a worker, their events and a todo."""
    queue = TaskQueue(db)
    spec = TaskSpec(agent="codex", command="t", models=("sim/a",))
    held = [queue.enqueue(spec).id for _ in range(4)]
    by_id = {c.id: c for c in queue.claim("codex", "w1", 60, limit=4)}
    ids = [queue.enqueue(spec).id, *held]  # queued, claimed, paused, done, failed
    now = queue.clock()
    paused, done, failed = held[1:]
    queue.pause(paused, by_id[paused].claim_token, now + 300, "rate_limited", model="sim/a")
    queue.complete(done, by_id[done].claim_token, "ok", model="sim/a")
    queue.fail(failed, by_id[failed].claim_token, "broken")
    CooldownStore(db).set("sim/a", now + 300, reason="RateLimited", source="w1")
    WorkerRegistry(db, "codex@host:1", "codex").register()
    db.write(
        lambda conn: todos.add(
            conn,
            [
                {
                    "kind": "demoted",
                    "task_id": failed,
                    "agent": "codex",
                    "why": "x",
                    "created_at": now,
                }
            ],
        )
    )
    return ids


def wipe(db: Database) -> None:
    def work(conn: sa.Connection) -> None:
        for table in TABLES.values():
            conn.execute(sa.delete(table))

    db.write(work)


def busctl_says(url: str, *args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.run(busctl, "busctl", ["--db", url, *args])
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        else:
            code = 0
        finally:  # the command set logging up for its process: the next test logs as default
            structlog.reset_defaults()
    return code, out.getvalue() + err.getvalue()


def metrics(db: Database, settings: Settings) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(
        serve.SnapshotCollector(
            lambda with_kpis: status.snapshot(db, settings, kpis=with_kpis),
            lambda: [k.as_dict() for k in kpi.compute(db, time.time() - 3600)],
        )
    )
    return generate_latest(registry)


@pytest.fixture
def settings() -> Settings:
    return Settings()


# Some 60 examples of thirteen busctl commands each, a sweep and a scrape: ~30 s on a
# quiet machine, minutes on a loaded one. The timeout guards against a hang, not speed.
@pytest.mark.timeout(600)
def test_a_row_written_by_hand_crashes_no_reader(
    db: Database, db_url: str, settings: Settings
) -> None:
    sweep = jobs.Sweep(db, LiveConfig.fixed(settings))

    @FUZZ
    @given(targets, hostile)
    def check(target: tuple[str, str], value: Any) -> None:
        wipe(db)
        ids = populate(db)
        table, column = target
        try:
            db.write(lambda conn: conn.execute(sa.update(TABLES[table]).values({column: value})))
        except (sa.exc.StatementError, TypeError, ValueError):
            reject()  # the database, its driver or the column's type refuses such a value
        for args in (
            ["status"],
            ["status", "--json"],
            ["tasks"],
            ["tasks", "--json"],
            ["cooldowns"],
            ["kpi"],
            ["events"],
            *(["show", str(i)] for i in ids),
            ["show", "--json", str(ids[2])],
        ):
            code, said = busctl_says(db_url, *args)
            assert "Traceback" not in said, (args, said)
            assert code == 0, (args, said)
        json.dumps(status.snapshot(db, settings), default=str)
        for task_id in ids:
            reads.task_events(db, task_id)
        assert b"agentbus_tasks" in metrics(db, settings)
        assert run_once(sweep)["failed_jobs"] == 0

    try:
        check()
    finally:
        wipe(db)
