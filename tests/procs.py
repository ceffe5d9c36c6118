"""Entry points for tests that run queue code in separate OS processes."""

from __future__ import annotations

from multiprocessing.synchronize import Event

from shared.db import Database
from shared.queue import TaskQueue


def claim_and_complete(url: str, agent: str, worker: str, start: Event, batch: int) -> int:
    """Claim and complete tasks until the queue is empty; returns how many were done."""
    db = Database(url)
    queue = TaskQueue(db)
    done = 0
    start.wait()
    while True:
        tasks = queue.claim(agent, worker, lease_sec=60, limit=batch)
        if not tasks:
            break
        for task in tasks:
            queue.complete(task.id, task.claim_token, "ok", worker=worker)
            done += 1
    db.dispose()
    return done


def hammer(url: str, agent: str, rounds: int, busy_timeout_ms: int, start: Event) -> int:
    """Enqueue, claim and complete ``rounds`` tasks as fast as possible; returns how many."""
    from shared.tasks import TaskSpec

    db = Database(url, sqlite_busy_timeout_ms=busy_timeout_ms, retry_for=60)
    queue = TaskQueue(db)
    start.wait()
    done = 0
    for i in range(rounds):
        queue.enqueue(TaskSpec(agent=agent, command=str(i), models=("sim/a",)))
        for task in queue.claim(agent, agent, 30):
            queue.complete(task.id, task.claim_token, "ok")
            done += 1
    db.dispose()
    return done
