"""The producer API an orchestrator uses."""

from __future__ import annotations

import asyncio
import threading
import time
from datetime import UTC, datetime, timedelta

import pytest

from agentbus import AsyncAgentBus
from agentbus.client import AgentBus
from agentbus.errors import InvalidTask, NotMigrated, TaskNotFound, WaitTimeout
from agentbus.queue import TaskQueue, reads
from agentbus.queue.states import TaskStatus
from tests.support import own_engine


def test_enqueue_and_wait_for_the_result(db_url: str) -> None:
    with AgentBus(db_url) as bus:
        task_id = bus.enqueue("codex", "write it", models=["sim/a"], payload={"x": 1}, key="k")
        assert bus.enqueue("codex", "write it", models=["sim/a"], key="k") == task_id
        with pytest.raises(WaitTimeout, match=f"tasks still running: {task_id}"):
            bus.wait(task_id, timeout=0)
        worker = TaskQueue(bus.db)
        (task,) = worker.claim("codex", "w", 30)
        worker.complete(task.id, task.claim_token, "the answer")
        done = bus.wait(task_id, timeout=5)
        assert (done.status.value, done.result, done.payload) == ("done", "the answer", {"x": 1})


def test_bad_input_and_unmigrated_database(db_url: str, empty_db_url: str) -> None:
    with AgentBus(db_url) as bus, pytest.raises(InvalidTask, match="model chain"):
        bus.enqueue("codex", "x")
    with pytest.raises(NotMigrated):
        AgentBus(empty_db_url)


def test_bounded_input_is_refused_with_one_line_and_nothing_written(db_url: str) -> None:
    deep: dict[str, object] = {}
    cur = deep
    for _ in range(5_000):
        cur["a"] = cur = {}
    with AgentBus(db_url) as bus:
        cases = [
            ({"payload": deep}, "nests deeper than 1000 levels"),
            (
                {
                    "payload": {
                        "a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]
                    }
                },
                "setting max_payload_depth",
            ),
            ({"payload": {"a": "x" * 1_100_000}}, "setting max_payload_bytes"),
            ({"payload": {"a": "\udc80"}}, "payload is not valid Unicode"),
            ({"delay_sec": 1e300}, "ten years"),
            ({"key": "k\udc80"}, "idempotency key is not valid Unicode"),
        ]
        for kwargs, message in cases:
            with pytest.raises(InvalidTask, match=message):
                bus.enqueue("codex", "x", models=["sim/a"], **kwargs)  # type: ignore[arg-type]
        with pytest.raises(InvalidTask, match="task text is not valid Unicode"):
            bus.enqueue("codex", "bad \udc80", models=["sim/a"])
        assert reads.counts(bus.db) == {}


def test_enqueue_many_is_one_transaction_that_honours_keys(db_url: str) -> None:
    with AgentBus(db_url) as bus:
        known = bus.enqueue("codex", "first", models=["sim/a"], key="k1")
        ids = bus.enqueue_many(
            [
                {"agent": "codex", "text": "a", "models": ["sim/a"]},
                {"agent": "codex", "text": "again", "models": ["sim/a"], "key": "k1"},
                {"agent": "ron", "text": "b", "role": None, "models": ["sim/b"], "key": "k2"},
            ]
        )
        assert ids[1] == known and len(set(ids)) == 3
        assert [bus.get(i).command for i in ids] == ["a", "first", "b"]
        before = reads.counts(bus.db)
        with pytest.raises(InvalidTask, match="unknown task field 'colour'"):
            bus.enqueue_many([{"agent": "codex", "text": "c", "models": ["sim/a"]}, {"colour": 1}])
        with pytest.raises(InvalidTask, match="task text is empty"):
            bus.enqueue_many(
                [
                    {"agent": "codex", "text": "c", "models": ["sim/a"], "key": "k3"},
                    {"agent": "codex", "text": " ", "models": ["sim/a"]},
                ]
            )
        assert reads.counts(bus.db) == before  # all or nothing


