"""Admission across real worker processes (SQLite and Postgres), judged from the
simulated provider's journal and the database."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.admission.gates import next_day
from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands, call_slots, circuits, route_log, task_events
from tests.support import Proc, release_two_in_flight, wait_until

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]


def journal(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    calls = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted(calls, key=lambda c: c["started"])


def most_in_window(times: list[float], window: float) -> int:
    times = sorted(times)
    return max(
        (sum(1 for t in times[i:] if t < start + window) for i, start in enumerate(times)),
        default=0,
    )


def setup(tmp_path: Path, config: str) -> tuple[dict[str, str], Path]:
    path = tmp_path / "agentbus.toml"
    path.write_text(config)
    calls = tmp_path / "journal.jsonl"
    env = {
        "AGENTBUS_CONFIG": str(path),
        "AGENTBUS_SIM_JOURNAL": str(calls),
        "AGENTBUS_POLL_SEC": "0.1",
        "AGENTBUS_SWEEP_PEEK_SEC": "0.2",
        "AGENTBUS_CALL_RETRIES": "0",
    }
    return env, calls


def enqueue(
    queue: TaskQueue, n: int, script: dict[str, Any] | None = None, **spec: Any
) -> list[int]:
    spec.setdefault("models", ("sim/a",))
    payload = {"simulate": script} if script else {}
    return [
        queue.enqueue(TaskSpec(agent="codex", command=f"task {i}", payload=payload, **spec)).id
        for i in range(n)
    ]


@pytest.fixture
def live_queue(db_url: str) -> Iterator[TaskQueue]:
    """A queue on the wall clock: the processes under test run on it too."""
    db = Database(db_url)
    yield TaskQueue(db)
    db.dispose()


def statuses(db: Database, ids: list[int]) -> dict[int, str]:
    rows = db.read(
        lambda conn: conn.execute(
            sa.select(bus_commands.c.id, bus_commands.c.status).where(bus_commands.c.id.in_(ids))
        ).all()
    )
    return dict(rows)


def workers(spawn: Spawn, db_url: str, env: dict[str, str], n: int, *extra: str) -> list[Proc]:
    return [
        spawn("worker", "--agent", "codex", "--db", db_url, "--log-json", *extra, env=env)
        for _ in range(n)
    ]


def stop(procs: list[Proc]) -> None:
    """SIGTERM each process once it has started (a signal before its handler is in place
    would kill it: a fast test can finish while a slow process still imports)."""
    for p in procs:
        wait_until(lambda p=p: "worker_started" in p.text() or "sweeper_started" in p.text())
        p.signal(signal.SIGTERM)
    assert [p.wait() for p in procs] == [0] * len(procs), [p.text()[-2000:] for p in procs]


RPM = """
rpm_window_sec = 4
[providers.sim]
kind = "simulated"
rpm = 10
"""


def test_rpm_shared_by_three_workers_pauses_until_the_window_frees(
    db_url: str,
    live_queue: TaskQueue,
    spawn: Spawn,
    tmp_path: Path,
    run_busctl: Callable[..., subprocess.CompletedProcess[str]],
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, RPM)
    ids = enqueue(queue, 25)
    drained = workers(spawn, db_url, env, 3, "--drain")
    assert [p.wait() for p in drained] == [0, 0, 0], [p.text()[-2000:] for p in drained]
    db = queue.db
    assert len(journal(calls)) == 10  # the first window's worth, from three processes
    admitted = db.read(
        lambda conn: conn.execute(sa.select(call_slots.c.admitted_at)).scalars().all()
    )
    assert len(admitted) == 10
    paused = [t for t in (queue.get(i) for i in ids) if t.status == "paused"]
    assert len(paused) == 15
    for task in paused:
        pause = next(e for e in reads.task_events(db, task.id) if e["to_status"] == "paused")
        in_window = [a for a in admitted if pause["at"] - 4 < a <= pause["at"]]
        assert len(in_window) == 10  # refused because the window was full…
        assert task.resume_after == pytest.approx(min(in_window) + 4)  # …until its oldest left
        assert "rate_limited" in (task.pause_reason or "")
        # The refusal as users see it, on the route row and on the pause event: how long
        # from the moment of the refusal (the row's ``at``) until the window frees.
        (route,) = reads.routes(db, task_id=task.id)
        assert route["decision"] == "refuse" and route["retry_after"] == task.resume_after
        wait_ms = round((route["retry_after"] - route["at"]) * 1000)
        assert (
            route["refusal"]
            == pause["detail"]["refusals"]["sim/a"]
            == {
                "code": -32000,
                "name": "rate_limited",
                "retry_after_ms": wait_ms,
                "suggested_action": "DO_NOT_RETRY_IMMEDIATELY",
                "gate": "rpm",
                "detail": "rpm: 10 calls per 4s for sim/-",
            }
        )
    shown = run_busctl("--db", db_url, "show", str(paused[0].id))
    assert "refusals at the last pause" in shown.stdout and "-32000" in shown.stdout
    assert "DO_NOT_RETRY_IMMEDIATELY" in run_busctl("--db", db_url, "routes").stdout

    # The sweeper resumes them as the window frees; the limit holds throughout.
    procs = [*workers(spawn, db_url, env, 3), spawn("sweeper", "--db", db_url, env=env)]
    wait_until(lambda: set(statuses(db, ids).values()) == {"done"}, timeout=90)
    stop(procs)
    # Each task was called once, and no window of 4 s ever held more than 10 admissions.
    # (When a call reaches the provider after its admission is up to the scheduler: the
    # admissions are what the limit counts. The sweeper purges those older than every
    # window, so the rows left are checked, not counted.)
    assert sorted(c["task_id"] for c in journal(calls)) == sorted(ids)
    admitted = db.read(
        lambda conn: conn.execute(sa.select(call_slots.c.admitted_at)).scalars().all()
    )
    assert most_in_window(admitted, 4) <= 10


CONCURRENCY = """
admission_recheck_sec = 0.3
[providers.sim]
kind = "simulated"
concurrency = 2
"""


def test_concurrency_two_across_four_workers(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, CONCURRENCY)
    # Each call lasts until the test releases it: it lets one go only while two
    # are in flight, so overlap is shown however slowly the processes run.
    gates = [tmp_path / f"gate{i}" for i in range(12)]
    ids = [
        enqueue(queue, 1, {"sim/a": {"behaviour": "ok", "wait_for": str(gate)}})[0]
        for gate in gates
    ]
    procs = [*workers(spawn, db_url, env, 4), spawn("sweeper", "--db", db_url, env=env)]
    release_two_in_flight(gates)
    wait_until(lambda: set(statuses(queue.db, ids).values()) == {"done"}, timeout=90)
    stop(procs)
    spans = [(c["started"], c["time"]) for c in journal(calls)]
    assert len(spans) == 12
    overlap = max(sum(1 for s, e in spans if s <= start < e) for start, _ in spans)
    assert overlap == 2  # never more than two in flight, and the two were used


CIRCUIT = """
circuit_consecutive_failures = 2
circuit_open_sec = 2
admission_recheck_sec = 0.3
[providers.sim]
kind = "simulated"
"""


def test_after_the_open_period_exactly_one_probe_is_sent(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, CIRCUIT)
    db = queue.db
    enqueue(queue, 2, {"sim/a": "error"}, max_attempts=1)
    (first,) = workers(spawn, db_url, env, 1, "--drain")
    assert first.wait() == 0, first.text()
    row = db.read(lambda conn: conn.execute(sa.select(circuits)).one())
    assert row.state == "open" and row.consecutive_failures == 2
    failed_calls = len(journal(calls))

    # The probe's call is held until others have been refused by the half-open circuit.
    gate = tmp_path / "probe-may-finish"
    ids = enqueue(queue, 8, {"sim/a": {"behaviour": "ok", "wait_for": str(gate)}})
    procs = [*workers(spawn, db_url, env, 4), spawn("sweeper", "--db", db_url, env=env)]
    wait_until(lambda: Path(f"{gate}.waiting").exists(), timeout=60)
    refused = sa.select(sa.func.count()).where(route_log.c.code == "circuit_open")
    wait_until(lambda: db.read(lambda conn: conn.execute(refused).scalar()), timeout=60)
    gate.touch()
    wait_until(lambda: set(statuses(db, ids).values()) == {"done"}, timeout=90)
    stop(procs)
    after = journal(calls)[failed_calls:]
    assert len(after) == 8
    probe = after[0]
    assert probe["started"] >= row.open_until
    # No other call went out while the probe was in flight, from any process.
    assert all(c["started"] >= probe["time"] for c in after[1:])
    assert db.read(lambda conn: conn.execute(sa.select(circuits.c.state)).scalar_one()) == "closed"
    probes = sum(1 for p in procs[:4] for e in p.events() if e["event"] == "circuit_probe")
    assert probes == 1


ROUTING = """
daily_token_budget = 45
[providers.sim]
kind = "simulated"
[providers.sim.accounts.a]
key_env = "SIM_KEY_A"
[providers.sim.accounts.b]
key_env = "SIM_KEY_B"

