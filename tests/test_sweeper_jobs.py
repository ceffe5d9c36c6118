"""Each sweeper job with an injected clock, on SQLite and Postgres."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from structlog.testing import capture_logs

from agentbus.admission import workspace_events
from agentbus.admission.routing import Route
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.errors import TransitionRejected
from agentbus.queue import reads
from agentbus.queue import workers as worker_rows
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import (
    bus_counters,
    bus_events,
    call_slots,
    model_cooldown,
    ops_todos,
    route_log,
    task_events,
    workers,
)
from agentbus.sweeper import jobs
from agentbus.sweeper.policy import DueTask, plan_resume
from tests.support import FakeClock

HOUR = 3600.0


@pytest.fixture
def sweep(db: Database, clock: FakeClock) -> jobs.Sweep:
    return jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)


def paused_task(
    s: jobs.Sweep,
    in_sec: float,
    models: tuple[str, ...] = ("sim/a", "sim/b"),
    model: str = "sim/a",
    agent: str = "codex",
) -> int:
    task_id = s.queue.enqueue(TaskSpec(agent=agent, command="x", models=models)).id
    (task,) = s.queue.claim(agent, "w", 30)
    assert task.id == task_id
    s.queue.pause(task.id, task.claim_token, s.clock() + in_sec, "cooldown", model=model)
    return task_id


def test_only_due_pauses_are_resumed(sweep: jobs.Sweep, clock: FakeClock) -> None:
    due = paused_task(sweep, 10)
    later = paused_task(sweep, 100)
    clock.advance(10)
    with capture_logs() as logs:
        assert jobs.resume(sweep) == {"resumed": 1, "postponed": 0, "held": 0}
    assert [e["event"] for e in logs] == [
        f"[cooldown-resume] task_id={due} agent=codex → re-queued"
    ]
    task = sweep.queue.get(due)
    assert (task.status, task.resume_after, task.resume_count, task.updated_at) == (
        "queued",
        None,
        1,
        clock.now,
    )
    assert reads.task_events(sweep.db, due)[-1]["reason"] == "resume"
    assert sweep.queue.get(later).status == "paused"
    assert jobs.next_wake(sweep) == sweep.queue.get(later).resume_after
    assert [t.id for t in sweep.queue.claim("codex", "w", 30)] == [due]


def test_due_task_whose_models_still_cool_moves_to_the_earliest_expiry(
    sweep: jobs.Sweep, clock: FakeClock
) -> None:
    task_id = paused_task(sweep, 10)
    sweep.cooldowns.set("sim/a", clock.now + 50, reason="429")
    sweep.cooldowns.set("sim/b", clock.now + 30, reason="429")
    clock.advance(10)
    assert jobs.resume(sweep)["postponed"] == 1
    task = sweep.queue.get(task_id)
    assert (task.status, task.resume_after) == ("paused", clock.now + 20)
    assert jobs.resume(sweep) == {"resumed": 0, "postponed": 0, "held": 0}  # no busy loop
    clock.advance(20)  # sim/b is free now, sim/a still cools
    assert jobs.resume(sweep)["resumed"] == 1


def test_reentry_rule_holds_the_fourth_resume_five_minutes(
    sweep: jobs.Sweep, clock: FakeClock
) -> None:
    task_id = paused_task(sweep, 180)
    for _ in range(3):  # resumed, then straight back into sim/a's cooldown: three times
        clock.advance(180)
        assert jobs.resume(sweep)["resumed"] == 1
        (task,) = sweep.queue.claim("codex", "w", 30)
        sweep.queue.pause(task.id, task.claim_token, clock.now + 60, "cooldown", model="sim/a")
    paused = sweep.queue.get(task_id)
    assert paused.reentry_count == 3
    clock.advance(60)
    with capture_logs() as logs:
        assert jobs.resume(sweep) == {"resumed": 0, "postponed": 0, "held": 1}
    assert logs[0]["event"].startswith(
        f"[reentry-hold] task_id={task_id} agent=codex model=sim/a reentries=3 → resume at "
    )
    held = sweep.queue.get(task_id)
    assert held.resume_after == paused.paused_at + 300
    assert "re-entered the cooldown of sim/a 3 times" in (held.pause_reason or "")
    clock.advance(239)
    assert jobs.resume(sweep)["resumed"] == 0
    clock.advance(1)
    assert jobs.resume(sweep)["resumed"] == 1


def test_48h_demotion_counts_from_the_first_pause(sweep: jobs.Sweep, clock: FakeClock) -> None:
    task_id = paused_task(sweep, 180)
    first = clock.now
    for cycle in range(20):  # resume/re-pause cycles (40 h) do not restart the 48 h
        clock.now = sweep.queue.get(task_id).resume_after or 0
        assert jobs.resume(sweep)["resumed"] == 1
        (task,) = sweep.queue.claim("codex", "w", 30)
        model = f"sim/{cycle % 2}"
        sweep.queue.pause(task.id, task.claim_token, clock.now + 2 * HOUR, "cooldown", model=model)
    clock.now = first + 48 * HOUR - 1
    assert jobs.demote(sweep) == {"demoted": 0}
    clock.now = first + 48 * HOUR
    assert jobs.demote(sweep) == {"demoted": 1}
    assert jobs.demote(sweep) == {"demoted": 0}
    task = sweep.queue.get(task_id)
    assert task.status == "failed" and "paused for more than 48 h" in (task.last_error or "")
    with sweep.db.engine.connect() as conn:
        todos = conn.execute(sa.select(ops_todos)).all()
    assert [(r.kind, r.task_id, r.agent) for r in todos] == [("demoted", task_id, "codex")]
    assert "48 h" in todos[0].why and todos[0].created_at == clock.now


def test_purge_deletes_only_ended_cooldowns(sweep: jobs.Sweep, clock: FakeClock) -> None:
    sweep.cooldowns.set("old", clock.now + 5, reason="429")
    sweep.cooldowns.set("live", clock.now + 500, reason="429")
    clock.advance(5)
    assert jobs.purge(sweep) == {"purged": 1, "slots_purged": 0}
    with sweep.db.engine.connect() as conn:
        assert conn.execute(sa.select(model_cooldown.c.model_id)).scalars().all() == ["live"]


def test_rescue_requeues_expired_claims_and_fails_poison_pills(
    sweep: jobs.Sweep, clock: FakeClock
) -> None:
    task_id = sweep.queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",))).id
    tokens = []
    for rescue in (1, 2):
        (task,) = sweep.queue.claim("codex", f"w{rescue}", 30)
        tokens.append(task.claim_token)
        clock.advance(29)
        assert jobs.rescue(sweep)["rescued"] == 0  # the lease has not expired yet
        clock.advance(2)
        assert jobs.rescue(sweep)["rescued"] == 1
        again = sweep.queue.get(task_id)
        assert (again.status, again.rescue_count, again.claimed_by) == ("queued", rescue, None)
        with pytest.raises(TransitionRejected):  # the old holder can no longer write
            sweep.queue.complete(task_id, task.claim_token, "late")
    (task,) = sweep.queue.claim("codex", "w3", 30)
    clock.advance(31)
    assert jobs.rescue(sweep) == {"rescued": 0, "poisoned": 1, "workers_pruned": 0}
    dead = sweep.queue.get(task_id)
    assert dead.status == "failed" and "lease expired 3 times (last held by w3)" in (
        dead.last_error or ""
    )
    assert tokens == [1, 2] and task.claim_token == 3


def test_a_heartbeat_keeps_the_task_and_stale_workers_go_after_rescue(
    sweep: jobs.Sweep, clock: FakeClock
) -> None:
    sweep.queue.enqueue_many(
        [TaskSpec(agent="codex", command=str(i), models=("sim/a",)) for i in range(2)]
    )
    alive, dead = sweep.queue.claim("codex", "alive", 30, limit=2)
    for name in ("alive", "dead"):
        worker_rows.WorkerRegistry(sweep.db, name, "codex", clock=clock).register()
    clock.advance(25)
    sweep.queue.heartbeat(alive.id, alive.claim_token, 30)
    worker_rows.WorkerRegistry(sweep.db, "alive", "codex", clock=clock).beat()
    clock.advance(600)  # dead's row is now older than worker_stale_sec
    sweep.queue.heartbeat(alive.id, alive.claim_token, 30)
    worker_rows.WorkerRegistry(sweep.db, "alive", "codex", clock=clock).beat()
    assert jobs.rescue(sweep) == {"rescued": 1, "poisoned": 0, "workers_pruned": 1}
    assert sweep.queue.get(alive.id).status == "claimed"
    assert sweep.queue.get(dead.id).status == "queued"
    with sweep.db.engine.connect() as conn:
        assert conn.execute(sa.select(workers.c.id)).scalars().all() == ["alive"]


def test_prune_deletes_old_finished_tasks_with_their_events(db: Database, clock: FakeClock) -> None:
    s = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)
    ids = s.queue.enqueue_many(
        [TaskSpec(agent="a", command=str(i), models=("sim/a",)) for i in range(3)]
    )
    done, failed, live = s.queue.claim("a", "w", 30, limit=3)
    s.queue.complete(done.id, done.claim_token)
    s.queue.fail(failed.id, failed.claim_token, "bad")
    clock.advance(7 * 24 * HOUR + 1)
    assert jobs.prune(s) == {"pruned": 1}
    clock.advance(23 * 24 * HOUR)
    assert jobs.prune(s) == {"pruned": 1}
    assert [t.id for t in reads.list_tasks(db)] == [live.id]
    with db.engine.connect() as conn:
        left = set(conn.execute(sa.select(task_events.c.task_id)).scalars())
    assert left == {live.id} and set(ids) - left == {done.id, failed.id}
    keep = jobs.Sweep(
        db, LiveConfig.fixed(Settings(done_retention_sec=0, failed_retention_sec=0)), clock=clock
    )
    s.queue.complete(live.id, live.claim_token)
    clock.advance(365 * 24 * HOUR)
    assert jobs.prune(keep) == {"pruned": 0}


def test_old_routes_keys_and_cooldowns_go_in_bounded_batches(
    db: Database, clock: FakeClock
) -> None:
    """Routing history, idempotency keys and cooldown history past their retention are
    deleted ``batch`` rows to a transaction, at most ``max_batches`` a pass: millions of
    old rows are never one transaction. Younger rows stay."""
    from agentbus.queue import retention
    from agentbus.schema import cooldown_history, idempotency_keys

    def rows(at: float) -> None:
        db.write(
            lambda conn: (
                conn.execute(
                    sa.insert(route_log),
                    [
                        {"task_id": 1, "claim_token": 1, "agent": "a", "model": "m"}
                        | {"decision": "call", "at": at}
                    ]
                    * 5,
                ),
                conn.execute(
                    sa.insert(idempotency_keys),
                    [{"key": f"k{at}-{i}", "task_id": 1, "created_at": at} for i in range(5)],
                ),
                conn.execute(
                    sa.insert(cooldown_history),
                    [{"model_id": "m", "cooldown_until": at, "set_at": at}] * 5,
                ),
            )
        )

    def counts() -> list[int]:
        tables = (route_log, idempotency_keys, cooldown_history)
        return db.read(
            lambda conn: [
                conn.execute(sa.select(sa.func.count()).select_from(t)).scalar_one() for t in tables
            ]
        )

    rows(clock.now)
    clock.advance(100)
    rows(clock.now)
    keep = {"done_sec": 50.0, "failed_sec": 50.0, "routes_sec": 50.0, "keys_sec": 50.0}
    retention.prune(db, clock.now, batch=2, max_batches=2, **keep)
    assert counts() == [6, 6, 6]  # 2 batches of 2 went from each table's 5 old rows
    retention.prune(db, clock.now, batch=2, max_batches=100, **keep)
    assert counts() == [5, 5, 5]  # the old ones, whatever was left; the young kept


def test_plan_resume_is_pure() -> None:
    due = [
        DueTask(1, "a", ("m1", "m2"), 10.0, 0.0, "m1", 0),
        DueTask(2, "a", ("m1",), 10.0, 0.0, "m1", 0),
        DueTask(3, "a", None, 10.0, 0.0, None, 0),
        DueTask(4, "a", ("m2",), 10.0, 5.0, "m2", 3),
    ]
    plan = plan_resume(due, {("a", "m1"): 40.0}, reentry_limit=3, reentry_hold_sec=300)
    assert plan.resume == [1, 3]
    assert plan.postpone == {2: 40.0}
    assert plan.hold == {4: 305.0}


def test_plan_resume_resumes_no_more_tasks_than_there_is_room_for() -> None:
    due = [DueTask(i, "a", ("m1", "m2"), 10.0, 0.0, "m1", 0) for i in range(1, 6)]
    due.append(DueTask(6, "b", ("m1",), 10.0, 0.0, "m1", 0))
    plan = plan_resume(
        due,
        {("a", "m2"): 50.0},
        reentry_limit=3,
        reentry_hold_sec=300,
        room={("a", "m1"): 2, ("b", "m1"): 0},
        recheck_at=12.0,
    )
    assert plan.resume == [1, 2]  # two calls fit now; the others would only pause again
    assert plan.postpone == {3: 12.0, 4: 12.0, 5: 12.0, 6: 12.0}
    assert plan.room_left == {("a", "m1"): 0, ("b", "m1"): 0}


def test_plan_resume_spends_the_token_windows_by_each_task_s_estimate() -> None:
    from agentbus.admission.tokens import Tokens

    def task(i: int, need: int, chain: tuple[str, ...] = ("m1", "m2")) -> DueTask:
        needs = {m: Tokens(need, 10) for m in chain}
        return DueTask(i, "a", chain, 10.0, 0.0, "m1", 0, needs)

    plan = plan_resume(
        [task(1, 500), task(2, 600), task(3, 300), task(4, 90, ("m2",)), task(5, 1)],
        {},
        reentry_limit=3,
        reentry_hold_sec=300,
        room={("a", "m1"): 5},
        recheck_at=12.0,
        tokens={("a", "m1"): {"tpm": 1000, "otpm": 100}, ("a", "m2"): {"itpm": 100}},
    )
    # 1 takes 510 of m1's 1000; 2 fits neither m1 (490 left) nor m2 (100); 3 takes 310
    # of m1; 4 takes 90 of m2; 5 fits m1's 180 left, so m2 is not spent.
    assert plan.resume == [1, 3, 4, 5]
    assert plan.postpone == {2: 12.0}
    assert plan.tokens_left == {("a", "m1"): {"tpm": 169, "otpm": 70}, ("a", "m2"): {"itpm": 10}}
    assert plan.room_left == {("a", "m1"): 2}


def test_old_routing_history_and_spent_call_slots_are_purged(
    db: Database, clock: FakeClock
) -> None:
    s = jobs.Sweep(
        db, LiveConfig.fixed(Settings(route_retention_sec=3600, rpm_window_sec=60)), clock=clock
    )
    task = s.queue.enqueue(TaskSpec(agent="a", command="x", models=("sim/a",)))
    (claimed,) = s.queue.claim("a", "w", 30)
    route = Route(
        task.id, claimed.claim_token, "a", "sim/a", "call", clock.now, worker="w", outcome="ok"
    )
    s.queue.complete(claimed.id, claimed.claim_token, routes=[route])
    slot = {"provider": "sim", "model": "sim/a", "agent": "a", "admitted_at": clock.now}
    db.write(
        lambda conn: conn.execute(
            sa.insert(call_slots),
            [
                {**slot, "lease_until": clock.now + 30, "released_at": clock.now + 1},
                {**slot, "lease_until": clock.now + 600, "released_at": None},  # held: kept
            ],
        )
    )
    db.write(
        lambda conn: workspace_events.emit(conn, "refused_batch", clock.now, detail={"count": 2})
    )
    clock.advance(61)
    assert jobs.purge(s) == {"purged": 0, "slots_purged": 1}
    clock.advance(3600)
    db.write(lambda conn: workspace_events.emit(conn, "budget_warning", clock.now))
    jobs.prune(s)
    with db.engine.connect() as conn:
        assert conn.execute(sa.select(sa.func.count()).select_from(route_log)).scalar() == 0
        assert conn.execute(sa.select(sa.func.count()).select_from(call_slots)).scalar() == 1
        # workspace events go with the routing history; what they counted stays
        kinds = conn.execute(sa.select(bus_events.c.kind)).scalars().all()
        assert kinds == ["budget_warning"]
        counted = sa.select(bus_counters.c.value).where(bus_counters.c.name == "budget_refused")
        assert conn.execute(counted).scalar() == 2
    assert reads.get_task(db, task.id).status == "done"  # the task itself is kept longer


def test_an_idempotency_key_outlives_its_pruned_task(db: Database, clock: FakeClock) -> None:
    s = jobs.Sweep(db, LiveConfig.fixed(Settings()), clock=clock)  # done 7 d, keys 30 d
    first = s.queue.enqueue(TaskSpec(agent="a", command="x", models=("sim/a",), key="report-1"))
    (claimed,) = s.queue.claim("a", "w", 30)
    s.queue.complete(claimed.id, claimed.claim_token, "sent")
    clock.advance(8 * 24 * HOUR)
    assert jobs.prune(s) == {"pruned": 1}  # the task is gone ...
    again = s.queue.enqueue(TaskSpec(agent="a", command="x", models=("sim/a",), key="report-1"))
    assert (again.id, again.created) == (first.id, False)  # ... its key still names it
    assert reads.counts(db) == {}  # and nothing runs again
    clock.advance(23 * 24 * HOUR)  # 31 days after the enqueue: the key is forgotten too
    jobs.prune(s)
    later = s.queue.enqueue(TaskSpec(agent="a", command="x", models=("sim/a",), key="report-1"))
    assert later.created and later.id != first.id


def test_one_failing_job_does_not_stop_the_others(
    sweep: jobs.Sweep, monkeypatch: pytest.MonkeyPatch, clock: FakeClock
) -> None:
    from agentbus.sweeper.service import run_once

    s = sweep
    task = s.queue.enqueue(TaskSpec(agent="a", command="x", models=("sim/a",)))
    (claimed,) = s.queue.claim("a", "w", 30)
    clock.advance(60)  # the lease expired: rescue has work

    def demote(_s: jobs.Sweep) -> dict[str, int]:
        raise sa.exc.OperationalError(
            "INSERT INTO ops_todos",
            {},
            Exception("ON CONFLICT clause does not match any PRIMARY KEY or UNIQUE constraint"),
        )

    monkeypatch.setattr(jobs, "ALL", (jobs.rescue, demote, jobs.resume, jobs.purge, jobs.prune))
    with capture_logs() as logs:
        counts = run_once(s)
    assert counts["failed_jobs"] == 1
    assert counts["rescued"] == 1 and "purged" in counts and "pruned" in counts
    assert s.queue.get(task.id).status == "queued" and claimed.id == task.id
    (failure,) = [e for e in logs if e["event"] == "sweep_job_failed"]
    assert failure["job"] == "demote"
    assert failure["error"] == (
        "Exception: ON CONFLICT clause does not match any PRIMARY KEY or UNIQUE constraint"
    )


def test_stopping_waits_for_a_job_that_is_scheduling_the_next_wake(
    sweep: jobs.Sweep, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's shutdown holds its job-store lock while it waits for the running
    job; a job scheduling the next wake takes that lock. Stopping must not wait on it."""
    import threading

    from agentbus.sweeper import service as sweeper_service

    inside, release = threading.Event(), threading.Event()

    def held_next_wake(s: jobs.Sweep) -> float:
        inside.set()
        release.wait(30)
        return s.clock() + 3600  # a wake to schedule: add_job

    monkeypatch.setattr(jobs, "next_wake", held_next_wake)
    monkeypatch.setattr(sweeper_service, "run_once", lambda s: {})
    service = sweeper_service.SweeperService(sweep, interval=3600, peek=3600)
    runner = threading.Thread(target=service.run, daemon=True)
    runner.start()
    assert inside.wait(30)  # the first pass is scheduling its wake
    service.stop()
    release.set()
    runner.join(30)
    assert not runner.is_alive(), "the sweeper did not stop"
    assert service.scheduler.state == 0  # STATE_STOPPED
