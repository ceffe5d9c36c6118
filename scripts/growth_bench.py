"""What operators read, and the sweeper's passes, on a small table and a large one: the
paths of ``python scripts/bench.py rows`` that must not slow as the table grows.

Each path is timed on the database ``rows_bench`` built: whole processes as an
operator runs them (``busctl status``, ``tasks``, ``show``, ``kpi``, ``sweeper --once``
with nothing old enough to prune), HTTP requests to a running ``busctl serve``
(``/metrics``, ``/workspace/status``), and the statements behind them in this process.
Each figure is the median of a few runs, in milliseconds.
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from agentbus.admin.observe import RECENT_FAILED
from agentbus.db import Database
from agentbus.queue import counts, retention
from agentbus.queue.states import TaskStatus
from agentbus.schema import bus_commands as t

DAY = 86400.0
BIN = Path(sys.executable).parent
#: Retention longer than the built history (30 days): the sweeper finds nothing to prune
#: and measures what finding nothing costs.
KEEP_ALL = {
    "AGENTBUS_DONE_RETENTION_SEC": str(60 * DAY),
    "AGENTBUS_FAILED_RETENTION_SEC": str(60 * DAY),
}

#: path -> its target: the most times its small-table figure it may take (None: no target)
TARGETS = {
    "GET /metrics": 3.0,
    "GET /workspace/status": 2.0,
    "busctl status": 2.0,
    "busctl tasks": 2.0,
    "busctl show": 2.0,
    "sweeper --once": 2.0,
    "counts by state and agent": 2.0,
    "retention probe, done": 2.0,
    "retention probe, failed and error": 2.0,
    "retention probe, cancelled": 2.0,
    "last 20 failed": 2.0,
    "busctl kpi (all time)": None,
    "GROUP BY over the table (replaced)": None,
}


def median_ms(run: Callable[[], object], times: int) -> float:
    took = []
    for _ in range(times):
        began = time.perf_counter()
        run()
        took.append((time.perf_counter() - began) * 1000)
    return statistics.median(took)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _process(env: dict[str, str], *argv: str) -> Callable[[], object]:
    def run() -> object:
        done = subprocess.run(argv, env=env, capture_output=True, timeout=600, check=False)
        if done.returncode not in (0, 1):  # 1: the command ran and found a problem
            raise RuntimeError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr[-500:]!r}")
        return done

    return run


def _statements(db: Database, now: float) -> dict[str, Callable[[], object]]:
    cutoff = now - 60 * DAY

    def probe(*statuses: TaskStatus) -> Callable[[], object]:
        query = retention.finished_before(statuses, cutoff, 500)
        return lambda: db.read(lambda conn: conn.execute(query).all())

    grouped = sa.select(t.c.status, t.c.agent, sa.func.count()).group_by(t.c.status, t.c.agent)
    return {
        "counts by state and agent": lambda: db.read(counts.read),
        "retention probe, done": probe(TaskStatus.DONE),
        "retention probe, failed and error": probe(TaskStatus.FAILED, TaskStatus.ERROR),
        "retention probe, cancelled": probe(TaskStatus.CANCELLED),
        "last 20 failed": lambda: db.read(lambda conn: conn.execute(RECENT_FAILED).all()),
        "GROUP BY over the table (replaced)": lambda: db.read(
            lambda conn: conn.execute(grouped).all()
        ),
    }


def operator_paths(url: str, runs: int = 3) -> dict[str, float]:
    """Every path's median milliseconds on the database at ``url``."""
    env = {**os.environ, "AGENTBUS_DATABASE_URL": url, **KEEP_ALL}
    db = Database(url)
    out: dict[str, float] = {}
    try:
        some = db.read(lambda conn: conn.execute(sa.select(sa.func.max(t.c.id))).scalar())
        for name, run in _statements(db, time.time()).items():
            run()  # warm: the first read of a cold page is the disk's, not the plan's
            out[name] = median_ms(run, runs * 2)
    finally:
        db.dispose()
    processes = {
        "busctl status": ("status",),
        "busctl tasks": ("tasks",),
        "busctl show": ("show", str(some)),
        "busctl kpi (all time)": ("kpi",),
    }
    for name, args in processes.items():
        out[name] = median_ms(_process(env, str(BIN / "busctl"), *args), runs)
    out["sweeper --once"] = median_ms(_process(env, str(BIN / "sweeper"), "--once"), runs)
    out.update(_served(env, runs))
    return out


def _served(env: dict[str, str], runs: int) -> dict[str, float]:
    port = _free_port()
    serve = subprocess.Popen(
        [str(BIN / "busctl"), "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            deadline = time.monotonic() + 60
            while True:
                try:
                    if client.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                if serve.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"busctl serve did not start: {serve.stderr!r}")
                time.sleep(0.1)

            def get(path: str) -> Callable[[], Any]:
                return lambda: client.get(path).raise_for_status()

            out = {}
            for path in ("/metrics", "/workspace/status"):
                get(path)()
                out[f"GET {path}"] = median_ms(get(path), runs * 2)
            return out
    finally:
        serve.terminate()
        serve.wait(timeout=30)


def table(small: dict[str, float], large: dict[str, float], rows: str) -> list[str]:
    """One line a path: the two figures, their ratio, and the target met or not."""
    lines = []
    for name, target in TARGETS.items():
        if name not in small or name not in large:
            continue
        ratio = large[name] / small[name] if small[name] > 0 else float("inf")
        if target is None:
            verdict = "no target: a full read, polled by nothing"
        else:
            verdict = f"target {target:g}x: {'met' if ratio <= target else 'NOT met'}"
        lines.append(
            f"  {name}: 10,000 tasks {small[name]:,.1f} ms; {rows} tasks {large[name]:,.1f} ms "
            f"({ratio:.1f}x; {verdict})"
        )
    return lines
