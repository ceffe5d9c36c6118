"""Schedules: ``[schedules.NAME]`` tasks the sweeper enqueues on a timetable, each
occurrence once however many sweepers run. The timetable's pure times, the config's
refusals, the sweeper's job with an injected clock, and real sweepers, a worker and
busctl on SQLite, PostgreSQL and PgBouncer."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.catalog import parse_catalog
from agentbus.catalog.schedules import ScheduleConfig, occurrence_key
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.errors import ConfigError
from agentbus.queue import TaskQueue
from agentbus.schema import bus_commands, schedule_runs, task_events
from agentbus.sweeper import jobs
from tests.support import FakeClock, Proc, wait_until

Spawn = Callable[..., Proc]
Busctl = Callable[..., subprocess.CompletedProcess[str]]
HOUR = 3600.0


def at(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def schedule(**body: Any) -> ScheduleConfig:
    doc = {"schedules": {"s": {"agent": "codex", "text": "x", "models": ["sim/a"], **body}}}
    return parse_catalog(doc).schedules["s"]  # type: ignore[no-any-return]


# -- the timetable ------------------------------------------------------------------------


def test_every_falls_on_whole_multiples_since_the_epoch() -> None:
    five = schedule(every="5m")
    assert five.every_sec == 300 and five.when == "every 5m"
    now = at("2026-12-07T10:07:30+00:00")
    assert five.next_after(now) == at("2026-12-07T10:10:00+00:00")
    assert five.next_after(at("2026-12-07T10:10:00+00:00")) == at("2026-12-07T10:15:00+00:00")
    assert five.latest(now - 3600, now) == at("2026-12-07T10:05:00+00:00")
    assert five.latest(at("2026-12-07T10:05:00+00:00"), now) is None  # that one ran
    assert schedule(every=90).when == "every 90s"
    assert schedule(every="1d").every_sec == 86400 and schedule(every="2h").when == "every 2h"


def test_cron_occurrences_in_its_time_zone() -> None:
    nightly = schedule(cron="0 2 * * *", timezone="Europe/Paris")
    now = at("2026-12-07T12:00:00+00:00")
    assert nightly.next_after(now) == at("2026-12-08T02:00:00+01:00")
    # A week of downtime: only the latest missed occurrence.
    assert nightly.latest(now - 7 * 86400, now) == at("2026-12-07T02:00:00+01:00")
    assert nightly.latest(at("2026-12-07T02:00:00+01:00"), now) is None
    every_five = schedule(cron="*/5 * * * *")
    assert every_five.latest(now - 30 * 86400, now + 299) == now
    assert every_five.next_after(now) == now + 300 and every_five.when == "*/5 * * * *"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"cron": "*/5 * * *"}, "cron '\\*/5 \\* \\* \\*' does not read: Wrong number of fields"),
        ({"cron": "61 * * * *"}, "cron '61 \\* \\* \\* \\*' does not read"),
        ({"cron": "0 2 * * *", "timezone": "Mars/Olympus"}, "does not read"),
        ({"cron": "0 2 * * *", "every": "1h"}, "give either cron or every"),
        ({}, "give either cron or every"),
        ({"every": "5x"}, "every must be a time such as '30s'"),
        ({"every": 0}, "every must be a time"),
        ({"every": "400d"}, "every must be a time"),
        ({"every": True}, "every must be a time"),
        ({"every": "1h", "catch_up": "yes"}, "catch_up must be true or false"),
        ({"every": "1h", "hourly": True}, "unknown key 'hourly'"),
        ({"every": "1h", "agent": "bad agent"}, "agent must be an agent's name"),
        ({"every": "1h", "text": ""}, "the task text is empty"),
        ({"every": "1h", "payload": [1]}, "the payload must be a JSON object"),
        ({"every": "1h", "priority": "high"}, "priority must be an integer"),
        ({"every": "1h", "expires_in_sec": -1}, "expires-in must be more than 0"),
        ({"every": "1h", "models": ["nope/x"]}, "unknown model 'nope/x'"),
        ({"every": "1h", "models": None, "role": "ghost"}, "unknown role 'ghost'"),
    ],
)
def test_a_schedule_the_config_cannot_run_is_refused_in_one_line(
    body: dict[str, Any], message: str
) -> None:
    table = {"agent": "codex", "text": "x", "models": ["sim/a"], **body}
    table = {k: v for k, v in table.items() if v is not None}
    with pytest.raises(ConfigError, match=message) as refused:
        parse_catalog({"schedules": {"s": table}})
    assert refused.value.message.startswith("[schedules.s]: ")
    assert "\n" not in refused.value.message


def test_a_schedule_of_an_agent_the_config_does_not_know_is_refused() -> None:
    doc: dict[str, Any] = {
        "agents": {"codex": {"models": ["sim/a"]}},
        "schedules": {"s": {"agent": "writer", "text": "x", "every": "1h"}},
    }
    with pytest.raises(ConfigError, match="unknown agent 'writer'"):
        parse_catalog(doc)
    doc["schedules"]["s"]["agent"] = "codex"  # its chain comes from [agents.codex]
    assert parse_catalog(doc).schedules["s"].models is None
    with pytest.raises(ConfigError, match="no chain"):
        parse_catalog({"schedules": {"s": {"agent": "codex", "text": "x", "every": "1h"}}})


# -- the sweeper's job ---------------------------------------------------------------------


def sweep_with(db: Database, clock: FakeClock, **schedules: dict[str, Any]) -> jobs.Sweep:
    doc = {
        "schedules": {
            name: {"agent": "codex", "text": f"run {name}", "models": ["sim/a"], **body}
            for name, body in schedules.items()
        }
    }
    return jobs.Sweep(db, LiveConfig.fixed(Settings(), parse_catalog(doc)), clock=clock)


def scheduled(db: Database) -> list[tuple[str, str | None]]:
    query = sa.select(bus_commands.c.command, bus_commands.c.idempotency_key).order_by(
        bus_commands.c.id
    )
    return [tuple(r) for r in db.read(lambda conn: conn.execute(query).all())]  # type: ignore[misc]


def test_each_occurrence_is_enqueued_once_by_any_number_of_sweepers(
    db: Database, clock: FakeClock
) -> None:
    clock.now = at("2026-12-07T10:07:30+00:00")
    one = sweep_with(db, clock, probe={"every": "5m", "expires_in_sec": 60, "priority": 3})
    other = sweep_with(db, clock, probe={"every": "5m", "expires_in_sec": 60, "priority": 3})
    # First seen now: the occurrence of 10:05 came before, and never runs.
    assert jobs.schedules(one) == {"scheduled": 0, "schedules_missed": 0}
    assert jobs.next_wake(one) == at("2026-12-07T10:10:00+00:00")
    clock.now = at("2026-12-07T10:10:00+00:00")
    assert jobs.schedules(one) == {"scheduled": 1, "schedules_missed": 0}
    assert jobs.schedules(other) == {"scheduled": 0, "schedules_missed": 0}
    assert jobs.schedules(one) == {"scheduled": 0, "schedules_missed": 0}
    key = occurrence_key("probe", clock.now)
    assert key == "schedule:probe:2026-12-07T10:10:00+00:00"
    assert scheduled(db) == [("run probe", key)]
    (task,) = TaskQueue(db).claim("codex", "w", 30)
    assert (task.priority, task.models, task.expires_at) == (3, ("sim/a",), clock.now + 60)
    (row,) = db.read(lambda conn: conn.execute(sa.select(schedule_runs)).all())
    assert (row.name, row.last_at, row.last_task_id) == ("probe", clock.now, task.id)
    # The other sweeper, late, runs the same occurrence's key: still one task.
    clock.now += 299
    assert jobs.schedules(other) == {"scheduled": 0, "schedules_missed": 0}
    assert len(scheduled(db)) == 1


def test_after_downtime_the_latest_missed_occurrence_runs_once_or_none(
    db: Database, clock: FakeClock
) -> None:
    clock.now = at("2026-12-07T10:00:00+00:00")
    s = sweep_with(db, clock, hourly={"every": "1h"}, strict={"every": "1h", "catch_up": False})
    jobs.schedules(s)  # first seen
    clock.now = at("2026-12-07T15:30:00+00:00")  # five occurrences missed
    assert jobs.schedules(s) == {"scheduled": 1, "schedules_missed": 1}
    assert scheduled(db) == [("run hourly", "schedule:hourly:2026-12-07T15:00:00+00:00")]
    assert jobs.schedules(s) == {"scheduled": 0, "schedules_missed": 0}
    clock.now = at("2026-12-07T16:00:10+00:00")  # on time: both run
    assert jobs.schedules(s) == {"scheduled": 2, "schedules_missed": 0}
    assert [key for _, key in scheduled(db)][1:] == [
        "schedule:hourly:2026-12-07T16:00:00+00:00",
        "schedule:strict:2026-12-07T16:00:00+00:00",
    ]
    # A full pass runs the job too, and counts it.
    clock.now = at("2026-12-07T17:00:01+00:00")
    from agentbus.sweeper.service import run_once

    assert run_once(s)["scheduled"] == 2


def test_no_schedule_no_rows(db: Database, clock: FakeClock) -> None:
    s = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)
    assert jobs.schedules(s) == {"scheduled": 0, "schedules_missed": 0}
    assert jobs.next_wake(s) is None
    assert db.read(lambda conn: conn.execute(sa.select(schedule_runs)).all()) == []


# -- real processes --------------------------------------------------------------------------


def _config(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "agentbus.toml"
    path.write_text(body)
    return path


PROBE = """
[schedules.probe]
agent = "codex"
text = "health probe"
models = ["sim/a"]
every = "1h"
"""


@pytest.mark.process
def test_sweepers_at_once_enqueue_an_occurrence_once_and_a_worker_runs_it(
    db_url: str, spawn: Spawn, run_busctl: Busctl, tmp_path: Path
) -> None:
    config = _config(tmp_path, PROBE)
    db = Database(db_url)
    before_seen = db.clock() - 2 * HOUR  # seen two hours ago: this hour's occurrence is due
    db.write(
        lambda conn: conn.execute(
            sa.insert(schedule_runs).values(name="probe", first_seen=before_seen)
        )
    )
    sweepers = [
        spawn("sweeper", "--db", db_url, "--config", str(config), "--once") for _ in range(4)
    ]
    for sweeper in sweepers:
        assert sweeper.wait() == 0, sweeper.text()
    rows = scheduled(db)
    assert len(rows) == 1, rows
    assert rows[0][0] == "health probe" and rows[0][1].startswith("schedule:probe:")
    assert sum(s.text().count("schedule_enqueued") for s in sweepers) == 1
    worker = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert worker.wait() == 0, worker.text()
    listed = run_busctl("--db", db_url, "--config", str(config), "schedules", "--json")
    assert listed.returncode == 0, listed.stderr
    (shown,) = json.loads(listed.stdout)
    assert shown["name"] == "probe" and shown["when"] == "every 1h"
    assert shown["last_task_status"] == "done"
    assert shown["next_at"] == shown["last_at"] + HOUR
    text = run_busctl("--db", db_url, "--config", str(config), "schedules").stdout
    assert "probe" in text and "every 1h" in text and "(done)" in text
    db.dispose()


@pytest.mark.process
def test_a_malformed_cron_stops_the_sweeper_and_busctl_in_one_line_and_writes_nothing(
    db_url: str, spawn: Spawn, run_busctl: Busctl, tmp_path: Path
) -> None:
    config = _config(tmp_path, PROBE.replace('every = "1h"', 'cron = "*/5 * * *"'))
    db = Database(db_url)

    def counts() -> list[int]:
        return [
            db.read(
                lambda conn, t=table: conn.execute(
                    sa.select(sa.func.count()).select_from(t)
                ).scalar()
            )
            for table in (bus_commands, task_events, schedule_runs)
        ]

    before = counts()
    sweeper = spawn("sweeper", "--db", db_url, "--config", str(config), "--once")
    assert sweeper.wait() == 2
    listed = run_busctl("--db", db_url, "--config", str(config), "schedules")
    for stderr in (sweeper.text(), listed.stderr):
        lines = stderr.strip().splitlines()
        assert len(lines) == 1, stderr
        assert "[schedules.probe]: cron '*/5 * * *' does not read" in lines[0]
    assert listed.returncode == 2
    assert counts() == before
    db.dispose()


@pytest.mark.process
def test_two_sweeper_services_enqueue_every_occurrence_at_most_once(
    db_url: str, spawn: Spawn, tmp_path: Path
) -> None:
    """Two sweepers running as services, a schedule every second: each occurrence they
    enqueue has its own key, none twice (the tasks are counted, not timed)."""
    config = _config(tmp_path, PROBE.replace('every = "1h"', "every = 1"))
    db = Database(db_url)
    args = ("sweeper", "--db", db_url, "--config", str(config), "--interval", "3600")
    services = [spawn(*args) for _ in range(2)]
    try:
        wait_until(lambda: len(scheduled(db)) >= 4, timeout=60)
    finally:
        for service in services:
            service.signal(signal.SIGTERM)
        for service in services:
            assert service.wait() == 0, service.text()
    keys = [key for _, key in scheduled(db)]
    assert len(keys) == len(set(keys)) >= 4
    times = [datetime.fromisoformat(k.removeprefix("schedule:probe:")) for k in keys if k]
    assert all(t.microsecond == 0 for t in times) and times == sorted(times)
    enqueued = sum(s.text().count("schedule_enqueued") for s in services)
    assert enqueued == len(keys)
    db.dispose()


def test_status_metrics_and_render_show_the_schedules(db: Database, clock: FakeClock) -> None:
    from agentbus.admin import render, serve, status

    clock.now = at("2026-12-07T10:00:00+00:00")
    s = sweep_with(db, clock, hourly={"every": "1h"})
    jobs.schedules(s)
    clock.now = at("2026-12-07T11:00:00+00:00")
    jobs.schedules(s)
    doc = status.snapshot(db, Settings(), clock.now, kpis=False, catalog=s.config.catalog)
    (row,) = doc["schedules"]
    assert (row["name"], row["when"], row["last_at"]) == ("hourly", "every 1h", clock.now)
    assert row["next_at"] == clock.now + HOUR and row["last_task_id"] is not None
    assert "schedule hourly (every 1h, agent codex): next" in render.status(doc, Settings())
    families = {m.name: m for m in serve.SnapshotCollector(lambda _k: doc, lambda: []).collect()}
    (nxt,) = families["agentbus_schedule_next_run_timestamp_seconds"].samples
    (last,) = families["agentbus_schedule_last_run_timestamp_seconds"].samples
    assert (nxt.labels, nxt.value, last.value) == (
        {"schedule": "hourly"},
        clock.now + HOUR,
        clock.now,
    )
