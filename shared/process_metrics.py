"""Histograms and counters a process observes in memory and adds to the database
every few seconds (``flush``), where ``busctl serve`` reads them for /metrics.

Observing costs a lock and a few additions — nothing on the database per call or
per task; rows are shared by every process and only ever added to, so the
figures survive retention and restarts and never go backwards. A process killed
between two flushes loses at most that interval's observations.

Histograms (seconds): ``agentbus_call_seconds`` {agent, model, outcome},
``agentbus_task_run_seconds`` {agent, outcome}, ``agentbus_sweep_seconds``
{job}; counter: ``agentbus_sweep_job_failures`` {job}.
"""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Mapping
from typing import Any

from sqlalchemy.engine import Connection

from agentbus.db import Database, dialect_insert
from agentbus.schema import bus_observations as obs

BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
LE = (*(f"{b:g}" for b in BUCKETS), "+Inf")
Key = tuple[str, str]  # (name, labels as k=v,k=v)
_TEXTS_KEPT = 1024


def labels_text(labels: Mapping[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in sorted(labels.items()))


def labels_of(text: str) -> dict[str, str]:
    return dict(part.split("=", 1) for part in text.split(",") if part)


class Observations:
    """What this process saw since its last flush (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: dict[Key, dict[str, float]] = {}
        # labels (as given) -> their text: a worker observes the same few label sets
        # for every task, and sorting and joining them each time cost more than the
        # observation.
        self._texts: dict[tuple[tuple[str, str], ...], str] = {}

    def observe(self, name: str, labels: Mapping[str, str], seconds: float) -> None:
        """One sample of histogram ``name``."""
        if not math.isfinite(seconds) or seconds < 0:
            return
        le = LE[bisect.bisect_left(BUCKETS, seconds)]
        key = (name, self._text(labels))
        with self._lock:
            row = self._pending.setdefault(key, {})
            row[le] = row.get(le, 0.0) + 1
            row["sum"] = row.get("sum", 0.0) + seconds
            row["count"] = row.get("count", 0.0) + 1

    def count(self, name: str, labels: Mapping[str, str], n: float = 1.0) -> None:
        """Add ``n`` to counter ``name``."""
        key = (name, self._text(labels))
        with self._lock:
            row = self._pending.setdefault(key, {})
            row["count"] = row.get("count", 0.0) + n

    def _text(self, labels: Mapping[str, str]) -> str:
        given = tuple(labels.items())
        text = self._texts.get(given)
        if text is None:
            if len(self._texts) >= _TEXTS_KEPT:  # label values without bound: start over
                self._texts.clear()
            text = self._texts[given] = labels_text(labels)
        return text

    def take(self) -> list[dict[str, Any]]:
        """The rows to add, and nothing pending after."""
        with self._lock:
            pending, self._pending = self._pending, {}
        return [
            {"name": name, "labels": labels, "le": le, "value": value}
            for (name, labels), row in sorted(pending.items())
            for le, value in sorted(row.items())
        ]

    def flush(self, db: Database) -> None:
        """Add what was observed since the last flush to the database; kept for the next
        flush if the database is away."""
        rows = self.take()
        if not rows:
            return
        try:
            db.write(lambda conn: add(conn, rows))
        except Exception:
            self.put_back(rows)
            raise

    def put_back(self, rows: list[dict[str, Any]]) -> None:
        """Rows a flush could not write: added again, for the next one."""
        with self._lock:
            for r in rows:
                row = self._pending.setdefault((r["name"], r["labels"]), {})
                row[r["le"]] = row.get(r["le"], 0.0) + r["value"]


def add(conn: Connection, rows: list[dict[str, Any]]) -> None:
    """Add ``rows`` (from ``Observations.take``) to the shared table."""
    if not rows:
        return
    insert = dialect_insert(conn.dialect.name)(obs)
    statement = insert.on_conflict_do_update(
        index_elements=[obs.c.name, obs.c.labels, obs.c.le],
        set_={"value": obs.c.value + insert.excluded.value},
    )
    conn.execute(statement, rows)


def read(conn: Connection) -> dict[str, dict[str, dict[str, float]]]:
    """name -> labels -> le (or sum, count) -> value."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name, labels, le, value in conn.execute(
        obs.select().with_only_columns(obs.c.name, obs.c.labels, obs.c.le, obs.c.value)
    ):
        out.setdefault(name, {}).setdefault(labels, {})[le] = float(value)
    return out
