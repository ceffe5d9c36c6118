"""scripts/floor.py: the bare steady-state write set writes what a worker's steady
state writes, so that its figures are a floor under the same rows."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands, route_log, task_events, usage_daily
from tests.support import script


def written(db: Database, agent: str) -> dict[str, Any]:
    """What the steady state left for ``agent``'s tasks, without ids, workers and times."""
    ids = sa.select(bus_commands.c.id).where(bus_commands.c.agent == agent)
    with db.engine.connect() as conn:
        tasks = Counter(
            (r.status, r.attempts, r.result, r.result_note)
            for r in conn.execute(sa.select(bus_commands).where(bus_commands.c.agent == agent))
        )
        moves = Counter(
            (r.from_status, r.to_status, r.reason, r.detail is None)
            for r in conn.execute(sa.select(task_events).where(task_events.c.task_id.in_(ids)))
        )
        routes = Counter(
            (r.model, r.decision, r.outcome, r.provider)
            for r in conn.execute(sa.select(route_log).where(route_log.c.task_id.in_(ids)))
        )
        workers = sa.select(route_log.c.worker).where(route_log.c.task_id.in_(ids))
        calls = conn.execute(
            sa.select(sa.func.sum(usage_daily.c.calls)).where(usage_daily.c.worker.in_(workers))
        ).scalar()
    return {"tasks": tasks, "events": moves, "routes": routes, "calls": calls}


def floor_agent(db: Database) -> str:
    """The agent whose tasks floor's processes drained (one per test's database)."""
    with db.engine.connect() as conn:
        return str(
            conn.execute(
                sa.select(bus_commands.c.agent)
                .where(bus_commands.c.agent.like("floor%"))
                .distinct()
            ).scalar_one()
        )


def steady_written(db: Database, tasks: int) -> dict[str, Any]:
    """What a worker's steady state leaves for ``tasks`` no-op tasks of a new agent."""
    queue = TaskQueue(db)
    queue.enqueue_many([TaskSpec(agent="steady", command="t", models=("sim/noop",))] * tasks)
    assert script("counting").steady_loop(queue, "steady", "w", 1) == tasks
    return written(db, "steady")


def test_the_bare_write_set_writes_what_the_steady_state_writes(db: Database) -> None:
    floor = script("floor")
    url = db.engine.url.render_as_string(hide_password=False)
    if db.dialect != "sqlite":
        with pytest.raises(ValueError, match="SQLite's"):
            floor.steady(url, 1, 5)
        return
    rate, cpu, held = floor.steady(url, 2, 12)  # two processes taking turns, as workers do
    assert rate > 0 and cpu > 0
    assert held.startswith("writers' turn ") and "COMMIT" in held
    assert "other work" not in held
    ours, bare = steady_written(db, 12), written(db, floor_agent(db))
    assert bare == ours
    assert ours["tasks"] == Counter({(TaskStatus.DONE, 1, "ok", "model=sim/noop"): 12})
    assert ours["calls"] == 12


def test_other_work_between_turns_is_done_and_timed(db: Database) -> None:
    """With ``between``, each process works after each of its turns; the tasks are all
    settled as before and the work's time is shown beside the turns."""
    floor = script("floor")
    url = db.engine.url.render_as_string(hide_password=False)
    if db.dialect != "sqlite":
        with pytest.raises(ValueError, match="SQLite's"):
            floor.steady(url, 2, 5, between=5)
        return
    _, _, held = floor.steady(url, 2, 8, between=5)
    assert held.startswith("writers' turn ")
    assert held.endswith(" ms of other work after each turn")
    with db.engine.connect() as conn:
        settled = conn.execute(
            sa.select(sa.func.count())
            .select_from(bus_commands)
            .where(
                bus_commands.c.agent.like("floor%"), bus_commands.c.status == TaskStatus.DONE.value
            )
        ).scalar()
    assert settled == 8


def test_the_two_updates_alone_settle_every_task_and_record_nothing(db: Database) -> None:
    """Without records, the processes complete and claim as before (the tasks end as
    the steady state leaves them) but write no event, routing row or usage: only the
    enqueue's events are there."""
    floor = script("floor")
    url = db.engine.url.render_as_string(hide_password=False)
    if db.dialect != "sqlite":
        with pytest.raises(ValueError, match="SQLite's"):
            floor.steady(url, 2, 5, between=5, records=False)
        return
    _, _, held = floor.steady(url, 2, 8, between=5, records=False)
    assert held.startswith("writers' turn ")
    bare, ours = written(db, floor_agent(db)), steady_written(db, 8)
    assert (
        bare["tasks"] == ours["tasks"] == Counter({(TaskStatus.DONE, 1, "ok", "model=sim/noop"): 8})
    )
    assert bare["events"] == Counter({(None, TaskStatus.QUEUED, "enqueue", True): 8})
    assert bare["routes"] == Counter() and bare["calls"] is None
    assert ours["calls"] == 8


@pytest.mark.parametrize("both", [False, True], ids=["as-they-come", "both-at-once"])
def test_one_committer_writes_what_the_steady_state_writes(db: Database, both: bool) -> None:
    """Two processes whose turns one more process commits leave the rows a worker's
    steady state leaves; waiting for both, every turn carries both requests."""
    floor = script("floor")
    url = db.engine.url.render_as_string(hide_password=False)
    if db.dialect != "sqlite":
        with pytest.raises(ValueError, match="SQLite's"):
            floor.one_committer(url, 2, 5, 0, both=both)
        return
    rate, cpu, held = floor.one_committer(url, 2, 12, 5, both=both)
    assert rate > 0 and cpu > 0
    assert held.startswith("writers' turn ") and held.endswith(" requests a turn")
    if both:  # 6 turns claiming two tasks each, then one finding none for either
        assert held.endswith("; 2.00 requests a turn")
    assert written(db, floor_agent(db)) == steady_written(db, 12)
