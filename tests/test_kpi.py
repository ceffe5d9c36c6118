"""KPI views over crafted event logs on both backends; kpi.sql in the real clients."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.admin import kpi
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.routing import Route
from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from tests.conftest import IN_CI
from tests.support import FakeClock


def route(
    task_id: int, token: int, model: str, decision: str, outcome: str | None, at: float
) -> Route:
    return Route(task_id, token, "codex", model, decision, at, worker="w", outcome=outcome)


def claim_one(queue: TaskQueue, agent: str = "codex") -> tuple[int, int]:
    (task,) = queue.claim(agent, "w", 30)
    return task.id, task.claim_token


def test_fresh_database_gives_na_not_division_errors(db: Database) -> None:
    kpis = kpi.compute(db)
    assert [(k.number, k.shown(), k.passed) for k in kpis] == [
        (1, "n/a", None),
        (2, "n/a", None),
        (3, "n/a", None),
        (4, "0", True),
    ]


def test_kpis_on_a_crafted_log(db: Database, clock: FakeClock) -> None:
    q = TaskQueue(db, clock=clock)
    cooldowns = CooldownStore(db, clock=clock)
    cooldowns.set("sim/a", clock.now + 100, reason="429")
    clock.advance(1)
    now = clock.now
    for i in range(5):
        q.enqueue(TaskSpec(agent="codex", command=f"t{i}", models=("sim/a", "sim/b")))

    # A: every model cooling (skipped / 429) -> paused: a preserved hit.
    a, ta = claim_one(q)
    q.pause(
        a,
        ta,
        now + 99,
        "cooldown",
        model="sim/a",
        routes=[
            route(a, ta, "sim/a", "skip", None, now),
            route(a, ta, "sim/b", "call", "rate_limited", now),
        ],
    )
    # B: every model cooling but failed anyway: a lost hit and a backoff inversion.
    b, tb = claim_one(q)
    q.fail(
        b,
        tb,
        "all candidate models are cooling down",
        routes=[
            route(b, tb, "sim/a", "skip", None, now),
            route(b, tb, "sim/b", "call", "timeout", now),
        ],
    )
    # C: a cooldown met, but the fallback answered: not a hit.
    c, tc = claim_one(q)
    q.complete(
        c,
        tc,
        "ok",
        routes=[route(c, tc, "sim/a", "skip", None, now), route(c, tc, "sim/b", "call", "ok", now)],
    )
    # D: a genuine failure (HTTP 400 after a skip): counted, not caused by cooldowns.
    d, td = claim_one(q)
    q.fail(
        d,
        td,
        "HTTP 400",
        routes=[
            route(d, td, "sim/a", "skip", None, now),
            route(d, td, "sim/b", "call", "permanent", now),
        ],
    )
    # E: a skip of a model the table did not have in cooldown: inconsistent (a hit, paused).
    e, te = claim_one(q)
    q.pause(
        e,
        te,
        now + 50,
        "cooldown",
        model="sim/z",
        routes=[route(e, te, "sim/z", "skip", None, now)],
    )

    # Resumes: A -> done (success), E -> paused again (not), then E resumed and still running.
    clock.advance(100)
    q.resume([a, e])
    for _ in range(2):
        task_id, token = claim_one(q)
        if task_id == a:
            q.complete(a, token, "ok")
        else:
            q.pause(e, token, clock.now + 5, "cooldown", model="sim/z")
    clock.advance(5)
    q.resume([e])

    k1, k2, k3, k4 = kpi.compute(db)
    assert (k1.numerator, k1.denominator, k1.shown(), k1.passed) == (2, 3, "66.7 %", False)
    assert (k2.numerator, k2.denominator, k2.shown(), k2.passed) == (1, 2, "50.0 %", False)
    assert (k3.numerator, k3.denominator, k3.passed) == (4, 5, False)
    assert (k4.numerator, k4.denominator, k4.shown(), k4.passed) == (1, 2, "1", False)
    # A window that starts after all of it counts nothing.
    later = kpi.compute(db, since=clock.now - 1)
    assert [k.denominator for k in later] == [0, 0, 0, 0]
    with db.engine.connect() as conn:
        summary = conn.execute(
            sa.text("SELECT numerator, denominator FROM kpi_summary ORDER BY kpi")
        ).all()
    assert [tuple(r) for r in summary] == [(2, 3), (1, 2), (4, 5), (1, 2)]


def test_parse_duration() -> None:
    assert [kpi.parse_duration(x) for x in ("90", "90s", "15m", "2h", "1.5d")] == [
        90,
        90,
        900,
        7200,
        129600,
    ]
    with pytest.raises(Exception, match="invalid duration"):
        kpi.parse_duration("soon")


def _client(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"the {name} client is needed under CI", pytrace=False)
        pytest.skip(f"no {name} client on this machine")
    return path


def test_kpi_sql_runs_in_the_real_clients(db: Database, db_url: str, clock: FakeClock) -> None:
    q = TaskQueue(db)
    q.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",)))
    task_id, token = claim_one(q)
    q.pause(
        task_id,
        token,
        2e9,
        "cooldown",
        model="sim/a",
        routes=[route(task_id, token, "sim/a", "call", "rate_limited", 1.0)],
    )
    CooldownStore(db).set("sim/a", 2e9, reason="429")
    script = Path("shared/admin/kpi.sql").read_text()
    if db.dialect == "sqlite":
        argv = [_client("sqlite3"), "-bail", str(db.url.database)]
    else:
        conninfo = db.url.set(drivername="postgresql").render_as_string(hide_password=False)
        argv = [_client("psql"), "-X", "-v", "ON_ERROR_STOP=1", "-A", "-F", "|", conninfo]
    done = subprocess.run(argv, input=script, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "1|preservation|100.0|100 %|1|1|" in out
    assert "sim/a|2000000000.0" in out or "sim/a|2000000000|" in out
    assert "|paused_tasks" not in out  # one value per line, not a header in sqlite mode
    lines = [line for line in out.splitlines() if line.strip()]
    assert any(line.strip() == "1" for line in lines)  # the paused count


def test_the_names_are_the_views(db: Database) -> None:
    """kpi.META, read instead of running kpi_summary for its names, is the view's text."""
    with db.engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT kpi, name, meaning, target FROM kpi_summary")).all()
    assert {r.kpi: (r.name, r.meaning, r.target) for r in rows} == kpi.META


