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
