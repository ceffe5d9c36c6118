"""What a worker's steady state costs the database, counted where the database sees it.

``TaskQueue.settle_and_claim`` (what ``worker`` calls between tasks) runs over
T no-op tasks, each completed with the routing row of its one call, with a
claim batch of B. Counted per task:
- SQLite: every statement SQLite starts (its trace callback), BEGIN and
  COMMIT included; commits are the COMMITs. The counters' triggers (on
  ``task_events`` and ``route_log``) are not statements of their own: the
  driver reports each trigger program's start as its statement's text again,
  right after it, and such a repeat is counted apart. And the pages a commit
  writes to the write-ahead log (each a frame its fsync waits for), from the
  log's growth with checkpoints held off while counting.
- PostgreSQL: the statements psycopg sends (``Query`` and ``Execute``
  messages in libpq's protocol trace), the round trips (``Query`` and ``Sync``
  messages: each waits for the server's answer), and the commits the server
  counted for the database (``pg_stat_database.xact_commit``; an autocommit
  statement is one).
"""

from __future__ import annotations

import os
import re
import sqlite3
import tempfile
import time
import uuid
from collections import Counter
from typing import Any

import sqlalchemy as sa

from agentbus.admission.routing import Route
from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.decisions import Complete, Settlement
from agentbus.queue.tasks import TaskSpec


def steady_state(url: str, tasks: int, batch: int) -> dict[str, float]:
    """Per-task counts of the steady state (see the module's docstring)."""
    db = Database(url)
    queue = TaskQueue(db)
    agent = f"count{uuid.uuid4().hex[:6]}"
    spec = TaskSpec(agent=agent, command="t", models=("sim/noop",))
    for start in range(0, tasks, 500):
        queue.enqueue_many([spec] * min(500, tasks - start))
    db.dispose()
    if db.dialect == "sqlite":
        return _sqlite(url, agent, tasks, batch)
    return _postgres(url, agent, tasks, batch)


def steady_loop(queue: TaskQueue, agent: str, worker: str, batch: int) -> int:
    """As a worker does: acknowledge the last claim's no-op tasks, each with the routing
    row of its one call, with the next claim, until the queue is empty. Returns how
    many were completed."""
    acks: list[Settlement] = []
    done = 0
    while True:
        _, claimed = queue.settle_and_claim(acks, agent, worker, 60, batch)
        done += len(acks)
        if not claimed:
            return done
        now = time.time()
        acks = [
            Settlement(
                t.id,
                t.claim_token,
                Complete("ok", "sim/noop"),
                [call_route(t.id, t.claim_token, agent, worker, now)],
            )
            for t in claimed
        ]


def call_route(task_id: int, claim_token: int, agent: str, worker: str, at: float) -> Route:
    """The routing row of a no-op task's one call, as a worker records it."""
    return Route(
        task_id,
        claim_token,
        agent,
        "sim/noop",
        "call",
        at,
        worker=worker,
        outcome="ok",
        provider="sim",
    )


def _sqlite(url: str, agent: str, tasks: int, batch: int) -> dict[str, float]:
    seen: Counter[str] = Counter()
    last = [""]
    db = Database(url)

    def traced(sql: str) -> None:
        seen.update(["TRIGGER" if sql == last[0] else sql.split(None, 1)[0].upper()])
        last[0] = sql

    @sa.event.listens_for(db.engine, "connect")
    def _trace(dbapi_conn: sqlite3.Connection, _record: Any) -> None:
        dbapi_conn.execute("PRAGMA wal_autocheckpoint=0")  # the log only grows meanwhile
        dbapi_conn.set_trace_callback(traced)

    path = db.sqlite_path()
    assert path is not None
    bare = sqlite3.connect(path)  # the log starts empty
    bare.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    bare.close()
    done = steady_loop(TaskQueue(db), agent, "counter", batch)
    page = db.read(lambda conn: conn.exec_driver_sql("PRAGMA page_size").scalar())
    frames = (os.path.getsize(f"{path}-wal") - 32) / (24 + int(page))  # after its header
    db.dispose()
    assert done == tasks, (done, tasks)
    for pragma in ("PRAGMA",):  # the connection's set-up, once
        seen.pop(pragma, None)
    triggers = seen.pop("TRIGGER", 0)
    return {
        "statements": sum(seen.values()) / tasks,
        "commits": seen["COMMIT"] / tasks,
        "trigger runs": triggers / tasks,
        "WAL pages per commit": frames / seen["COMMIT"],
    }


_SENT = re.compile(r"^F\s+\d+\s+(Query|Execute|Sync)\b", re.MULTILINE)


def _postgres(url: str, agent: str, tasks: int, batch: int) -> dict[str, float]:
    import psycopg

    conninfo = sa.make_url(url).set(drivername="postgresql").render_as_string(False)
    commits_before = _xact_commit(conninfo)
    with tempfile.TemporaryDirectory() as tmp:
        traces: list[Any] = []
        db = Database(url)

        @sa.event.listens_for(db.engine, "connect")
        def _trace(dbapi_conn: psycopg.Connection[Any], _record: Any) -> None:
            fh = open(os.path.join(tmp, f"{len(traces)}.trace"), "w")  # noqa: SIM115
            traces.append(fh)
            dbapi_conn.pgconn.trace(fh.fileno())
            dbapi_conn.pgconn.set_trace_flags(
                psycopg.pq.Trace.SUPPRESS_TIMESTAMPS | psycopg.pq.Trace.REGRESS_MODE
            )

        done = steady_loop(TaskQueue(db), agent, "counter", batch)
        db.dispose()  # the backends exit: their statistics are flushed
        sent: Counter[str] = Counter()
        for fh in traces:
            fh.close()
            with open(fh.name) as text:
                sent.update(m.group(1) for m in _SENT.finditer(text.read()))
    assert done == tasks, (done, tasks)
    commits = _xact_commit(conninfo, after=True) - commits_before
    return {
        "statements": (sent["Query"] + sent["Execute"]) / tasks,
        "round trips": (sent["Query"] + sent["Sync"]) / tasks,
        "commits": commits / tasks,
    }


def _xact_commit(conninfo: str, *, after: bool = False) -> int:
    """The database's committed transactions so far (the statistics of exited backends
    reach the view within moments; ``after`` waits for them)."""
    import psycopg

    with psycopg.connect(conninfo, autocommit=True) as conn:
        if after:
            time.sleep(1.5)
        row = conn.execute(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row is not None else 0


def rows(url: str, tasks: int = 2000) -> list[tuple[str, str]]:
    """Table rows: the counts per task for claim batches of 1 and 10."""
    out = []
    for batch in (1, 10):
        counts = steady_state(url, tasks, batch)
        figures = ", ".join(f"{value:.2f} {name}" for name, value in counts.items())
        out.append((f"steady state per task, batch {batch} ({tasks:,} tasks)", figures))
    return out


if __name__ == "__main__":  # a quick look: python scripts/counting.py URL
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        target = sys.argv[1] if len(sys.argv) > 1 else f"sqlite:///{tmp}/count.db"
        if target.startswith("sqlite"):
            from agentbus.migrations import migrate

            migrate(Database(target))
        for label, figures in rows(target):
            print(f"{label}: {figures}")