def test_kpi_1_over_a_window_counts_what_the_view_does(db: Database) -> None:
    """KPI 1 over a window has its own query (the view's window reads all of route_log):
    claims whose rows straddle the window's start count as the view counts them."""
    routes = [  # task, token, decision, outcome, at
        (1, 1, "skip", None, 10.0),
        (1, 1, "call", "rate_limited", 20.0),
        (2, 1, "skip", None, 10.0),
        (2, 1, "call", "ok", 20.0),
        (3, 1, "refuse", None, 15.0),
        (4, 1, "skip", None, 30.0),
        (5, 2, "call", "timeout", 5.0),
        (5, 2, "skip", None, 25.0),
    ]
    ends = [(1, 1, "paused", 21.0), (2, 1, "done", 21.0), (3, 1, "failed", 16.0)]
    ends.append((5, 2, "paused", 26.0))
    with db.engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO route_log (task_id, claim_token, agent, model, decision, outcome,"
                " at) VALUES (:t, :k, 'a', 'sim/a', :d, :o, :at)"
            ),
            [dict(zip(("t", "k", "d", "o", "at"), r, strict=True)) for r in routes],
        )
        conn.execute(
            sa.text(
                "INSERT INTO task_events (task_id, claim_token, from_status, to_status, at)"
                " VALUES (:t, :k, 'claimed', :s, :at)"
            ),
            [dict(zip(("t", "k", "s", "at"), e, strict=True)) for e in ends],
        )
    seen = set()
    with db.engine.connect() as conn:
        for since in (0.0, 5.0, 10.0, 15.0, 16.0, 20.0, 21.0, 25.0, 30.0, 31.0):
            by_view = conn.execute(
                sa.text(
                    "SELECT COUNT(CASE WHEN outcome = 'paused' THEN 1 END), COUNT(outcome)"
                    " FROM kpi_cooldown_hits WHERE at >= :since"
                ),
                {"since": since},
            ).one()
            k1 = kpi.compute(db, since=since)[0]
            assert (k1.numerator, k1.denominator) == tuple(by_view), since
            seen.add(tuple(by_view))
    assert {(2, 3), (1, 1), (0, 0)} <= seen