def test_run_at_list_cancel_resume_and_retry(db_url: str) -> None:
    with AgentBus(db_url, by="orchestrator") as bus:
        later = datetime.now(UTC) + timedelta(hours=1)
        first = bus.enqueue("codex", "later", models=["sim/a"], run_at=later)
        assert bus.get(first).runs_after == pytest.approx(later, abs=timedelta(seconds=1))
        assert bus.get(first).created is not None and bus.get(first).status is TaskStatus.QUEUED
        with pytest.raises(InvalidTask, match="timezone-aware"):
            bus.enqueue("codex", "x", models=["sim/a"], run_at=datetime(2030, 1, 1))
        second = bus.enqueue("codex", "now", models=["sim/a"])
        assert [t.id for t in bus.list(agent="codex", status="queued")] == [second, first]
        assert bus.cancel(first, second) == [first, second]
        assert bus.cancel(first) == []
        last = reads.task_events(bus.db, first)[-1]
        assert (last["to_status"], last["worker"]) == ("cancelled", "orchestrator")
        assert bus.wait(first, timeout=0).status is TaskStatus.CANCELLED  # an end
        bus.retry(first)
        assert bus.get(first).status is TaskStatus.QUEUED
        worker = TaskQueue(bus.db)
        (task,) = worker.claim("codex", "w", 30)
        worker.pause(task.id, task.claim_token, time.time() + 3600, "cooldown")
        assert bus.resume(task.id) == [task.id] and bus.get(task.id).status is TaskStatus.QUEUED
        with pytest.raises(TaskNotFound):
            bus.wait(424242, timeout=0)


def test_enqueue_in_the_callers_transaction(db_url: str) -> None:
    with AgentBus(db_url) as bus:
        engine = own_engine(db_url)
        with engine.connect() as conn:
            with conn.begin() as outer:
                dropped = bus.enqueue("codex", "dropped", models=["sim/a"], connection=conn)
                outer.rollback()
            with conn.begin():
                kept = bus.enqueue_many(
                    [{"agent": "codex", "text": "kept", "models": ["sim/a"], "key": "t1"}],
                    connection=conn,
                )[0]
        engine.dispose()
        assert dropped > 0 and bus.get(kept).command == "kept"
        # The rolled-back task left nothing (SQLite may even give its id to the next one).
        assert [t.command for t in bus.list()] == ["kept"]
        assert reads.counts(bus.db) == {("queued", "codex"): 1}


def test_wait_many_returns_when_the_tasks_settle(db_url: str) -> None:
    """A worker thread settles the tasks only once the waiter is waiting (it holds them
    until the waiter's first look), so the wait is what returns them."""
    with AgentBus(db_url) as bus:
        ids = bus.enqueue_many(
            [{"agent": "codex", "text": str(i), "models": ["sim/a"]} for i in range(3)]
        )
        looked = threading.Event()
        real = bus.ended_among

        def spy(task_ids: list[int]) -> dict[int, object]:
            found = real(task_ids)
            looked.set()
            return found  # type: ignore[return-value]

        bus.ended_among = spy  # type: ignore[method-assign]

        def work() -> None:
            looked.wait(30)
            queue = TaskQueue(bus.db)
            tasks = queue.claim("codex", "w", 30, limit=3)
            queue.complete(tasks[0].id, tasks[0].claim_token, "one")
            queue.fail(tasks[1].id, tasks[1].claim_token, "two")
            bus.cancel(tasks[2].id)

        thread = threading.Thread(target=work)
        thread.start()
        done = bus.wait_many(ids, timeout=60)
        thread.join()
        assert [t.status for t in done] == [
            TaskStatus.DONE,
            TaskStatus.FAILED,
            TaskStatus.CANCELLED,
        ]


def test_the_async_client_has_the_same_methods(db_url: str) -> None:
    async def main() -> list[TaskStatus]:
        async with AsyncAgentBus(db_url) as bus:
            first = await bus.enqueue("codex", "a", models=["sim/a"])
            (second,) = await bus.enqueue_many(
                [{"agent": "codex", "text": "b", "models": ["sim/a"]}]
            )
            assert [t.id for t in await bus.list(agent="codex")] == [second, first]
            assert await bus.cancel(second) == [second]
            waiting = asyncio.create_task(bus.wait_many([first, second], timeout=60))
            await asyncio.sleep(0)  # the wait has begun; now a worker finishes the first
            queue = TaskQueue(bus.sync.db)
            (task,) = await asyncio.to_thread(queue.claim, "codex", "w", 30)
            await asyncio.to_thread(queue.complete, task.id, task.claim_token, "ok")
            return [t.status for t in await waiting]

    assert asyncio.run(main()) == [TaskStatus.DONE, TaskStatus.CANCELLED]
