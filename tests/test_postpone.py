"""The sweeper's postponement of paused tasks: many tasks, a few new times, and two
sweepers at once."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from agentbus.queue import TaskQueue
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands
from tests.support import FakeClock


def spec() -> TaskSpec:
    return TaskSpec(agent="codex", command="do it", models=("sim/a",))


def _paused(queue: TaskQueue, clock: FakeClock, n: int) -> list[int]:
    queue.enqueue_many([spec()] * n)
    ids = []
    for task in queue.claim("codex", "w", 30, n):
        queue.pause(task.id, task.claim_token, clock.now + 10, "cooldown", model="sim/a")
        ids.append(task.id)
    return ids


def test_a_postponement_moves_each_paused_task_to_its_own_time(
    queue: TaskQueue, clock: FakeClock
) -> None:
    """Many tasks, a few new times (one statement each): each task gets its own, and a
    task no longer paused is left as it is."""
    ids = _paused(queue, clock, 6)
    queue.resume([ids[5]])
    times = {i: clock.now + 20 + (i % 3) for i in ids}
    assert queue.postpone(times, "no room") == ids[:5]
    for i in ids[:5]:
        task = queue.get(i)
        assert (task.status, task.resume_after) == (TaskStatus.PAUSED, times[i])
        assert (
            queue.db.read(
                lambda conn, i=i: conn.execute(
                    sa.select(bus_commands.c.pause_reason).where(bus_commands.c.id == i)
                ).scalar()
            )
            == "no room"
        )
    assert queue.get(ids[5]).status is TaskStatus.QUEUED


@pytest.mark.parametrize("backend", ["postgresql"])
def test_a_postponement_passes_over_a_task_another_sweeper_holds(
    queue: TaskQueue, clock: FakeClock
) -> None:
    """Two sweepers postponing the same tasks: a task locked by the other's transaction
    is left to it, with no wait (waiting, two of them deadlocked over thousands of tasks)."""
    ids = _paused(queue, clock, 3)
    with queue.db.engine.connect() as other:
        other.execute(
            sa.select(bus_commands.c.id).where(bus_commands.c.id == ids[1]).with_for_update()
        )
        moved = queue.postpone(dict.fromkeys(ids, clock.now + 99), "no room")
        other.rollback()
    assert moved == [ids[0], ids[2]]
    assert [queue.get(i).resume_after for i in ids] == [
        clock.now + 99,
        clock.now + 10,
        clock.now + 99,
    ]
