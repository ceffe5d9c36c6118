"""Fair shares of one provider account under a flood: ``python scripts/bench.py shares``.
Prints figures; asserts nothing.

One agent (``big``) has a backlog on an account limited to ``--rpm`` calls a
minute, and ``--big-workers`` workers; they and a sweeper run alone for
``--head-start`` seconds (the flood fills the window and pauses the rest). Then
two small agents get ``--small`` tasks each, and a worker each. The small
agents' fair share is a third of the window each, so their tasks should be done
within about ``small / (rpm / 3)`` minutes of the window having room, not
behind the flood. Printed: when each agent's tasks were done, counted from the
small agents' arrival, and how many of the big agent's were done meanwhile.

With ``--concurrency N`` the provider is limited to N calls in flight instead
(no rpm), each call taking ``--latency-ms``: the small agents' fair share is a
third of the slots each, so their tasks should be done within about
``small * latency / (N / 3)``.

Real ``worker`` and ``sweeper`` processes on the simulated provider, SQLite or
PostgreSQL (``--backend``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import measure
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.migrations import migrate
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands as t

BIN = Path(sys.executable).parent
CONFIG = """
rpm_window_sec = {window}
[providers.sim]
kind = "simulated"
{limit}
[agents.big]
models = ["sim/a"]
[agents.small1]
models = ["sim/a"]
[agents.small2]
models = ["sim/a"]
"""


def done_times(db: Database) -> dict[str, list[float]]:
    """Each agent's done tasks' finishing times."""
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(t.c.agent, t.c.updated_at).where(t.c.status == "done")
        ).all()
    )
    found: dict[str, list[float]] = {}
    for agent, at in rows:
        found.setdefault(agent, []).append(float(at))
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backend", default="sqlite", help="sqlite or postgresql")
    parser.add_argument("--big", type=int, default=2000, help="the flooding agent's tasks")
    parser.add_argument("--small", type=int, default=20, help="tasks of each small agent")
    parser.add_argument("--rpm", type=int, default=120)
    parser.add_argument("--window", type=float, default=60.0, help="rpm_window_sec")
    parser.add_argument("--head-start", type=float, default=5.0)
    parser.add_argument("--big-workers", type=int, default=8, help="worker processes of big")
    parser.add_argument("--concurrency", type=int, default=0, help="slots instead of rpm")
    parser.add_argument("--latency-ms", type=int, default=500, help="each call (--concurrency)")
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    slots = args.concurrency
    limit = f"concurrency = {slots}" if slots else f"rpm = {args.rpm}"
    payload = {"simulate": {"sim/a": {"latency_ms": args.latency_ms}}} if slots else {}
    with tempfile.TemporaryDirectory() as tmp, measure.agentbus_database(args.backend) as url:
        config = Path(tmp) / "agentbus.toml"
        config.write_text(CONFIG.format(limit=limit, window=args.window))
        env = {
            **os.environ,
            "AGENTBUS_CONFIG": str(config),
            "AGENTBUS_LOG_LEVEL": "WARNING",
            "AGENTBUS_CALL_RETRIES": "0",
        }
        db = Database(url)
        migrate(db)
        queue = TaskQueue(db)
        queue.enqueue_many(
            [TaskSpec(agent="big", command=f"big {i}", payload=payload) for i in range(args.big)]
        )
        names = ["sweeper", "s1", "s2", *(f"big{n}" for n in range(args.big_workers))]
        logs = {name: open(Path(tmp) / f"{name}.log", "w") for name in names}  # noqa: SIM115

        def start(log: str, *argv: str) -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                [str(BIN / argv[0]), *argv[1:], "--db", url],
                env=env,
                stdout=logs[log],
                stderr=subprocess.STDOUT,
            )

        procs = [start("sweeper", "sweeper")]
        procs += [start(f"big{n}", "worker", "--agent", "big") for n in range(args.big_workers)]
        try:
            time.sleep(args.head_start)
            arrived = time.time()
            queue.enqueue_many(
                [
                    TaskSpec(agent=agent, command=f"{agent} {i}", payload=payload)
                    for agent in ("small1", "small2")
                    for i in range(args.small)
                ]
            )
            procs += [start("s1", "worker", "--agent", "small1")]
            procs += [start("s2", "worker", "--agent", "small2")]
            deadline = arrived + args.timeout
            while time.time() < deadline:
                times = done_times(db)
                if all(len(times.get(a, [])) >= args.small for a in ("small1", "small2")):
                    break
                time.sleep(0.5)
            times = done_times(db)
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=60)
            for log in logs.values():
                log.close()
            db.dispose()
    if slots:
        fair = args.small * args.latency_ms / 1000 / (slots / 3)
        said = f"concurrency {slots}, calls of {args.latency_ms} ms"
        how = f"{args.small} x {args.latency_ms / 1000:g} s / ({slots} / 3)"
    else:
        fair = args.small / (args.rpm / 3) * args.window
        said = f"rpm {args.rpm} per {args.window:g} s"
        how = f"{args.small} / ({args.rpm} / 3)"
    print(
        f"{args.backend}: {said}; big: {args.big} tasks, {args.big_workers} workers, "
        f"{args.head_start:g} s ahead; two small agents: {args.small} tasks, 1 worker each"
    )
    print(f"fair-share time of a small agent: {how} = {fair:.1f} s")
    print("seconds after the small agents' tasks came:")
    print(f"{'agent':<8}{'done':>6}{'first':>9}{'median':>9}{'last':>9}")
    for agent in ("small1", "small2", "big"):
        after = sorted(at - arrived for at in times.get(agent, []) if at >= arrived)
        if not after:
            print(f"{agent:<8}{0:>6}")
            continue
        print(
            f"{agent:<8}{len(after):>6}{after[0]:>9.1f}{statistics.median(after):>9.1f}"
            f"{after[-1]:>9.1f}"
        )
    return 0
