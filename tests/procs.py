"""Entry points for tests that run queue code in separate OS processes."""

from __future__ import annotations

from multiprocessing.synchronize import Event

from agentbus.db import Database
from agentbus.queue import TaskQueue


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
    from agentbus.queue.tasks import TaskSpec

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


def reserve_one(url: str, holder: str, name: str, start: Event) -> str:
    """Reserve ``name`` in an enforce-mode workspace budget of 1 once ``start`` is set."""
    from agentbus.admission.budget import WorkspaceBudget

    db = Database(url)  # the test set the workspace's budget: enforce, size 1
    budget = WorkspaceBudget(db, holder=holder)
    start.wait()
    answer = budget.try_reserve(name).value
    db.dispose()
    return answer


def reserve_many(url: str, holder: str, names: list[str], start: Event) -> list[str]:
    """Reserve ``names`` one after another in a warn-mode budget of 8 (hysteresis races)."""
    from agentbus.admission.budget import WorkspaceBudget

    db = Database(url)  # the test set the workspace's budget: warn, size 8
    budget = WorkspaceBudget(db, holder=holder)
    start.wait()
    answers = [budget.try_reserve(name).value for name in names]
    db.dispose()
    return answers
