#!/usr/bin/env python3
"""Chaos run: SIGKILL random workers while they work, then prove nothing was lost.

3 agents x 2 worker processes (one task at a time, three per claim, or eight at
once in slot threads, in turn) and a sweeper run with a short lease and short
cooldowns over a few thousand tasks with mixed simulated outcomes (ok with
latency, rate-limit windows with and without a fallback, timeouts, retryable
and permanent errors). For ``--duration`` seconds a random worker is killed
with SIGKILL every ``--kill-every`` seconds and a new one started. Then, with
the sweeper given time to rescue, the database must show:

- every enqueued task done, failed (with its reason) or paused (with a
  resume_after): none missing, none stuck claimed or queued;
- no two workers ever holding one task at once (claims and the settles that
  end them interleave, per task, in the event log);
- no task completed, failed or paused under a claim token that had been
  superseded.

    python scripts/chaos.py                                   # SQLite, 3000 tasks, 60 s
    python scripts/chaos.py --db postgresql+psycopg://postgres@127.0.0.1/chaos
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa

from agentbus.db import Database
from agentbus.migrations import migrate
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands, task_events

AGENTS = ("codex", "analyst", "ron")
WORKERS_PER_AGENT = 2
MODES = (["--batch", "1"], ["--batch", "3"], ["--concurrency", "8"])
SETTINGS = {  # short everything, through the ordinary settings
    "AGENTBUS_LEASE_SEC": "2",
    "AGENTBUS_MODEL_COOLDOWN_SEC": "1",
    "AGENTBUS_MODEL_TIMEOUT_COOLDOWN_SEC": "2",
    "AGENTBUS_SWEEP_INTERVAL_SEC": "1",
    "AGENTBUS_SWEEP_PEEK_SEC": "0.2",
    "AGENTBUS_POLL_SEC": "0.1",
    "AGENTBUS_RETRY_BACKOFF_SEC": "0.2",
    "AGENTBUS_RETRY_BACKOFF_MAX_SEC": "1",
    "AGENTBUS_CALL_RETRY_WAIT_SEC": "0.01",
    "AGENTBUS_BACKOFF_THRESHOLDS": "3:0.1,5:0.2,10:0.5",
    "AGENTBUS_MAX_ATTEMPTS": "4",
    "AGENTBUS_RESCUE_LIMIT": "5",
    "AGENTBUS_GRACE_SEC": "1",
    "AGENTBUS_WORKER_STALE_SEC": "5",
}


def task_specs(n: int, rng: random.Random) -> list[TaskSpec]:
    """Mixed outcomes: ok, limited windows, all-cooling pauses, timeouts, errors."""
    specs = []
    for i in range(n):
        roll = rng.random()
        latency = {"latency_ms": rng.randint(50, 400)}
        if roll < 0.40:
            models, script = ("sim/a",), {"sim/a": {"behaviour": "ok", **latency}}
        elif roll < 0.55:  # a rate-limit window with a fallback that answers
            models = ("sim/limited", "sim/b")
            script = {
                "sim/limited": {"behaviour": "rate_limited", "for_s": rng.uniform(1, 4)},
                "sim/b": {"behaviour": "ok", **latency},
            }
        elif roll < 0.70:  # the only model rate-limited for a while: pause, resume, done
            models = ("sim/solo",)
            script = {"sim/solo": {"behaviour": "overloaded", "for_s": rng.uniform(1, 3)}}
        elif roll < 0.80:  # a timeout, then the fallback
            models = ("sim/slowpoke", "sim/b")
            script = {
                "sim/slowpoke": {"behaviour": "timeout", "for_s": rng.uniform(0, 3)},
                "sim/b": "ok",
            }
        elif roll < 0.92:  # retryable errors for a while: spent attempts, maybe done
            models = ("sim/flaky",)
            script = {"sim/flaky": {"behaviour": "error", "for_s": rng.uniform(0, 2)}}
        else:  # a permanent error
            models, script = ("sim/broken",), {"sim/broken": "fatal"}
        specs.append(
            TaskSpec(
                agent=AGENTS[i % len(AGENTS)],
                command=f"chaos task {i}",
                models=models,
                payload={"simulate": script},
            )
        )
    return specs


@dataclass
class Report:
    tasks: int
    kills: int
    statuses: Counter[str]
    missing: list[int] = field(default_factory=list)
    stuck: list[int] = field(default_factory=list)
    failed_without_reason: list[int] = field(default_factory=list)
    paused_without_resume: list[int] = field(default_factory=list)
    double_holds: list[int] = field(default_factory=list)
    stale_settles: list[int] = field(default_factory=list)
    rescues: int = 0
    poison_pills: int = 0

    @property
    def ok(self) -> bool:
        return not (
            self.missing
            or self.stuck
            or self.failed_without_reason
            or self.paused_without_resume
            or self.double_holds
            or self.stale_settles
        )

    def lines(self) -> list[str]:
        return [
            f"tasks {self.tasks}, workers killed {self.kills}, leases rescued {self.rescues}, "
            f"poison pills {self.poison_pills}",
            "final: " + ", ".join(f"{k} {v}" for k, v in sorted(self.statuses.items())),
            f"missing {len(self.missing)}, stuck claimed/queued {len(self.stuck)}, "
            f"failed without reason {len(self.failed_without_reason)}, "
            f"paused without resume_after {len(self.paused_without_resume)}",
            f"tasks held by two workers at once {len(self.double_holds)}, "
            f"settled under a superseded token {len(self.stale_settles)}",
            "PASS" if self.ok else "FAIL",
        ]


def check(db: Database, ids: list[int], kills: int) -> Report:
    """Verify the invariants from the tables and the event log."""
    with db.engine.connect() as conn:
        rows = conn.execute(
            sa.select(
                bus_commands.c.id,
                bus_commands.c.status,
                bus_commands.c.last_error,
                bus_commands.c.resume_after,
            ).where(bus_commands.c.id.in_(ids))
        ).all()
        log = conn.execute(
            sa.select(task_events)
            .where(task_events.c.task_id.in_(ids))
            .order_by(task_events.c.task_id, task_events.c.id)
        ).all()
    report = Report(len(ids), kills, Counter(r.status for r in rows))
    report.missing = sorted(set(ids) - {r.id for r in rows})
    for r in rows:
        if r.status in ("claimed", "queued"):
            report.stuck.append(r.id)
        if r.status in ("failed", "error") and not r.last_error:
            report.failed_without_reason.append(r.id)
        if r.status == "paused" and r.resume_after is None:
            report.paused_without_resume.append(r.id)
    holder: dict[int, tuple[int, str] | None] = {}
    for e in log:
        held = holder.get(e.task_id)
        if e.to_status == "claimed":
            if held is not None:
                report.double_holds.append(e.task_id)
            holder[e.task_id] = (e.claim_token, e.worker)
        elif e.from_status == "claimed":
            if held is None or held[0] != e.claim_token:
                report.stale_settles.append(e.task_id)
            holder[e.task_id] = None
        report.rescues += e.reason == "lease expired"
        report.poison_pills += e.reason == "poison pill"
    return report


def _spawn(
    program: str, args: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(Path(sys.executable).with_name(program)), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )


def run(
    url: str,
    *,
    tasks: int,
    duration: float,
    kill_every: float,
    settle: float,
    seed: int,
    workdir: Path,
    say: Any = print,
) -> Report:
    rng = random.Random(seed)
    db = Database(url)
    migrate(db)
    ids = TaskQueue(db).enqueue_many(task_specs(tasks, rng))
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("AGENTBUS_")},
        **SETTINGS,
        "AGENTBUS_DATABASE_URL": url,
    }
    sweeper = _spawn("sweeper", [], env, workdir / "sweeper.log")

    def start(slot: int) -> subprocess.Popen[bytes]:
        # By slot, in turn: one task at a time, three per claim (batch acknowledgements),
        # and eight at once in one process (slot threads); a killed worker's successor
        # runs the same way.
        agent = AGENTS[slot // WORKERS_PER_AGENT]
        log = workdir / f"worker-{agent}.log"
        return _spawn("worker", ["--agent", agent, *MODES[slot % len(MODES)]], env, log)

    workers = [start(slot) for slot in range(len(AGENTS) * WORKERS_PER_AGENT)]
    eight_slots = [slot for slot in range(len(workers)) if "8" in MODES[slot % len(MODES)]]
    kills = 0
    say(
        f"{tasks} tasks, {len(workers)} workers and a sweeper; killing one every "
        f"{kill_every:g} s for {duration:g} s"
    )
    try:
        ends = time.monotonic() + duration
        while time.monotonic() < ends:
            time.sleep(rng.uniform(0.5, 1.5) * kill_every)
            slot = rng.randrange(len(workers))
            if kills % len(MODES) == 0:  # every third kill hits a worker of eight slots
                slot = rng.choice(eight_slots)
            victim = workers[slot]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            kills += 1
            workers[slot] = start(slot)
        say(f"killed {kills} workers; letting the sweeper rescue and the queue settle")
        settle_ends = time.monotonic() + settle
        while time.monotonic() < settle_ends:
            counts = check(db, ids, kills).statuses
            if counts["claimed"] + counts["queued"] == 0:
                break
            time.sleep(0.5)
    finally:
        for proc in workers:
            proc.send_signal(signal.SIGTERM)
        sweeper.send_signal(signal.SIGTERM)
        for proc in [sweeper, *workers]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    report = check(db, ids, kills)
    db.dispose()
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--db", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--tasks", type=int, default=3000)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--kill-every", type=float, default=3.0)
    parser.add_argument("--settle", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="agentbus-chaos-"))
    url = args.db or f"sqlite:///{workdir / 'chaos.db'}"
    report = run(
        url,
        tasks=args.tasks,
        duration=args.duration,
        kill_every=args.kill_every,
        settle=args.settle,
        seed=args.seed,
        workdir=workdir,
    )
    if args.json:
        print(json.dumps({**report.__dict__, "ok": report.ok}, default=list, indent=2))
    else:
        print("\n".join(report.lines()))
        print(f"logs: {workdir}")
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
