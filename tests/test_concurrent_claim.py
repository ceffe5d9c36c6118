"""Exactly-once claiming with real OS processes racing on one database."""

from __future__ import annotations

import multiprocessing as mp
from collections import Counter
from concurrent.futures import ProcessPoolExecutor

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands, task_events
from tests.procs import claim_and_complete

TASKS = 2000
PROCESSES = 4


@pytest.mark.process
@pytest.mark.parametrize("batch", [1, 10])
def test_four_processes_claim_every_task_exactly_once(
    db: Database, db_url: str, batch: int
) -> None:
    queue = TaskQueue(db)
    specs = [TaskSpec(agent="racer", command=f"t{i}", models=("sim/a",)) for i in range(TASKS)]
    ids = queue.enqueue_many(specs)
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(PROCESSES, mp_context=ctx) as pool:
        start = manager.Event()
        futures = [
            pool.submit(claim_and_complete, db_url, "racer", f"w{i}", start, batch)
            for i in range(PROCESSES)
        ]
        start.set()
        per_worker = [f.result(timeout=300) for f in futures]

    assert sum(per_worker) == TASKS
    with db.engine.connect() as conn:
        claims = conn.execute(
            sa.select(task_events.c.task_id, task_events.c.worker).where(
                task_events.c.to_status == "claimed"
            )
        ).all()
        done = (
            conn.execute(sa.select(task_events.c.task_id).where(task_events.c.to_status == "done"))
            .scalars()
            .all()
        )
        statuses = Counter(conn.execute(sa.select(bus_commands.c.status)).scalars())
    claim_counts = Counter(task_id for task_id, _ in claims)
    assert set(claim_counts) == set(ids)
    assert set(claim_counts.values()) == {1}, "a task was claimed twice"
    assert sorted(done) == sorted(ids)
    assert statuses == {"done": TASKS}
    # Every claim event was written by the worker that completed the task.
    by_worker = Counter(worker for _, worker in claims)
    assert sorted(by_worker.values(), reverse=True) == sorted(
        (n for n in per_worker if n), reverse=True
    )
