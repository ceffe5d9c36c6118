"""Latencies the bench prints: a paused task's resume after its cooldown ends, an
idle worker's claim after an enqueue, a producer's wait after a settle."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from agentbus.client import AgentBus
from agentbus.config import Settings
from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec


def resume(url: str, synchronous: str, tasks: int = 20) -> list[tuple[str, str]]:
    """How long after its cooldown ends a paused task is back on the queue.

    A worker pauses ``tasks`` tasks on a 2 s cooldown; a sweeper service (60 s
    interval, default peek) resumes them; the latency is the resume event's time
    minus the pause's resume_after, from the event log.
    """
    db = Database(url, sqlite_synchronous=synchronous)
    queue = TaskQueue(db)
    script = {"simulate": {"sim/lat": {"behaviour": "rate_limited", "for_s": 5.0}}}
    ids = queue.enqueue_many(
        [
            TaskSpec(agent="latency", command=str(i), models=("sim/lat",), payload=script)
            for i in range(tasks)
        ]
    )
    env = {
        **os.environ,
        "AGENTBUS_DATABASE_URL": url,
        "AGENTBUS_MODEL_COOLDOWN_SEC": "2",
        "AGENTBUS_POLL_SEC": "0.1",
        "AGENTBUS_SQLITE_SYNCHRONOUS": synchronous,
    }
    bindir = Path(sys.executable).parent
    procs = [
        subprocess.Popen(
            [str(bindir / "worker"), "--agent", "latency"], env=env, stderr=subprocess.DEVNULL
        ),
        subprocess.Popen(
            [str(bindir / "sweeper"), "--interval", "60"], env=env, stderr=subprocess.DEVNULL
        ),
    ]
    deadline = time.time() + 60
    while time.time() < deadline and any(queue.get(i).status != "done" for i in ids):
        time.sleep(0.2)
    for p in procs:
        p.terminate()
        p.wait()
    lags = []
    for task_id in ids:
        paused_until = None
        for event in reads.task_events(db, task_id):
            if event["to_status"] == "paused":
                paused_until = event["detail"]["resume_after"]
            elif event["reason"] == "resume" and paused_until is not None:
                lags.append(event["at"] - paused_until)
    db.dispose()
    lags.sort()
    if not lags:
        return [("resume latency after cooldown end", "no resume observed")]
    return [
        (
            f"resume latency after cooldown end ({len(lags)} resumes), median / max",
            f"{lags[len(lags) // 2] * 1000:,.0f} / {lags[-1] * 1000:,.0f} ms",
        )
    ]


def wakeup(
    url: str, synchronous: str, tasks: int = 20, env: dict[str, str] | None = None
) -> list[tuple[str, str]]:
    """How soon an idle worker claims a task after its enqueue (PostgreSQL: notified;
    SQLite, or through a pooler with no ``listen_url``: adaptive polling). One
    ``worker`` with the default ``poll_sec`` (and ``env``); tasks are enqueued one at a
    time, 0.2 to 1.5 s apart (so they land anywhere in a poll); the latency is the
    claim event's time minus the enqueue event's."""
    db = Database(url, sqlite_synchronous=synchronous)
    queue = TaskQueue(db)
    env = {
        **os.environ,
        "AGENTBUS_DATABASE_URL": url,
        "AGENTBUS_SQLITE_SYNCHRONOUS": synchronous,
        **(env or {}),
    }
    worker = subprocess.Popen(
        [str(Path(sys.executable).parent / "worker"), "--agent", "wake"],
        env=env,
        stderr=subprocess.DEVNULL,
    )
    while "wake" not in reads.live_agents(db):
        time.sleep(0.05)
    time.sleep(2.0)  # idle for a while: the worker polls at poll_sec by now
    ids = []
    for i in range(tasks):
        ids.append(queue.enqueue(TaskSpec(agent="wake", command=str(i), models=("sim/noop",))).id)
        time.sleep(0.2 + (i * 0.37) % 1.3)
    deadline = time.time() + 30
    while time.time() < deadline and any(queue.get(i).status != "done" for i in ids):
        time.sleep(0.1)
    worker.terminate()
    worker.wait()
    lags = []
    for task_id in ids:
        at = {e["reason"]: e["at"] for e in reads.task_events(db, task_id)}
        if "claim" in at:
            lags.append(at["claim"] - at["enqueue"])
    db.dispose()
    lags.sort()
    if not lags:
        return [("enqueue-to-claim latency, idle worker", "no claim observed")]
    p95 = lags[min(len(lags) - 1, round(len(lags) * 0.95) - 1)]
    return [
        (
            f"enqueue-to-claim latency, idle worker ({len(lags)} tasks), p50 / p95 / max",
            f"{lags[len(lags) // 2] * 1000:,.0f} / {p95 * 1000:,.0f} / {lags[-1] * 1000:,.0f} ms",
        )
    ]


def wait(url: str, synchronous: str, tasks: int = 20) -> list[tuple[str, str]]:
    """How soon ``AgentBus.wait`` returns after another connection completes its task
    (PostgreSQL: LISTEN agentbus_settled; SQLite: a look every 5-250 ms). Each task
    is completed 0.1-1.3 s into the wait, so it lands anywhere in the looks."""
    settings = Settings(database_url=url, sqlite_synchronous=synchronous)
    lags = []
    with AgentBus(settings=settings) as bus:
        queue = TaskQueue(bus.db)
        for i in range(tasks):
            task_id = bus.enqueue("waiting", str(i), models=["sim/noop"])
            returned: list[float] = []
            waiter = threading.Thread(target=_wait_and_note, args=(bus, task_id, returned))
            waiter.start()
            time.sleep(0.1 + (i * 0.37) % 1.2)
            (task,) = queue.claim("waiting", "bench", 30)
            queue.complete(task.id, task.claim_token, "ok")
            committed = time.time()
            waiter.join()
            lags.append(returned[0] - committed)
    lags.sort()
    p95 = lags[min(len(lags) - 1, round(len(lags) * 0.95) - 1)]
    return [
        (
            f"settle-to-wait latency, AgentBus.wait ({len(lags)} tasks), p50 / p95",
            f"{statistics.median(lags) * 1000:,.1f} / {p95 * 1000:,.1f} ms",
        )
    ]


def _wait_and_note(bus: AgentBus, task_id: int, returned: list[float]) -> None:
    bus.wait(task_id)
    returned.append(time.time())
