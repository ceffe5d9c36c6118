"""What operators and the sweeper read on a schedule reads the rows it returns, through
an index, never the whole tasks table: the plans of those statements on both databases,
with the table's statistics taken (``ANALYZE``) as a database in service has them."""

from __future__ import annotations

import re
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.admin.observe import RECENT_FAILED, next_due
from agentbus.admission import workspace_events
from agentbus.db import Database
from agentbus.queue import malformed, retention
from agentbus.queue.states import TaskStatus
from agentbus.schema import bus_commands


@pytest.fixture
def finished(db: Database) -> Database:
    """5,000 done tasks, 500 failed, 100 errored, 100 cancelled, 50 queued."""
    shape = [("done", 5000), ("failed", 500), ("error", 100), ("cancelled", 100), ("queued", 50)]
    rows = [
        {"agent": f"a{i % 7}", "status": status, "at": float(i)}
        for status, n in shape
        for i in range(n)
    ]
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO bus_commands (agent, command, status, run_after, updated_at)"
                " VALUES (:agent, 'x', :status, 0, :at)"
            ),
            rows,
        )
        conn.exec_driver_sql("ANALYZE")
    return db


def plan(db: Database, statement: Any) -> str:
    """The plan of ``statement`` as the code runs it, with its values bound."""
    compiled = statement.compile(db.engine, compile_kwargs={"render_postcompile": True})
    values = compiled.construct_params()
    with db.engine.connect() as conn:
        if db.dialect == "sqlite":
            args = tuple(values[name] for name in compiled.positiontup)
            rows = conn.exec_driver_sql(f"EXPLAIN QUERY PLAN {compiled}", args)
            return "\n".join(str(r[-1]) for r in rows)
        return "\n".join(r[0] for r in conn.exec_driver_sql(f"EXPLAIN {compiled}", values))


def reads_no_whole_table(text: str) -> bool:
    """SQLite's ``SCAN bus_commands`` without an index, PostgreSQL's ``Seq Scan``."""
    return not re.search(r"SCAN bus_commands(?! USING)|Seq Scan", text)


@pytest.mark.parametrize(
    ("statuses", "index"),
    [
        ((TaskStatus.DONE,), "ix_bus_commands_done_at"),
        ((TaskStatus.FAILED, TaskStatus.ERROR), "ix_bus_commands_failed_at"),
        ((TaskStatus.CANCELLED,), "ix_bus_commands_cancelled_at"),
    ],
)
def test_retention_finds_old_tasks_through_their_index(
    finished: Database, statuses: tuple[TaskStatus, ...], index: str
) -> None:
    """Retention's probe at every pass, when nothing is old enough: a range of the
    finished tasks' index by time (a whole-table read at 10 M rows took ~1 s)."""
    for first_id in (0, 3000):  # 3000: the older system's tasks (kept) come first
        text = plan(finished, retention.finished_before(statuses, 100.0, 500, first_id))
        assert index in text, text
        assert reads_no_whole_table(text), text


def test_the_last_failures_are_the_start_of_their_index(finished: Database) -> None:
    """Status's last failures: their index read backwards, no sort of every failure."""
    text = plan(finished, RECENT_FAILED)
    assert "ix_bus_commands_failed_at" in text, text
    assert reads_no_whole_table(text), text
    assert "TEMP B-TREE" not in text and "Sort" not in text, text


def test_the_latest_pause_events_are_the_end_of_their_index(finished: Database) -> None:
    """The workspace's latest pauses and resumes (status, the dashboard): the end of their
    partial index on time, never the whole event log read backwards."""
    with finished.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO task_events (task_id, from_status, to_status, at)"
                " VALUES (:i, 'queued', 'claimed', :i)"
            ),
            [{"i": i} for i in range(5000)],
        )
        conn.exec_driver_sql("ANALYZE")
    text = plan(finished, workspace_events.pause_events(workspace_events.TASK_KINDS, None, 20))
    assert "ix_task_events_paused_at" in text, text
    assert not re.search(r"SCAN task_events(?! USING)|Seq Scan", text), text


def test_each_agents_next_task_is_the_head_of_the_claim_index(finished: Database) -> None:
    """How long each agent's next task has been due: one read of the claim's index per
    agent with queued tasks."""
    text = plan(finished, next_due(1e10))
    assert "ix_bus_commands_claim" in text, text
    assert reads_no_whole_table(text), text


@pytest.mark.parametrize(
    ("state", "index"),
    [
        (TaskStatus.QUEUED, "ix_bus_commands_claim"),
        (TaskStatus.PAUSED, "ix_bus_commands_paused_due"),
        (TaskStatus.CLAIMED, "ix_bus_commands_lease"),
    ],
)
def test_the_sweeper_looks_for_malformed_tasks_in_each_states_index(
    finished: Database, state: TaskStatus, index: str
) -> None:
    """The sweeper's pass reads the tasks not ended for malformed values: a state at a
    time, through its partial index, never the finished tasks."""
    text = plan(finished, malformed.query(bus_commands, finished.dialect, state, 500))
    assert index in text, text
    assert reads_no_whole_table(text), text
