"""PostgreSQL's plans for the queue's hot statements, as a database in service has them:
with the tasks table's statistics taken (``ANALYZE``, as autovacuum does). The server
keeps one plan for a prepared statement once it costs about what plans made for each
run's values do; these tests hold that plan to reading tasks by key and through the
partial indexes, never the whole table, and the server to keeping it."""

from __future__ import annotations

from typing import Any

import pytest

from agentbus.admission.routing import Route
from agentbus.db.compiled import prepared
from agentbus.providers.outcomes import Usage
from agentbus.queue import Settlement, TaskQueue
from agentbus.queue.decisions import Complete
from agentbus.queue.settle_and_claim import ack_and_claim_postgres
from agentbus.queue.statements import (
    COMPLETE_MANY_POSTGRES,
    HEARTBEAT,
    POSTPONE_POSTGRES,
    SETTLE,
    claim_statement,
)
from agentbus.queue.tasks import TaskSpec


def _generic_plan(
    queue: TaskQueue, statement: Any, values: dict[str, Any], *, then_claimed: int = 0
) -> list[str]:
    """PostgreSQL: the plan of ``statement`` prepared once for any values (a generic plan,
    which the server switches to after a few runs when it costs about what the plans for
    each run's values do), with ``bus_commands``'s statistics taken while 2,000 tasks
    are queued (and ``then_claimed`` of them claimed after)."""
    import psycopg

    queue.enqueue_many([TaskSpec(agent="a", command="t")] * 2000)
    queue.db.write(lambda conn: conn.exec_driver_sql("ANALYZE bus_commands"))
    if then_claimed:
        queue.settle_and_claim([], "a", "w", 600, then_claimed)
    made = prepared(queue.db.engine.dialect, statement)
    args = made.params(values)
    with queue.db.engine.connect() as conn:
        raw = conn.connection.driver_connection
        assert isinstance(raw, psycopg.Connection)
        raw.execute("SET plan_cache_mode = force_generic_plan")
        raw.execute(f"PREPARE generic AS {made.sql}")
        marks = ", ".join(["%s"] * len(args))
        cursor = psycopg.ClientCursor(raw)
        plan = [row[0] for row in cursor.execute(f"EXPLAIN EXECUTE generic({marks})", args)]
        conn.rollback()
    return plan


_CLAIM = {"p_agent": "a", "p_worker": "w", "p_now": 1e10, "p_lease_until": 1e10, "p_limit": 1}


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_cached_claim_plan_reads_the_queued_tasks_index(queue: TaskQueue) -> None:
    """The claim finds the next task through the partial index of queued tasks, and the
    tasks it picked by key: never by reading the whole table, whatever the statistics
    say of how many a claim may take."""
    plan = _generic_plan(queue, claim_statement("postgresql"), _CLAIM)
    assert any("ix_bus_commands_claim" in line for line in plan), plan
    assert not any("Seq Scan on bus_commands" in line for line in plan), plan


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize("single", [True, False])
def test_a_cached_steady_state_plan_reads_no_whole_table(queue: TaskQueue, single: bool) -> None:
    """A worker's settle-and-claim, one statement: its generic plan reads tasks by key
    and through the partial indexes, however many tasks were queued when the table's
    statistics were taken (with a whole-table read in it, each claim would cost as much
    as the table is large)."""
    values: dict[str, Any] = {**_CLAIM, "p_events": [], "p_routes": []}
    if single:
        values.update(dict.fromkeys(("p_id", "p_token", "p_result", "p_note", "p_detail")))
    else:
        values.update({k: [] for k in ("p_ids", "p_tokens", "p_results", "p_notes", "p_details")})
    statement = ack_and_claim_postgres(single=single, limit=1 if single else 10)
    plan = _generic_plan(queue, statement, values)
    assert any("ix_bus_commands_claim" in line for line in plan), plan
    assert not any("Seq Scan on bus_commands" in line for line in plan), plan


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize(
    "name",
    ["complete", "complete_many", "release", "heartbeat", "postpone", "steady", "steady_many"],
)
def test_a_task_found_by_its_key_is_read_by_its_key(queue: TaskQueue, name: str) -> None:
    """A statement that names its task (a settle, a heartbeat, a postponement, a worker's
    completions) reads it through the primary key, never through the partial index of
    its state, all of which it would read (every task claimed at once), when the
    statistics were taken while few tasks were in that state."""
    one = {"p_id": 1, "p_token": 1, "p_now": 1.0, "p_lease_until": 2.0}
    done = dict.fromkeys(("p_result", "p_note", "p_detail"))
    many = {"p_ids": [1], "p_tokens": [1], "p_results": [None], "p_notes": [None]}
    steady = {**_CLAIM, "p_events": [], "p_routes": []}
    statement, values = {
        "complete": (SETTLE["complete"], {**one, **done}),
        "complete_many": (COMPLETE_MANY_POSTGRES, {**many, "p_details": [None], "p_now": 1.0}),
        "release": (SETTLE["release"], one),
        "heartbeat": (HEARTBEAT, one),
        "postpone": (POSTPONE_POSTGRES, {"p_ids": [1], "p_resume_after": 2.0, "p_reason": "r"}),
        "steady": (ack_and_claim_postgres(single=True, limit=1), {**steady, **one, **done}),
        "steady_many": (ack_and_claim_postgres(limit=10), {**steady, **many, "p_details": [None]}),
    }[name]
    plan = _generic_plan(queue, statement, values, then_claimed=300)
    found = [line for line in plan if " using " in line and "bus_commands" in line]
    assert any("bus_commands_pkey" in line for line in found), plan
    assert not any("ix_bus_commands_lease" in line or "_paused_due" in line for line in found)


@pytest.mark.parametrize("backend", ["postgresql"])
@pytest.mark.parametrize("batch", [1, 10])
def test_the_server_plans_the_steady_state_once(queue: TaskQueue, batch: int) -> None:
    """PostgreSQL plans a prepared statement for each run's values five times, then keeps
    one plan for every run if it is about as cheap. With the table's statistics taken
    while tasks are queued, a worker's settle-and-claim must come to that kept plan:
    planned again at every run, it costs the server about as much again as it runs."""
    queue.enqueue_many([TaskSpec(agent="a", command="t")] * 10_000)
    queue.db.write(lambda conn: conn.exec_driver_sql("ANALYZE bus_commands"))
    acks: list[Settlement] = []
    for _ in range(20):
        _, tasks = queue.settle_and_claim(acks, "a", "w", 60, batch)
        acks = [  # as a worker's: each with the call that answered it
            Settlement(
                t.id,
                t.claim_token,
                Complete("ok", "sim/a", Usage(10, 5)),
                [Route(t.id, t.claim_token, "a", "sim/a", "call", 1.0, "w", "ok", provider="sim")],
            )
            for t in tasks
        ]
    plans = queue.db.pinned.write_one(  # the settle-and-claim statements (not this one)
        lambda conn: conn.exec_driver_sql(
            "SELECT generic_plans, custom_plans FROM pg_prepared_statements"
            " WHERE strpos(statement, 'claimed AS') > 0 AND strpos(statement, 'generic_plans') = 0"
        ).all()
    )
    assert plans and all(custom <= 5 for _, custom in plans), plans
    assert sum(generic for generic, _ in plans) >= 10, plans
