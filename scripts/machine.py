"""What this machine charges for the two waits of a worker at batch 1, measured apart
from agentbus: being woken by another process, and a durable SQLite commit by the
pages it appends to the write-ahead log.

- wake-up: two processes pass a byte back and forth over two pipes, each blocked
  in ``read`` until the other writes: the round trip, and the CPU one side spends
  on it, with the two on different cores and then on the same core. A worker blocks
  and is woken twice a task (the writers' turn passing from the other worker, then
  its own commit's fsync; on PostgreSQL the server's answer). Where an idle core
  halts at once (a VM whose guest does not poll before halting), each of those
  wake-ups costs more than the switch itself, in time and in CPU.
- commit by pages: SQLite in WAL mode at the ``synchronous`` level given, each
  transaction changing one row in each of K one-page tables, so that its commit
  appends exactly K pages to the log (the log's own count of its frames,
  checkpoints held off): the mean COMMIT, from one page to the ~12 of a worker's
  steady-state commit (``scripts/counting.py`` counts those).
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

#: The other side of the round trip: echo every byte until the pipe closes.
_ECHO = "import os\nwhile os.read(0, 1):\n    os.write(1, b'x')\n"


def wake_up(round_trips: int, same_core: bool) -> tuple[float, float]:
    """(µs a round trip, this process's CPU µs a round trip): ``round_trips`` bytes sent
    to an echoing process and read back one at a time, the two pinned to different
    cores (the first two this process may use) or both to the first. This process's
    own cores are given back afterwards."""
    cores = sorted(os.sched_getaffinity(0))
    if not same_core and len(cores) < 2:
        raise ValueError("a round trip across cores needs two cores")
    ours, theirs = cores[0], cores[0] if same_core else cores[1]
    saved = os.sched_getaffinity(0)
    child = subprocess.Popen(
        [sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        os.sched_setaffinity(child.pid, {theirs})
        os.sched_setaffinity(0, {ours})
        send, receive = child.stdin.fileno(), child.stdout.fileno()
        os.write(send, b"x")  # the child has started and answers
        os.read(receive, 1)
        cpu, began = time.process_time(), time.perf_counter()
        for _ in range(round_trips):
            os.write(send, b"x")
            if os.read(receive, 1) != b"x":
                raise RuntimeError("the echoing process stopped answering")
        elapsed, cpu = time.perf_counter() - began, time.process_time() - cpu
    finally:
        os.sched_setaffinity(0, saved)
        child.stdin.close()
        child.wait()
        child.stdout.close()
    return elapsed / round_trips * 1e6, cpu / round_trips * 1e6


def commit_cost(
    directory: Path, synchronous: str, pages: Sequence[int], commits: int
) -> dict[int, tuple[float, float]]:
    """For each K in ``pages``: (mean µs of COMMIT, pages each commit appended to the log)
    over ``commits`` transactions that each change one row of K one-page tables, on a
    fresh database file in ``directory``. The log is written once over first and
    started again: the commits timed overwrite it, as a long-lived database's do
    (a log that grows makes each fsync write the file's new size too)."""
    out = {}
    for k in pages:
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            conn = sqlite3.connect(Path(tmp) / "pages.db", isolation_level=None)
            try:
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute(f"PRAGMA synchronous={synchronous}")
                conn.execute("PRAGMA wal_autocheckpoint=0")  # the log's frames stay counted
                for t in range(k):
                    conn.execute(f"CREATE TABLE t{t} (id INTEGER PRIMARY KEY, n INTEGER)")
                    conn.execute(f"INSERT INTO t{t} VALUES (1, 0)")
                updates = [f"UPDATE t{t} SET n = n + 1 WHERE id = 1" for t in range(k)]
                _commits(conn, updates, commits)  # the log grows to its size
                conn.execute("PRAGMA wal_checkpoint(RESTART)")  # and starts again, kept
                committing = _commits(conn, updates, commits)
                _, frames, _ = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
            finally:
                conn.close()
        out[k] = (committing / commits * 1e6, frames / commits)
    return out


def _commits(conn: sqlite3.Connection, updates: list[str], commits: int) -> float:
    """Seconds spent in COMMIT over ``commits`` transactions of ``updates``."""
    committing = 0.0
    for _ in range(commits):
        conn.execute("BEGIN IMMEDIATE")
        for update in updates:
            conn.execute(update)
        began = time.perf_counter()
        conn.execute("COMMIT")
        committing += time.perf_counter() - began
    return committing


def rows(directory: Path | None, synchronous: str, commits: int = 400) -> list[tuple[str, str]]:
    """Table rows: the wake-up round trips (with two cores or more), and COMMIT by pages
    on ``directory``'s disk (None: not measured)."""
    out = []
    if len(os.sched_getaffinity(0)) >= 2:
        across = wake_up(2000, same_core=False)
        same = wake_up(2000, same_core=True)
        out.append(
            (
                "wake-up: a pipe round trip between 2 processes, across cores / on one",
                f"{across[0]:,.1f} / {same[0]:,.1f} µs, "
                f"{across[1]:,.1f} / {same[1]:,.1f} µs CPU (one side)",
            )
        )
    if directory is not None:
        costs = commit_cost(directory, synchronous, (1, 2, 6, 12), commits)
        figures = ", ".join(f"{k} page{'s' * (k > 1)} {us:,.0f} µs" for k, (us, _) in costs.items())
        out.append((f"SQLite COMMIT by pages appended (synchronous {synchronous})", figures))
    return out


if __name__ == "__main__":  # a quick look: python scripts/machine.py [DIRECTORY]
    where = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir())
    for label, figure in rows(where, "FULL"):
        print(f"{label}: {figure}")
