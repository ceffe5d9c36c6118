"""The producer API an orchestrator uses."""

from __future__ import annotations

import pytest

from agentbus.client import AgentBus, WaitTimeout
from agentbus.errors import NotMigrated
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import InvalidTask


def test_enqueue_and_wait_for_the_result(db_url: str) -> None:
    with AgentBus(db_url) as bus:
        task_id = bus.enqueue("codex", "write it", models=["sim/a"], payload={"x": 1}, key="k")
        assert bus.enqueue("codex", "write it", models=["sim/a"], key="k") == task_id
        with pytest.raises(WaitTimeout, match="still queued"):
            bus.wait(task_id, timeout=0, poll=0)
        worker = TaskQueue(bus.db)
        (task,) = worker.claim("codex", "w", 30)
        worker.complete(task.id, task.claim_token, "the answer")
        done = bus.wait(task_id, timeout=5, poll=0)
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
