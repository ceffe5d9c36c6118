"""Deadlines: a task not started by its ``expires_at`` is never started. The worker that
claims it ends it, as does a pause or retry that would come after it; the sweeper ends
the waiting ones. Pure decisions, the queue with an injected clock, and real workers,
sweepers and busctl on SQLite, PostgreSQL and PgBouncer."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from datetime import UTC, datetime, timedelta, timezone

import pytest
import sqlalchemy as sa

from agentbus.admin import render, serve, status
from agentbus.admission.cooldowns import CooldownStore
from agentbus.client import AgentBus
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.errors import InvalidTask
from agentbus.queue import TaskQueue, reads
from agentbus.queue.decisions import Complete, Expire, Fail, Pause, Requeue
from agentbus.queue.tasks import TaskSpec, deadline_epoch
from agentbus.schema import bus_commands, bus_counters, route_log, task_events
from agentbus.sweeper import jobs
from agentbus.worker import policy
from tests.support import FakeClock, Proc

Spawn = Callable[..., Proc]
Busctl = Callable[..., subprocess.CompletedProcess[str]]
T0 = 1_800_000_000.0


def enqueue(queue: TaskQueue, agent: str = "codex", **more: object) -> int:
    spec = TaskSpec(agent=agent, command="x", models=("sim/a",), **more)  # type: ignore[arg-type]
    return queue.enqueue(spec).id


def expiries(db: Database) -> int:
    query = sa.select(bus_counters.c.value).where(bus_counters.c.name == "expiries")
    return int(db.read(lambda conn: conn.execute(query).scalar()) or 0)


def events_of(db: Database, task_id: int) -> list[tuple[str | None, str, str | None]]:
    return [(e["from_status"], e["to_status"], e["reason"]) for e in reads.task_events(db, task_id)]


def table_rows(db: Database) -> dict[str, int]:
    counted = {}
    for table in (bus_commands, task_events, route_log):
        query = sa.select(sa.func.count()).select_from(table)
        counted[table.name] = db.read(lambda conn, q=query: conn.execute(q).scalar())
    return counted


# -- the decisions -------------------------------------------------------------------------


def test_a_claimed_task_past_its_deadline_expires_and_one_before_it_runs() -> None:
    assert policy.expired(None, T0) is None
    assert policy.expired(T0 + 1, T0) is None
    ended = policy.expired(T0, T0)
    assert isinstance(ended, Expire)
    assert ended.reason == "deadline: not started by 2027-01-15T08:00:00+00:00"


def test_a_pause_or_retry_that_would_come_after_the_deadline_ends_the_task() -> None:
    pause = Pause(T0 + 60, "sim/a", "cooling")
    retry = Requeue(T0 + 60, "503")
    for decision in (pause, retry):
        assert policy.by_deadline(decision, None) is decision
        assert policy.by_deadline(decision, T0 + 61) is decision  # it comes in time
        ended = policy.by_deadline(decision, T0 + 60)
        assert isinstance(ended, Expire)
        waits = "resume" if decision is pause else "retry"
        assert ended.reason.endswith(f"its {waits} would come at 2027-01-15T08:01:00+00:00")
    for final in (Complete("ok"), Fail("bad")):  # an end is an end
        assert policy.by_deadline(final, T0 - 5) is final


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"deadline": T0, "expires_in_sec": 5}, "a deadline or expires-in, not both"),
        ({"deadline": float("nan")}, "the deadline must be a finite time"),
        ({"deadline": "tomorrow"}, "the deadline must be a finite time"),
        ({"expires_in_sec": 0}, "expires-in must be more than 0"),
        ({"expires_in_sec": -3}, "expires-in must be more than 0"),
        ({"expires_in_sec": float("inf")}, "expires-in must be a finite number"),
        ({"expires_in_sec": True}, "expires-in must be a finite number"),
    ],
)
def test_a_malformed_deadline_is_refused_by_the_spec(
    fields: dict[str, object], message: str
) -> None:
    with pytest.raises(InvalidTask, match=message):
        TaskSpec(agent="codex", command="x", models=("sim/a",), **fields)  # type: ignore[arg-type]


def test_deadlines_as_given_to_a_producer() -> None:
    at = datetime(2027, 1, 15, 9, 0, tzinfo=timezone(timedelta(hours=1)))
    assert deadline_epoch(at) == T0
    assert deadline_epoch("2027-01-15T08:00:00Z") == T0
    for bad, message in (
        ("2027-01-15T08:00:00", "needs a time zone"),
        (datetime(2027, 1, 15), "needs a time zone"),
        ("next tuesday", "is not an ISO 8601 time"),
        (T0, "must be an aware datetime, not float"),
    ):
        with pytest.raises(InvalidTask, match=message):
            deadline_epoch(bad)


# -- the queue -----------------------------------------------------------------------------


def test_an_enqueue_stores_the_deadline_and_refuses_one_already_past(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    one = enqueue(queue, expires_in_sec=90)
    two = enqueue(queue, deadline=clock.now + 300, delay_sec=60)
    keyed = enqueue(queue, expires_in_sec=5, key="k1")
    many = queue.enqueue_many(
        [
            TaskSpec(agent="codex", command="a", models=("sim/a",), expires_in_sec=7),
            TaskSpec(agent="codex", command="b", models=("sim/a",)),
        ]
    )
    expected = [clock.now + 90, clock.now + 300, clock.now + 5, clock.now + 7, None]
    assert [queue.get(i).expires_at for i in (one, two, keyed, *many)] == expected
    assert queue.get(one).deadline == datetime.fromtimestamp(clock.now + 90, UTC)
    before = table_rows(db)
    for fields, message in (
        ({"deadline": clock.now}, "the deadline 2027-01-15T08:00:00\\+00:00 is in the past"),
        ({"deadline": clock.now - 1, "key": "k2"}, "is in the past"),
        ({"deadline": clock.now + 30, "delay_sec": 30}, "comes before the task may run"),
        ({"expires_in_sec": 10, "delay_sec": 20}, "comes before the task may run"),
        ({"deadline": clock.now + 11 * 366 * 86400}, "more than ten years away"),
    ):
        with pytest.raises(InvalidTask, match=message):
            enqueue(queue, **fields)
        with pytest.raises(InvalidTask, match=message):
            spec = TaskSpec(agent="codex", command="x", models=("sim/a",), **fields)  # type: ignore[arg-type]
            queue.enqueue_many([spec, spec])
    assert table_rows(db) == before


def test_a_claimed_task_past_its_deadline_ends_cancelled_without_an_attempt(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    late = enqueue(queue, expires_in_sec=30)
    clock.advance(31)
    (task,) = queue.claim("codex", "w1", 30)
    ended = policy.expired(task.expires_at, clock.now)
    assert ended is not None
    queue.expire(task.id, task.claim_token, ended.reason, worker="w1")
    got = queue.get(late)
    assert (got.status, got.attempts, got.lease_until) == ("cancelled", 0, None)
    assert got.result_note == "deadline: not started by 2027-01-15T08:00:30+00:00"
    assert events_of(db, late)[-1] == ("claimed", "cancelled", "deadline")
    assert expiries(db) == 1


def test_the_sweeper_ends_the_waiting_tasks_whose_deadline_passed_and_wakes_for_the_next(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    sweep = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)
    queued = enqueue(queue, expires_in_sec=10)
    later = enqueue(queue, expires_in_sec=500)
    never = enqueue(queue)
    paused = enqueue(queue, "writer", expires_in_sec=20)
    (task,) = queue.claim("writer", "w", 30)
    queue.pause(task.id, task.claim_token, clock.now + 5, "cooling", model="sim/a")
    assert jobs.next_wake(sweep) == clock.now + 5  # the pause's resume comes first
    clock.advance(6)
    # Due to resume and not past its deadline: resumed, not ended.
    assert jobs.resume(sweep) == {"resumed": 1, "postponed": 0, "held": 0}
    (task,) = queue.claim("writer", "w", 30)
    queue.pause(task.id, task.claim_token, clock.now + 100, "cooling", model="sim/a")
    assert jobs.next_wake(sweep) == clock.now + 4  # the queued task's deadline
    assert jobs.expire(sweep) == {"expired": 0}
    clock.advance(15)  # both deadlines passed (the pause's resume has not come)
    assert jobs.expire(sweep) == {"expired": 2}
    assert [queue.get(i).status for i in (queued, later, never, paused)] == [
        "cancelled",
        "queued",
        "queued",
        "cancelled",
    ]
    assert events_of(db, queued)[-1] == ("queued", "cancelled", "deadline")
    assert events_of(db, paused)[-1] == ("paused", "cancelled", "deadline")
    assert queue.get(paused).resume_after is None
    assert jobs.next_wake(sweep) == clock.now + 479  # the last deadline left
    assert expiries(db) == 2
    assert jobs.expire(sweep) == {"expired": 0}  # ended once
    doc = status.snapshot(db, Settings(), clock.now, kpis=False)
    assert doc["deadlines"] == {"expired": 2, "next": clock.now + 479}
    assert "deadlines: 2 tasks ended unstarted; next deadline" in render.status(doc, Settings())
    collector = serve.SnapshotCollector(lambda _kpis: doc, lambda: [])
    (family,) = [m for m in collector.collect() if m.name == "agentbus_deadline_expiries"]
    assert [(s.name, s.value) for s in family.samples] == [("agentbus_deadline_expiries_total", 2)]
    # An operator's retry runs it: the deadline already past is dropped; one ahead is kept.
    queue.retry(queued)
    assert (queue.get(queued).status, queue.get(queued).expires_at) == ("queued", None)
    claimed = {t.id: t for t in queue.claim("codex", "w", 30, limit=5)}
    assert sorted(claimed) == [queued, later, never]
    assert policy.expired(claimed[queued].expires_at, clock.now) is None  # it runs


def test_a_resume_postponed_past_the_deadline_ends_the_task_at_once(
    db: Database, queue: TaskQueue, clock: FakeClock
) -> None:
    sweep = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)
    doomed, fine = enqueue(queue, expires_in_sec=60), enqueue(queue, expires_in_sec=900)
    for task in queue.claim("codex", "w", 30, limit=2):
        queue.pause(task.id, task.claim_token, clock.now + 5, "cooling", model="sim/a")
    clock.advance(5)
    # The model cools down again for 10 minutes: the resume moves there, past the
    # first task's deadline.
    CooldownStore(db, clock=clock).set("sim/a", clock.now + 600, reason="429")
    assert jobs.resume(sweep) == {"resumed": 0, "postponed": 1, "held": 0, "expired": 1}
    assert queue.get(doomed).status == "cancelled"
    assert queue.get(doomed).result_note == "deadline: not started by 2027-01-15T08:01:00+00:00"
    assert events_of(db, doomed)[-1] == ("paused", "cancelled", "deadline")
    assert (queue.get(fine).status, queue.get(fine).resume_after) == ("paused", clock.now + 600)


def test_the_producer_api_takes_a_deadline(db_url: str) -> None:
    bus = AgentBus(db_url)
    try:
        soon = datetime.now(UTC) + timedelta(minutes=10)
        one = bus.enqueue("codex", "x", models=["sim/a"], deadline=soon)
        two = bus.enqueue_many(
            [{"agent": "codex", "text": "y", "models": ["sim/a"], "expires_in_sec": 60}]
        )[0]
        assert bus.get(one).expires_at == pytest.approx(soon.timestamp())
        assert bus.get(two).expires_at is not None
        for bad, message in (
            ({"deadline": datetime.now(UTC) - timedelta(seconds=5)}, "is in the past"),
            ({"deadline": datetime(2030, 1, 1)}, "needs a time zone"),
            ({"expires_in_sec": "60"}, "expires-in must be a finite number"),
        ):
            with pytest.raises(InvalidTask, match=message):
                bus.enqueue("codex", "x", models=["sim/a"], **bad)  # type: ignore[arg-type]
        assert len(bus.list(limit=10)) == 2
    finally:
        bus.close()


# -- real processes --------------------------------------------------------------------------


def _past(db: Database, task_id: int) -> None:
    """Its deadline passes: set a second behind the database's clock (the state held by
    the row, not by a wait)."""
    now = db.clock()
    db.write(
        lambda conn: conn.execute(
            sa.update(bus_commands).where(bus_commands.c.id == task_id).values(expires_at=now - 1)
        )
    )


@pytest.mark.process
def test_a_worker_never_starts_a_task_past_its_deadline_and_ends_one_that_would_wait_past_it(
    db_url: str, spawn: Spawn
) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    late = enqueue(queue, expires_in_sec=3600)
    _past(db, late)
    on_time = enqueue(queue, expires_in_sec=3600)
    cooling = {"simulate": {"sim/a": {"behaviour": "rate_limited", "retry_after_s": 7200}}}
    would_wait = enqueue(queue, payload=cooling, expires_in_sec=600)
    worker = spawn("worker", "--agent", "codex", "--db", db_url, "--drain")
    assert worker.wait() == 0, worker.text()
    got = {i: queue.get(i) for i in (late, on_time, would_wait)}
    assert got[on_time].status == "done"
    assert got[late].status == "cancelled" and got[late].attempts == 0
    assert got[late].result_note.startswith("deadline: not started by ")
    assert reads.routes(db, task_id=late) == []  # no call was made for it
    # Its model cools down for two hours: it would resume after its deadline.
    assert got[would_wait].status == "cancelled"
    assert "its resume would come at" in (got[would_wait].result_note or "")
    assert events_of(db, would_wait)[-1] == ("claimed", "cancelled", "deadline")
    assert "task_expired" in worker.text()
    assert expiries(db) == 2
    db.dispose()


@pytest.mark.process
def test_the_sweeper_ends_queued_and_paused_tasks_past_their_deadline(
    db_url: str, spawn: Spawn, run_busctl: Busctl
) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    queued = enqueue(queue, "nobody_runs_me", expires_in_sec=3600)
    kept = enqueue(queue, "nobody_runs_me", expires_in_sec=3600)
    paused = enqueue(queue, expires_in_sec=3600)
    (task,) = queue.claim("codex", "w", 30)
    queue.pause(task.id, task.claim_token, db.clock() + 1800, "cooling", model="sim/a")
    _past(db, queued)
    _past(db, paused)
    sweeper = spawn("sweeper", "--db", db_url, "--once")
    assert sweeper.wait() == 0, sweeper.text()
    assert [queue.get(i).status for i in (queued, kept, paused)] == [
        "cancelled",
        "queued",
        "cancelled",
    ]
    assert "expired=2" in sweeper.text() or '"expired": 2' in sweeper.text()
    shown = run_busctl("--db", db_url, "show", str(queued))
    assert shown.returncode == 0, shown.stderr
    assert "deadline: not started by" in shown.stdout
    doc = json.loads(run_busctl("--db", db_url, "status", "--json").stdout)
    assert doc["deadlines"]["expired"] == 2
    db.dispose()


@pytest.mark.process
def test_busctl_enqueue_takes_a_deadline_and_refuses_a_bad_one(
    db_url: str, run_busctl: Busctl
) -> None:
    db = Database(db_url)
    base = ["--db", db_url, "enqueue", "--agent", "codex", "--models", "sim/a"]
    made = run_busctl(*base, "--expires-in", "120", "x")
    assert made.returncode == 0, made.stderr
    task = TaskQueue(db).get(int(made.stdout))
    assert task.expires_at == pytest.approx(db.clock() + 120, abs=30)
    soon = (datetime.now(UTC) + timedelta(hours=1)).isoformat()
    assert run_busctl(*base, "--deadline", soon, "x").returncode == 0
    before = table_rows(db)
    for extra, message in (
        (
            ["--deadline", "2020-01-01T00:00:00Z"],
            "the deadline 2020-01-01T00:00:00+00:00 is in the past",
        ),
        (["--deadline", "2030-01-01T00:00:00"], "the deadline needs a time zone"),
        (["--deadline", "soon"], "the deadline 'soon' is not an ISO 8601 time"),
        (["--expires-in", "0"], "expires-in must be more than 0"),
        (["--expires-in", "ten"], "Invalid value for '--expires-in'"),
        (["--expires-in", "10", "--run-after", "20"], "comes before the task may run"),
        (["--expires-in", "10", "--deadline", soon], "a deadline or expires-in, not both"),
    ):
        bad = run_busctl(*base, *extra, "x")
        assert bad.returncode == 2, (extra, bad.stderr)
        lines = bad.stderr.strip().splitlines()
        assert len(lines) == 1 and message in lines[0], (extra, bad.stderr)
    assert table_rows(db) == before
    db.dispose()
