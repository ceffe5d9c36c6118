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
