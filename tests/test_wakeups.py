"""Waking idle workers: PostgreSQL notifies on enqueue, SQLite workers poll adaptively."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue, wakeups
from agentbus.queue.decisions import Complete, Settlement
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec
from tests.conftest import direct_conninfo
from tests.support import FakeClock, Proc, wait_until


def test_has_due_sees_only_due_queued_tasks_of_the_agent(db: Database) -> None:
    clock = FakeClock()
    queue = TaskQueue(db, clock=clock)
    assert not queue.has_due("codex")
    queue.enqueue(TaskSpec(agent="ron", command="x", models=("sim/a",)))
    later = TaskSpec(agent="codex", command="x", models=("sim/a",), delay_sec=10)
    queue.enqueue(later)
    assert not queue.has_due("codex")  # another agent's, and one not due yet
    clock.advance(10)
    assert queue.has_due("codex")
    assert len(queue.claim("codex", "w", 30)) == 1
    assert not queue.has_due("codex")  # claimed: no longer queued


def test_due_in_is_the_wait_for_the_earliest_queued_task_of_the_agent(db: Database) -> None:
    clock = FakeClock()
    queue = TaskQueue(db, clock=clock)
    assert queue.due_in("codex") is None  # nothing queued
    queue.enqueue(TaskSpec(agent="ron", command="x", models=("sim/a",)))
    queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",), delay_sec=30))
    queue.enqueue(TaskSpec(agent="codex", command="y", models=("sim/a",), delay_sec=10))
    assert queue.due_in("codex") == pytest.approx(10)  # the earlier of its two, not ron's
    clock.advance(12)
    assert queue.due_in("codex") == pytest.approx(-2)  # overdue
    assert len(queue.claim("codex", "w", 30)) == 1
    assert queue.due_in("codex") == pytest.approx(18)  # claimed: the other one is next


def test_an_idle_worker_claims_a_task_when_it_is_due_not_at_its_next_poll(
    db: Database, db_url: str, spawn: Callable[..., Proc]
) -> None:
    """A worker polling once a minute, idle (its first task done) and, on PostgreSQL,
    listening, claims a task queued with a delay when it is due: the enqueue's
    notification wakes it while the task is not due yet, and it looks again when the
    task is (as it must for a task stamped by a clock a little ahead of the worker's).
    Through a pooler, with no listen_url, it cannot listen: its looks find the task."""
    queue = TaskQueue(db)
    worker = spawn("worker", "--agent", "codex", "--db", db_url, "--poll", "60")
    first = queue.enqueue(TaskSpec(agent="codex", command="now", models=("sim/noop",))).id
    wait_until(lambda: queue.get(first).status == TaskStatus.DONE)  # acknowledged: idle now
    if db.listen_conninfo is not None:  # its listener is in place, whatever its start took
        listening = sa.text(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND query = :listen"
        )
        listen = {"listen": f"LISTEN {wakeups.CHANNEL}"}
        wait_until(lambda: db.read(lambda conn: conn.execute(listening, listen).scalar()))
    soon = TaskSpec(agent="codex", command="delayed", models=("sim/noop",), delay_sec=1.0)
    later = queue.enqueue(soon).id
    # Well before the next poll (60 s): what the worker's wake-ups did, not its polling.
    wait_until(lambda: queue.get(later).status == TaskStatus.DONE, timeout=30)
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0


def test_an_enqueue_wakes_the_listener_of_its_agent(db: Database, db_url: str) -> None:
    queue = TaskQueue(db)
    if db.dialect == "sqlite":  # no notification (the workers poll): enqueue as ever
        task_id = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",))).id
        assert queue.get(task_id).status == "queued"
        return
    wake, other = threading.Event(), threading.Event()
    # Through a pooler, the notifications of the pooled statements reach a listener on
    # the direct URL (listen_url).
    url = direct_conninfo(db_url)
    listeners = [
        wakeups.Listener(url, wake.set, payload="codex").start(),
        wakeups.Listener(url, other.set, payload="ron").start(),
    ]
    try:
        assert wake.wait(30) and other.wait(30)  # connected (each wakes once on connect)
        wake.clear(), other.clear()
        queue.enqueue(TaskSpec(agent="ron", command="x", models=("sim/a",)))
        assert other.wait(30)  # the notification came…
        assert not wake.is_set()  # …to ron's listener only
        queue.enqueue_many([TaskSpec(agent="codex", command="y", models=("sim/a",))])
        assert wake.wait(30)
        # A task back on the queue wakes its agent too: a sweeper's resume, a retry.
        (task,) = queue.claim("ron", "w", 30)
        queue.pause(task.id, task.claim_token, 0.0, "cooldown")
        other.clear()
        assert queue.resume([task.id]) == [task.id]
        assert other.wait(30)
        (task,) = queue.claim("ron", "w", 30)
        queue.fail(task.id, task.claim_token, "boom")
        other.clear()
        queue.retry(task.id)
        assert other.wait(30)
    finally:
        for listener in listeners:
            listener.close(wait=5.0)  # closed before the test's database is dropped


@pytest.mark.parametrize("agents", [("a",), ("a", "b", "a")])
def test_notify_is_one_statement_per_agent(db: Database, agents: tuple[str, ...]) -> None:
    sent: list[object] = []

    class Recorder:
        dialect = db.engine.dialect

        def execute(self, statement: object, params: object) -> None:
            sent.append(params)

    wakeups.notify(Recorder(), agents)  # type: ignore[arg-type]
    expected = [{"agent": a} for a in sorted(set(agents))] if db.dialect == "postgresql" else []
    assert sent == expected


def test_a_settle_notifies_only_while_a_producer_listens(db: Database, db_url: str) -> None:
    """A task's end is notified (``agentbus_settled``) while a producer's listener keeps
    its row, and not before or after: a notifying commit waits for every other one."""
    queue = TaskQueue(db)
    queue.enqueue_many(
        [TaskSpec(agent="codex", command=str(i), models=("sim/a",)) for i in range(6)]
    )

    def claimed() -> tuple[int, int]:
        (task,) = queue.claim("codex", "w", 30)
        return task.id, task.claim_token

    def complete_alone() -> None:
        task_id, token = claimed()
        queue.complete(task_id, token, "ok")
        assert queue.get(task_id).status == TaskStatus.DONE

    def complete_in_steady_state() -> None:
        task_id, token = claimed()
        ack = Settlement(task_id, token, Complete("ok"))
        assert queue.settle_and_claim([ack], "codex", "w", 30, 0) == ([], [])
        assert queue.get(task_id).status == TaskStatus.DONE

    settles = (complete_alone, complete_in_steady_state)
    if db.dialect == "sqlite":  # nothing to notify (producers look): settles as ever
        for settle in settles:
            settle()
        return
    import psycopg

    url = direct_conninfo(db_url)
    with psycopg.connect(url, autocommit=True) as spy:
        spy.execute(f"LISTEN {wakeups.ENDED}")
        spy.execute("LISTEN test_marker")

        def heard_settled() -> bool:
            """Whether ``agentbus_settled`` came before a marker sent now: a listener
            hears notifications in their transactions' commit order."""
            with psycopg.connect(url, autocommit=True) as other:
                other.execute("NOTIFY test_marker")
            heard = False
            for note in spy.notifies(timeout=30):
                if note.channel == "test_marker":
                    return heard
                heard = heard or note.channel == wakeups.ENDED
            raise AssertionError("the marker never came")

        for settle in settles:
            settle()
            assert not heard_settled()  # nobody registered: no notification
        registered = threading.Event()
        listener = wakeups.Listener(
            url, registered.set, channel=wakeups.ENDED, register=True
        ).start()
        try:
            assert registered.wait(30)  # it wakes its owner once its row is written
            for settle in settles:
                settle()
                assert heard_settled()
        finally:
            listener.close(wait=5.0)
        with psycopg.connect(url) as conn:  # gone, and its row with it
            assert conn.execute("SELECT count(*) FROM settle_listeners").fetchone() == (0,)
        for settle in settles:
            settle()
            assert not heard_settled()


def test_a_worker_polling_through_a_pooler_looks_less_often_the_longer_it_idles() -> None:
    """Looks every LOOK_SEC while tasks flow and just after; then ever less often, to at
    most one a POOLED_LOOK_MAX_SEC; claims without a look's finding are rarer still.
    A worker that hears notifications, or on SQLite, keeps its fixed cadence."""
    fast = [wakeups.look_sec(t, pooled=True) for t in (0.0, 1.0, wakeups.POOLED_FAST_SEC)]
    assert fast == [wakeups.LOOK_SEC] * 3
    later = [wakeups.look_sec(wakeups.POOLED_FAST_SEC + t, pooled=True) for t in (1, 4, 8, 60)]
    assert later == sorted(later) and later[0] > wakeups.LOOK_SEC
    assert later[-1] == wakeups.POOLED_LOOK_MAX_SEC == 1.0
    assert wakeups.look_sec(3600.0, pooled=False) == wakeups.LOOK_SEC
    assert wakeups.claim_every(1.0, pooled=True) == wakeups.POOLED_CLAIM_SEC
    assert wakeups.claim_every(1.0, pooled=False) == 1.0
    assert wakeups.claim_every(30.0, pooled=True) == 30.0  # a longer poll_sec stands


def test_the_replicas_of_an_agent_share_its_looks_through_a_pooler() -> None:
    """Five idle workers of one agent each look, and claim unbidden, five times less
    often: the agent's queue is looked at about once a POOLED_LOOK_MAX_SEC however many
    replicas wait on it (each at least once a POOLED_CLAIM_SEC); the fast looks after a
    task stay fast."""
    quiet = wakeups.POOLED_FAST_SEC + 60
    assert wakeups.look_sec(quiet, pooled=True, peers=5) == 5 * wakeups.POOLED_LOOK_MAX_SEC
    assert wakeups.look_sec(quiet, pooled=True, peers=0) == wakeups.POOLED_LOOK_MAX_SEC
    assert wakeups.look_sec(quiet, pooled=True, peers=500) == wakeups.POOLED_CLAIM_SEC
    assert wakeups.look_sec(1.0, pooled=True, peers=5) == wakeups.LOOK_SEC
    assert wakeups.look_sec(quiet, pooled=False, peers=5) == wakeups.LOOK_SEC
    assert [wakeups.jittered(4.0, d) for d in (0.0, 0.5, 0.999)] == [2.0, 4.0, 5.996]
    assert wakeups.claim_every(1.0, pooled=True, peers=5) == 5 * wakeups.POOLED_CLAIM_SEC
    assert wakeups.claim_every(1.0, pooled=False, peers=5) == 1.0


def test_a_heartbeat_counts_the_idle_workers_of_its_agent(db: Database, clock: FakeClock) -> None:
    """Registered, running nothing and heard from lately: counted; running a task, silent
    for PEER_SILENT_SEC, or of another agent: not."""
    from agentbus.queue.workers import PEER_SILENT_SEC, WorkerRegistry

    me, idle, busy, silent = (
        WorkerRegistry(db, name, "codex", clock=clock) for name in ("me", "idle", "busy", "silent")
    )
    other = WorkerRegistry(db, "other", "analyst", clock=clock)
    for registry in (silent, me, idle, busy, other):
        registry.register()
        if registry is silent:
            clock.advance(PEER_SILENT_SEC + 1)
    busy.running[7] = None
    busy.beat()
    assert me.idle_peers == 1  # none read yet
    me.beat()
    assert me.idle_peers == 2  # itself and "idle"
    idle.running[8] = None
    idle.beat()
    me.beat()
    assert me.idle_peers == 1
