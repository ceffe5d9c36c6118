"""The task counts the triggers keep (``task_counts``) are the table's own: after every
kind of change, by the API, by several server processes at once and by hand in SQL,
they equal a ``GROUP BY`` over ``bus_commands``."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
import sqlalchemy as sa

from agentbus.admin import observe
from agentbus.admission import workspace_events
from agentbus.db import Database
from agentbus.queue import Settlement, TaskQueue, counts, reads, retention
from agentbus.queue.decisions import Complete, Fail, Pause
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import task_counts
from tests.shown_counts import grouped
from tests.support import FakeClock

AGENTS = ("a", "b", "c")


def churn(queue: TaskQueue, clock: FakeClock, rng: random.Random, rounds: int) -> None:
    """Enqueues, claims and every way a claim is settled, cancels, retries and resumes."""
    for _ in range(rounds):
        agent = rng.choice(AGENTS)
        queue.enqueue_many([TaskSpec(agent=agent, command="x")] * rng.randint(1, 5))
        claimed = queue.claim(agent, "w", 30, rng.randint(1, 4))
        settled = []
        for task in claimed:
            decision = rng.choice(
                [Complete("ok"), Fail("no", True), Pause(clock.now + 5, "sim/a", "cooling")]
            )
            settled.append(Settlement(task.id, task.claim_token, decision))
        queue.settle_and_claim(settled, agent, "w", 30, 0)
        paused = queue.due_pauses(50)
        queue.resume([p.id for p in paused][: rng.randint(0, 3)])
        ended = [task.id for task in claimed]
        queue.cancel(ended[:1], by="test")
        for task_id in ended[1:2]:
            if queue.get(task_id).status.value in ("failed", "cancelled"):
                queue.retry(task_id)


def test_the_counts_follow_every_change(queue: TaskQueue, clock: FakeClock) -> None:
    """Enqueues, claims, completions, failures, pauses, resumes, cancels and retries,
    then rescues of expired leases, retention, and changes by hand: the counts stay the
    table's; the sweeper's fold changes none of them."""
    rng = random.Random(7)
    churn(queue, clock, rng, 40)
    assert reads.counts(queue.db) == grouped(queue.db)
    queue.claim("a", "w", 1, 3)
    clock.advance(5)
    queue.rescue_expired(limit=100, rescue_limit=3)
    retention.prune(queue.db, clock.now + 100, done_sec=50, failed_sec=50, batch=7)
    assert reads.counts(queue.db) == grouped(queue.db)
    queue.db.write(
        lambda conn: conn.execute(
            sa.text(
                "UPDATE bus_commands SET agent = 'z' WHERE id IN "
                "(SELECT id FROM bus_commands ORDER BY id LIMIT 5)"
            )
        )
    )
    queue.db.write(lambda conn: conn.execute(sa.text("UPDATE bus_commands SET lease_until = 1")))
    queue.db.write(
        lambda conn: conn.execute(
            sa.text("DELETE FROM bus_commands WHERE id IN (SELECT MAX(id) FROM bus_commands)")
        )
    )
    assert reads.counts(queue.db) == grouped(queue.db)
    counts.fold(queue.db)
    assert reads.counts(queue.db) == grouped(queue.db)
    assert sum(reads.counts(queue.db).values()) > 0


@pytest.mark.parametrize("backend", ["postgresql"])
def test_server_processes_count_apart_and_the_fold_adds_them_up(
    queue: TaskQueue, clock: FakeClock, db_url: str
) -> None:
    """Four threads change tasks at once, each on its own connection, while folds run:
    each server process counted into its own rows, none waited on another's (no
    deadlock), and the counts are the table's, before and after the last fold, which
    leaves shard 0 alone."""
    failures: list[BaseException] = []

    def work(seed: int) -> None:
        own = Database(db_url)
        try:
            churn(TaskQueue(own, clock=clock), clock, random.Random(seed), 15)
        except BaseException as exc:
            failures.append(exc)
        finally:
            own.dispose()

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        counts.fold(queue.db)
    for thread in threads:
        thread.join()
    assert not failures, failures
    work(4)  # one more server process's count rows, left for the fold below
    churn(queue, clock, random.Random(5), 1)
    assert reads.counts(queue.db) == grouped(queue.db)
    shards = queue.db.read(
        lambda conn: conn.execute(sa.select(task_counts.c.shard).distinct()).scalars().all()
    )
    assert len([shard for shard in shards if shard != 0]) >= 2, shards
    counts.fold(queue.db)
    assert reads.counts(queue.db) == grouped(queue.db)
    shards = queue.db.read(
        lambda conn: conn.execute(sa.select(task_counts.c.shard).distinct()).scalars().all()
    )
    assert shards == [0]


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_truncate_empties_the_counts(queue: TaskQueue) -> None:
    queue.enqueue_many([TaskSpec(agent="a", command="x")] * 3)
    assert reads.counts(queue.db) == Counter({("queued", "a"): 3})
    queue.db.write(lambda conn: conn.exec_driver_sql("TRUNCATE bus_commands"))
    assert reads.counts(queue.db) == Counter()


def test_the_next_task_due_is_what_each_agents_workers_claim_next(
    queue: TaskQueue, clock: FakeClock
) -> None:
    """Status's ``oldest_queued_age``: since when each agent's next task has been due;
    tasks not yet due, and agents with none due, are left out."""
    queue.enqueue(TaskSpec(agent="a", command="first"))
    clock.advance(20)
    queue.enqueue(TaskSpec(agent="a", command="second"))
    queue.enqueue(TaskSpec(agent="b", command="later", delay_sec=600))
    clock.advance(10)
    seen = queue.db.read(lambda conn: observe.observe(conn, clock.now, 60))
    assert seen["oldest_queued_age"] == {"a": 30.0}


def test_the_budgets_refusals_are_counted_as_their_events_are_written(db: Database) -> None:
    """``budget_refused``: the names each refused_batch event refused, added up by a
    trigger; other events and an event without a count add nothing."""
    details = [("refused_batch", {"count": 2}), ("refused_batch", {"count": 3})]
    details += [("budget_warning", {"count": 7}), ("refused_batch", {"names": []})]
    for kind, detail in details:
        db.write(lambda conn, k=kind, d=detail: workspace_events.emit(conn, k, 1.0, detail=d))
    seen = db.read(lambda conn: observe.observe(conn, 1.0, 60))
    assert seen["counters"]["budget_refused"] == {"": 5}
