"""scripts/measure.py: what a local PostgreSQL server spends for a run, and the bench's
drain rows that show it."""

from __future__ import annotations

import re

import psycopg
import pytest

from tests.conftest import Backends, _pg_conninfo
from tests.support import script


def test_the_server_spent_counts_each_process_from_its_first_reading_to_its_last() -> None:
    measure = script("measure")
    one_run = ({1: 5.0, 2: 1.0}, {1: 6.0, 2: 1.5, 3: 0.25})  # 3 started meanwhile
    other = ({1: 5.5, 4: 2.0}, {1: 6.5, 4: 2.0})  # 4: in no end of the first
    assert measure.server_spent(*one_run) == pytest.approx(1.0 + 0.5 + 0.25)
    assert measure.server_spent_over([one_run, other]) == pytest.approx(1.5 + 0.5 + 0.25 + 0.0)
    assert measure.server_spent({1: 1.0}, {}) is None  # no server here


@pytest.mark.parametrize("listed", [True, False], ids=["children-listed", "children-unlisted"])
def test_a_watch_keeps_what_a_backend_spent_after_its_connection_closed(
    backends: Backends, listed: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A PostgreSQL server's own figure: SQLite has no server to watch. The backend
    starts after the watch's first poll, as a short drain's do: the next poll finds it,
    among the server's children or, on a kernel that does not list them, in /proc."""
    measure = script("measure")
    real = measure.lists_children
    monkeypatch.setattr(measure, "lists_children", lambda pids: listed and real(pids))
    _, handle = backends.new("postgresql")
    watch = measure.ServerWatch()
    watch.poll()
    try:
        with psycopg.connect(_pg_conninfo(str(handle))) as conn:
            watch.poll()  # the new backend is found
            conn.execute("SELECT sum(x) FROM generate_series(1, 3000000) x").fetchone()
            watch.poll()  # its CPU read while it lives
    finally:
        backends.drop(handle)
    watch.poll()  # gone now: its last reading stays
    spent = watch.per_task_ms(1000)  # ms per task over 1000 "tasks": seconds in all
    assert spent is not None and spent >= 0.1  # the sum's 3 million rows: ~0.3 s here


def test_the_drain_rows_give_the_servers_share_of_the_machines_cpu(db_url: str) -> None:
    bench = script("bench")
    rate, cpu, bounds = bench.throughput(db_url, "FULL", 1, 1, 300)
    assert rate > 0 and cpu > 0
    machine = re.search(r"machine CPU ([\d.]+) ms per task", bounds)
    assert machine is not None, bounds
    server = re.search(r"\(the server's ([\d.]+)\)", bounds)
    if db_url.startswith("sqlite"):
        assert server is None
        return
    assert server is not None, bounds
    assert 0 < float(server.group(1)) <= float(machine.group(1))
