"""What a transaction pooler costs, for scripts/bench.py: the same worker drains
directly and through PgBouncer (``pooler = transaction``: no prepared statements),
an idle worker's enqueue-to-claim latency through it (polling, or LISTEN on a direct
``listen_url``), and the statements an idle worker sends through it a second."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import latency
import sqlalchemy as sa
from worker_bench import worker_drain

from agentbus.db import Database
from agentbus.queue import reads

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.pgbouncer: the PgBouncer the tests run

from tests.pgbouncer import PgBouncer  # noqa: E402


def start(server_url: str) -> PgBouncer:
    """A PgBouncer of this run's own, in transaction mode, in front of ``server_url``."""
    return PgBouncer(server_url).start()


def rows(
    pooled: str, direct: str, tasks: int, idle_sec: float, latency_tasks: int = 20
) -> list[tuple[str, str]]:
    out = []
    for batch in (1, 10):
        # Alternate, so that neither side has the quieter minute.
        runs = {"direct": [], "pooled": []}
        for _ in range(2):
            runs["direct"].append(worker_drain(direct, "FULL", 2, tasks, batch).drain)
            runs["pooled"].append(worker_drain(pooled, "FULL", 2, tasks, batch).drain)
        d, p = max(runs["direct"]), max(runs["pooled"])
        out.append(
            (
                f"2 x worker --drain --batch {batch}, {tasks:,} tasks, best of 2: "
                "direct / through PgBouncer",
                f"{d:,.0f} / {p:,.0f} tasks/s ({p / d:.2f}x)",
            )
        )
    for label, env in (("polling", {}), ("listen_url", {"AGENTBUS_LISTEN_URL": direct})):
        ((what, figure),) = latency.wakeup(pooled, "FULL", latency_tasks, env=env)
        out.append((f"through PgBouncer, {label}: {what}", figure))
    out.append(idle_statements(pooled, idle_sec))
    return out


def idle_statements(pooled: str, idle_sec: float) -> tuple[str, str]:
    """Statements a second an idle worker sends through PgBouncer (its SHOW STATS for
    the database), counted over ``idle_sec`` once it has idled 15 s (past the looks
    of its first seconds)."""
    url = sa.make_url(pooled)
    agent = f"idle{uuid.uuid4().hex[:6]}"
    db = Database(pooled)
    worker = subprocess.Popen(
        [str(Path(sys.executable).with_name("worker")), "--agent", agent, "--db", pooled],
        env=dict(os.environ),
        stderr=subprocess.DEVNULL,
    )
    try:
        while agent not in reads.live_agents(db):
            time.sleep(0.05)
        db.dispose()  # its connections idle too: the count is the worker's alone
        time.sleep(15.0)
        first, began = _queries(url), time.monotonic()
        time.sleep(idle_sec)
        sent = (_queries(url) - first) / (time.monotonic() - began)
    finally:
        worker.terminate()
        worker.wait()
        db.dispose()
    return (
        f"idle worker through PgBouncer, polling: statements a second over {idle_sec:.0f} s",
        f"{sent:.2f}",
    )


def _queries(url: sa.URL) -> int:
    import psycopg

    admin = f"host={url.host} port={url.port} user={url.username} dbname=pgbouncer"
    with psycopg.connect(admin, autocommit=True, prepare_threshold=None) as conn:
        cursor = conn.cursor()
        cursor.execute("SHOW STATS")
        names = [c.name for c in cursor.description or ()]
        for row in cursor.fetchall():
            found = dict(zip(names, row, strict=True))
            if found["database"] == url.database:
                return int(found["total_query_count"])
    return 0