[roles.primary]
candidates = ["sim/p"]
fallback = "backup"

[roles.backup]
candidates = ["sim/q"]

[agents.codex]
role = "primary"
"""


def test_fallback_role_account_rotation_and_budget(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, ROUTING)
    env |= {"SIM_KEY_A": "key-a", "SIM_KEY_B": "key-b"}
    db = queue.db
    rotate = enqueue(
        queue, 1, {"sim/p": {"behaviour": "auth", "accounts": ["a"]}}, models=None, role="primary"
    )
    plain = enqueue(queue, 1, None, models=None, role="primary")
    fallback = enqueue(queue, 1, {"sim/p": "rate_limited"}, models=None, role="primary")
    rest = enqueue(
        queue, 4, None, models=None, role="primary"
    )  # 10 tokens a call: the budget ends inside these
    (worker,) = workers(spawn, db_url, env, 1, "--drain")
    assert worker.wait() == 0, worker.text()
    seen = [(c["task_id"], c["model"], c["account"], c["outcome"]) for c in journal(calls)]
    assert seen[:5] == [
        (rotate[0], "sim/p", "a", "auth"),  # a refused credential…
        (rotate[0], "sim/p", "b", "ok"),  # …the next account takes the call
        (plain[0], "sim/p", "b", "ok"),  # and account a is left out from now on
        (fallback[0], "sim/p", "b", "rate_limited"),
        (fallback[0], "sim/q", "b", "ok"),  # the fallback role
    ]
    route = db.read(
        lambda conn: conn.execute(
            sa.select(route_log).where(
                route_log.c.task_id == fallback[0], route_log.c.model == "sim/q"
            )
        ).one()
    )
    assert (route.role, route.fallback_from, route.provider, route.account) == (
        "backup",
        "primary",
        "sim",
        "b",
    )
    assert route.prompt_tokens + route.completion_tokens == 10  # 2 words + 8

    done = [t for t in (queue.get(i) for i in rest) if t.status == "done"]
    paused = [t for t in (queue.get(i) for i in rest) if t.status == "paused"]
    assert len(done) == 2 and len(paused) == 2  # 50 tokens settled when the third was asked
    for task in paused:
        assert "budget_exhausted" in (task.pause_reason or "")
        assert task.resume_after == next_day(task.paused_at or 0)
    usage = reads.usage_by_day(db, time.time())
    assert sum(u["tokens"] for u in usage) == 50


RELOAD = """
rpm_window_sec = 60
config_check_sec = 0.1
[providers.sim]
kind = "simulated"
rpm = {rpm}
[providers.flaky]
kind = "simulated"
[models."sim/f"]
provider = "flaky"
"""


def test_hot_reload_keeps_the_rpm_window_and_the_circuit(
    db_url: str, live_queue: TaskQueue, spawn: Spawn, tmp_path: Path
) -> None:
    queue = live_queue
    env, calls = setup(tmp_path, RELOAD.format(rpm=3))
    db = queue.db
    now = time.time()
    db.write(
        lambda conn: conn.execute(
            sa.insert(circuits).values(
                provider="flaky",
                endpoint="simulated",
                state="open",
                consecutive_failures=5,
                opened_at=now,
                open_until=now + 120,
                updated_at=now,
            )
        )
    )
    first = enqueue(queue, 3)
    (worker,) = workers(spawn, db_url, env, 1)
    wait_until(lambda: set(statuses(db, first).values()) == {"done"})
    (tmp_path / "agentbus.toml").write_text(RELOAD.format(rpm=4) + "\n# edited\n")
    wait_until(lambda: any(e["event"] == "config_reloaded" for e in worker.events()))
    more = enqueue(queue, 2)
    flaky = enqueue(queue, 1, models=("sim/f",))
    wait_until(
        lambda: (
            "queued" not in statuses(db, more + flaky).values()
            and "claimed" not in statuses(db, more + flaky).values()
        )
    )
    stop([worker])
    assert len(journal(calls)) == 4  # the window kept its 3 calls: one more fits under 4
    assert sorted(statuses(db, more).values()) == ["done", "paused"]
    circuit = queue.get(flaky[0])
    assert circuit.status == "paused" and "circuit_open" in (circuit.pause_reason or "")
    assert circuit.resume_after == pytest.approx(now + 120)
    kinds = db.read(lambda conn: conn.execute(sa.select(task_events.c.to_status)).scalars().all())
    assert "failed" not in kinds
