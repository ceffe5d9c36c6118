"""The queue's operations on both backends, with an injected clock."""

from __future__ import annotations

import dataclasses
import json

import pytest
import sqlalchemy as sa

from agentbus.errors import TaskNotFound, TransitionRejected
from agentbus.queue import Settlement, TaskQueue, reads
from agentbus.queue.decisions import Complete
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import Task, TaskSpec
from agentbus.schema import bus_commands
from tests.support import FakeClock


def spec(agent: str = "codex", text: str = "do it", **kw: object) -> TaskSpec:
    kw.setdefault("models", ("sim/a",))
    return TaskSpec(agent=agent, command=text, **kw)  # type: ignore[arg-type]


def test_enqueue_stores_the_task_and_an_event(queue: TaskQueue, clock: FakeClock) -> None:
    result = queue.enqueue(spec(payload={"k": [1, 2]}, role="coder", priority=3))
    task = queue.get(result.id)
    assert result.created
    assert task.status is TaskStatus.QUEUED
    assert task.payload == {"k": [1, 2]}
    assert task.models == ("sim/a",)
    assert task.role == "coder"
    assert task.created_at == task.run_after == clock.now
    assert task.max_attempts == 3
    events = reads.task_events(queue.db, result.id)
    assert [(e["from_status"], e["to_status"]) for e in events] == [(None, "queued")]


def test_idempotency_key_returns_the_existing_task(queue: TaskQueue) -> None:
    first = queue.enqueue(spec(key="report-2026-11-30"))
    again = queue.enqueue(spec(text="different text", key="report-2026-11-30"))
    other = queue.enqueue(spec(key="another"))
    assert again == type(first)(first.id, created=False)
    assert other.created and other.id != first.id
    assert sum(reads.counts(queue.db).values()) == 2
    assert len(reads.task_events(queue.db, first.id)) == 1


def test_enqueue_many_returns_ids_in_order(queue: TaskQueue) -> None:
    ids = queue.enqueue_many([spec(text=f"t{i}") for i in range(50)])
    assert len(set(ids)) == 50
    assert [queue.get(i).command for i in ids[:3]] == ["t0", "t1", "t2"]
    assert queue.enqueue_many([]) == []


def test_each_task_of_a_batch_gets_its_own_enqueue_event(
    queue: TaskQueue, clock: FakeClock
) -> None:
    ids = queue.enqueue_many([spec(text=f"t{i}") for i in range(3)])
    for task_id in ids:
        events = reads.task_events(queue.db, task_id)
        assert [(e["from_status"], e["to_status"], e["reason"], e["at"]) for e in events] == [
            (None, "queued", "enqueue", clock.now)
        ]


def test_a_batch_of_tasks_stores_every_value_as_given(queue: TaskQueue, clock: FakeClock) -> None:
    """Enqueued together (one statement on PostgreSQL, its columns sent as arrays): quotes,
    backslashes, braces, commas, NULL-looking words, non-ASCII, escaped NULs in a
    payload and missing values arrive unchanged, each in its own task, in order."""
    texts = ['say "hi"', "back\\slash", "{braces, commas}", "NULL", "héllo ✓", "plain"]
    payloads = [
        {"q": 'a "b" \\ c', "n": [1, 2.5, None]},
        {"nul": "before\u0000after"},
        {},
        {"NULL": None, "nested": {"x": {"y": "{}"}}},
        {"ü": "✓"},
        {"messages": [{"role": "user", "content": "hi"}]},
    ]
    chains = [("sim/a",), None, ("sim/a", "sim/b"), None, ("sim/a",), None]
    roles = [None, "coder", None, "NULL", None, "reviewer"]
    specs = [
        TaskSpec(
            agent="codex",
            command=text,
            models=chain,
            role=role,
            payload=payload,
            priority=n - 2,
            delay_sec=float(n),
            max_attempts=n + 1 if n % 2 else None,
        )
        for n, (text, payload, chain, role) in enumerate(
            zip(texts, payloads, chains, roles, strict=True)
        )
    ]
    ids = queue.enqueue_many(specs)
    assert ids == sorted(ids) and len(set(ids)) == len(specs)
    for n, task_id in enumerate(ids):
        task = queue.get(task_id)
        assert task.command == texts[n]
        assert dict(task.payload) == payloads[n]
        assert task.models == chains[n]
        assert task.role == roles[n]
        assert task.priority == n - 2
        assert task.run_after == pytest.approx(clock.now + n)
        assert task.max_attempts == (n + 1 if n % 2 else queue.max_attempts)
        assert task.status is TaskStatus.QUEUED


def test_payloads_and_chains_are_stored_as_json_dumps_writes_them(queue: TaskQueue) -> None:
    """An enqueue stores the JSON text its validation made when that is printable ASCII,
    and encodes again otherwise (non-ASCII, or DEL, which ``json.dumps`` escapes): either
    way the stored text is ``json.dumps``'s, whichever way the task came in (alone, in a
    batch, with a key)."""
    payloads = [{"k": [1, 2.5, None], "s": 'a "b"\x7f'}, {"ü": "✓ 한국어"}, {}]
    chains = [("sim/a", "sim/b"), ("sim/a",), None]
    specs = [
        spec(payload=p, models=c, role=None if c else "coder")
        for p, c in zip(payloads, chains, strict=True)
    ]
    ids = queue.enqueue_many(specs) + queue.enqueue_many(specs[:1])
    ids += [queue.enqueue(specs[1]).id, queue.enqueue(spec(payload=payloads[1], key="k1")).id]
    expected = [0, 1, 2, 0, 1, 1]
    as_text = sa.cast if queue.db.dialect == "postgresql" else sa.type_coerce
    columns = [as_text(bus_commands.c[name], sa.Text) for name in ("payload", "models")]
    for task_id, n in zip(ids, expected, strict=True):
        row = queue.db.read(
            lambda conn, i=task_id: conn.execute(
                sa.select(*columns).where(bus_commands.c.id == i)
            ).one()
        )
        assert row[0] == json.dumps(payloads[n])
        assert row[1] == (None if chains[n] is None else json.dumps(list(chains[n])))


def test_claim_orders_by_priority_then_age(queue: TaskQueue, clock: FakeClock) -> None:
    low = queue.enqueue(spec(text="low", priority=0)).id
    clock.advance(1)
    high = queue.enqueue(spec(text="high", priority=5)).id
    clock.advance(1)
    low2 = queue.enqueue(spec(text="low2", priority=0)).id
    order = [queue.claim("codex", "w", 30)[0].id for _ in range(3)]
    assert order == [high, low, low2]
    assert queue.claim("codex", "w", 30) == []


def test_claim_takes_a_priority_s_tasks_in_the_order_they_came_due(
    queue: TaskQueue, clock: FakeClock
) -> None:
    """Within a priority, the task that came due first goes first, however long ago it
    was queued; the tasks queued for later are never in the way of the due ones."""
    slow = queue.enqueue(spec(text="due in 50 s", delay_sec=50)).id
    far = [queue.enqueue(spec(text="tomorrow", delay_sec=86400)).id for _ in range(3)]
    clock.advance(10)
    soon = queue.enqueue(spec(text="due in 20 s", delay_sec=20)).id
    now = queue.enqueue(spec(text="due now")).id
    assert [t.id for t in queue.claim("codex", "w", 30, limit=5)] == [now]
    clock.advance(45)  # both delayed ones due: the one due first goes first
    assert [t.id for t in queue.claim("codex", "w", 30, limit=5)] == [soon, slow]
    assert queue.due_in("codex") == pytest.approx(86400 - 55)
    assert all(queue.get(i).status is TaskStatus.QUEUED for i in far)  # still for tomorrow


def test_a_resumed_task_keeps_its_place_in_the_queue(queue: TaskQueue, clock: FakeClock) -> None:
    first = queue.enqueue(spec(text="first")).id
    clock.advance(1)
    second = queue.enqueue(spec(text="second")).id
    (task,) = queue.claim("codex", "w", 30)
    assert task.id == first
    queue.pause(first, task.claim_token, clock() + 5, "cooldown")
    clock.advance(10)
    third = queue.enqueue(spec(text="third")).id
    assert queue.resume([first]) == [first]
    order = [t.id for t in queue.claim("codex", "w", 30, limit=3)]
    assert order == [first, second, third]


def test_claim_is_per_agent_and_honours_run_after(queue: TaskQueue, clock: FakeClock) -> None:
    later = queue.enqueue(spec(delay_sec=60)).id
    queue.enqueue(spec(agent="analyst"))
    assert queue.claim("codex", "w", 30) == []
    clock.advance(60)
    claimed = queue.claim("codex", "w", 30)
    assert [t.id for t in claimed] == [later]
    assert claimed[0].agent == "codex"


def test_claim_sets_lease_token_and_event(queue: TaskQueue, clock: FakeClock) -> None:
    task_id = queue.enqueue(spec()).id
    (task,) = queue.claim("codex", "worker-1", 45)
    assert task.status is TaskStatus.CLAIMED
    assert task.claim_token == 1
    assert task.claimed_by == "worker-1"
    assert task.lease_until == clock.now + 45
    last = reads.task_events(queue.db, task_id)[-1]
    assert (last["to_status"], last["worker"], last["claim_token"]) == ("claimed", "worker-1", 1)


def test_a_task_read_from_its_row_is_the_task_its_fields_make(queue: TaskQueue) -> None:
    """``Task.from_row`` sets a frozen Task's fields at once (its __init__ sets each in
    turn): the Task it reads equals, field for field, the one __init__ makes, and
    stays frozen; so does a row that cannot be run (its problem read)."""
    queue.enqueue(spec(payload={"messages": [{"role": "user", "content": "hi"}]}, priority=3))
    bad = queue.enqueue(spec(text="bad")).id
    queue.db.write(
        lambda conn: conn.execute(
            sa.update(bus_commands).where(bus_commands.c.id == bad).values(payload=[1])
        )
    )
    tasks = queue.claim("codex", "w", 30, limit=2)
    assert [t.problem for t in tasks] == [None, "the payload is a JSON list, not a JSON object"]
    for task in tasks:
        fields = {f.name: getattr(task, f.name) for f in dataclasses.fields(Task)}
        assert task == Task(**fields) and vars(task) == fields
        with pytest.raises(dataclasses.FrozenInstanceError):
            task.attempts = 9  # type: ignore[misc]


def test_claim_batch(queue: TaskQueue) -> None:
    queue.enqueue_many([spec(text=str(i)) for i in range(25)])
    got = queue.claim("codex", "w", 30, limit=10)
    assert len(got) == 10 and len({t.id for t in got}) == 10
    assert [t.id for t in got] == sorted(t.id for t in got)


def test_complete_spends_an_attempt_and_ends_the_episode(queue: TaskQueue) -> None:
    queue.enqueue(spec())
    (task,) = queue.claim("codex", "w", 30)
    queue.complete(task.id, task.claim_token, "answer", worker="w")
    done = queue.get(task.id)
    assert (done.status, done.result, done.attempts, done.lease_until) == (
        TaskStatus.DONE,
        "answer",
        1,
        None,
    )


def test_stale_token_cannot_settle(queue: TaskQueue, clock: FakeClock) -> None:
    """A worker whose claim was superseded can no longer write to the task."""
    queue.enqueue(spec())
    (old,) = queue.claim("codex", "w1", 30)
    queue.release(old.id, old.claim_token, reason="rescue-like")
    (new,) = queue.claim("codex", "w2", 30)
    assert new.claim_token == old.claim_token + 1
    for write in (
        lambda: queue.complete(old.id, old.claim_token, "late"),
        lambda: queue.fail(old.id, old.claim_token, "late"),
        lambda: queue.pause(old.id, old.claim_token, clock.now + 5, "cooldown"),
        lambda: queue.heartbeat(old.id, old.claim_token, 30),
    ):
        with pytest.raises(TransitionRejected, match="claimed under token 2"):
            write()
    queue.complete(new.id, new.claim_token, "ok")
    assert queue.get(new.id).result == "ok"


def test_rejected_write_changes_nothing(queue: TaskQueue) -> None:
    task_id = queue.enqueue(spec()).id
    before = (queue.get(task_id), reads.task_events(queue.db, task_id))
    with pytest.raises(TransitionRejected, match="expected claimed, but it is queued"):
        queue.complete(task_id, 0, "x")
    with pytest.raises(TransitionRejected, match="no such task"):
        queue.complete(task_id + 1000, 1, "x")
    assert (queue.get(task_id), reads.task_events(queue.db, task_id)) == before


def test_heartbeat_extends_the_lease(queue: TaskQueue, clock: FakeClock) -> None:
    queue.enqueue(spec())
    (task,) = queue.claim("codex", "w", 30)
    clock.advance(20)
    assert queue.heartbeat(task.id, task.claim_token, 30) == clock.now + 30
    assert queue.get(task.id).lease_until == clock.now + 30


def test_pause_keeps_attempts_and_tracks_the_episode(queue: TaskQueue, clock: FakeClock) -> None:
    task_id = queue.enqueue(spec()).id
    (task,) = queue.claim("codex", "w", 30)
    first_pause = clock.now
    queue.pause(task.id, task.claim_token, clock.now + 180, "cooldown", model="sim/a")
    paused = queue.get(task_id)
    assert paused.status is TaskStatus.PAUSED
    assert (paused.attempts, paused.pause_count, paused.reentry_count) == (0, 1, 0)
    assert paused.resume_after == clock.now + 180
    assert paused.first_paused_at == first_pause
    assert paused.pause_model == "sim/a"
    event = reads.task_events(queue.db, task_id)[-1]
    assert event["detail"]["model"] == "sim/a"


def test_requeue_spends_an_attempt_and_delays(queue: TaskQueue, clock: FakeClock) -> None:
    queue.enqueue(spec())
    (task,) = queue.claim("codex", "w", 30)
    queue.requeue(task.id, task.claim_token, clock.now + 10, "HTTP 500")
    again = queue.get(task.id)
    assert (again.status, again.attempts, again.last_error) == (TaskStatus.QUEUED, 1, "HTTP 500")
    assert queue.claim("codex", "w", 30) == []
    clock.advance(10)
    assert [t.id for t in queue.claim("codex", "w", 30)] == [task.id]


def test_release_spends_nothing(queue: TaskQueue) -> None:
    queue.enqueue(spec())
    (task,) = queue.claim("codex", "w", 30)
    queue.release(task.id, task.claim_token)
    again = queue.get(task.id)
    assert (again.status, again.attempts, again.claimed_by) == (TaskStatus.QUEUED, 0, None)
    assert reads.task_events(queue.db, task.id)[-1]["reason"] == "shutdown"


@pytest.mark.parametrize("settle", ["fail", "error"])
def test_operator_retry(queue: TaskQueue, settle: str) -> None:
    queue.enqueue(spec())
    (task,) = queue.claim("codex", "w", 30)
    getattr(queue, settle)(task.id, task.claim_token, "boom")
    assert queue.get(task.id).status == settle.replace("fail", "failed")
    queue.retry(task.id)
    again = queue.get(task.id)
    assert (again.status, again.attempts) == (TaskStatus.QUEUED, 0)
    assert again.last_error == "boom"
    with pytest.raises(TransitionRejected):
        queue.retry(task.id)
    with pytest.raises(TaskNotFound):
        queue.retry(task.id + 99)


def test_counts_and_listing(queue: TaskQueue) -> None:
    queue.enqueue_many([spec(), spec(), spec(agent="analyst")])
    (task,) = queue.claim("codex", "w", 30)
    assert reads.counts(queue.db) == {
        ("queued", "codex"): 1,
        ("claimed", "codex"): 1,
        ("queued", "analyst"): 1,
    }
    assert [t.id for t in reads.list_tasks(queue.db, status="claimed")] == [task.id]
    assert len(reads.list_tasks(queue.db, agent="analyst")) == 1
    assert len(reads.list_tasks(queue.db, limit=2)) == 2


def test_settle_reports_superseded_claims(queue: TaskQueue) -> None:
    queue.enqueue_many([spec(text=str(i)) for i in range(4)])
    tasks = queue.claim("codex", "w1", 30, limit=4)
    stale = tasks[0]
    queue.release(stale.id, stale.claim_token)
    (reclaimed,) = queue.claim("codex", "w2", 30)
    assert reclaimed.id == stale.id
    items = [
        Settlement(t.id, t.claim_token, Complete(f"answer {t.id}", "sim/a"), detail={"n": t.id})
        for t in tasks
    ]
    lost = queue.settle(items, worker="w1")
    assert [(r.task_id, r.actual) for r in lost] == [
        (stale.id, f"claimed under token {reclaimed.claim_token}")
    ]
    for task in tasks[1:]:
        done = queue.get(task.id)
        assert (done.status, done.result, done.attempts) == (
            TaskStatus.DONE,
            f"answer {task.id}",
            1,
        )
        assert done.result_note == "model=sim/a"
        last = reads.task_events(queue.db, task.id)[-1]
        usage = {"prompt_tokens": 0, "completion_tokens": 0}
        assert (last["worker"], last["detail"]) == (
            "w1",
            {"model": "sim/a", "usage": usage, "n": task.id},
        )
    assert queue.get(stale.id).status is TaskStatus.CLAIMED
    assert queue.settle([]) == []


def test_a_claim_settled_twice_is_rejected_the_second_time(queue: TaskQueue) -> None:
    """Also in a batch, and at the same instant (the injected clock stands still)."""
    queue.enqueue_many([spec(text=str(i)) for i in range(3)])
    first, second, third = queue.claim("codex", "w1", 30, limit=3)
    queue.complete(first.id, first.claim_token, "once")
    items = [Settlement(t.id, t.claim_token, Complete("again")) for t in (first, second, third)]
    lost = queue.settle(items, worker="w1")
    assert [(r.task_id, r.actual) for r in lost] == [(first.id, "done")]
    assert [queue.get(t.id).result for t in (first, second, third)] == ["once", "again", "again"]
    again = queue.settle(items[1:], worker="w1")
    assert [(r.task_id, r.actual) for r in again] == [(second.id, "done"), (third.id, "done")]


def test_reentry_counts_repeat_pauses_on_the_same_model(queue: TaskQueue, clock: FakeClock) -> None:
    """A resumed task that pauses again on the same model: reentry_count rises."""
    task_id = queue.enqueue(spec()).id

    def pause_on(model: str) -> int:
        (task,) = queue.claim("codex", "w", 30)
        queue.pause(task.id, task.claim_token, clock.now + 60, "cooldown", model=model)
        return queue.get(task_id).reentry_count

    first_pause = clock.now
    assert pause_on("sim/a") == 0  # a first pause is no re-entry
    counts = []
    for _ in range(3):
        clock.advance(60)
        assert queue.resume([task_id]) == [task_id]
        counts.append(pause_on("sim/a"))
    assert counts == [1, 2, 3]
    clock.advance(60)
    queue.resume([task_id])
    assert pause_on("sim/b") == 0  # another model resets it
    task = queue.get(task_id)
    assert (task.pause_count, task.resume_count, task.attempts) == (5, 4, 0)
    assert task.first_paused_at == first_pause  # the episode started with the first pause
    clock.advance(60)
    queue.resume([task_id])
    (task,) = queue.claim("codex", "w", 30)
    queue.complete(task.id, task.claim_token, "ok")
    done = queue.get(task_id)
    assert (done.reentry_count, done.first_paused_at) == (0, None)


def test_nul_characters_from_outside_do_not_block_a_settle(queue: TaskQueue) -> None:
    queue.enqueue_many([spec(text="a"), spec(text="b")])
    first, second = queue.claim("codex", "w", 30, limit=2)
    queue.complete(first.id, first.claim_token, "answer\x00with a NUL")
    queue.fail(second.id, second.claim_token, "error\x00text")
    assert queue.get(first.id).result == "answer\ufffdwith a NUL"
    assert queue.get(second.id).last_error == "error\ufffdtext"


def test_a_batch_of_completions_stores_every_text_as_given(queue: TaskQueue) -> None:
    """Acknowledged together (one statement on PostgreSQL, its texts sent as arrays):
    quotes, backslashes, braces, commas, NULL-looking words, non-ASCII and missing
    values arrive unchanged, each in its own task, and a stale claim among them fails
    alone."""
    texts = ['say "hi"', "back\\slash", "{braces, commas}", "NULL", "", "héllo ✓", None]
    models = [None, 'a "model"', None, "NULL", "x,y", "m\\1", "{}"]
    details = [
        {"model": "m", "tool_calls": [{"name": "f", "arguments": {"q": 'a "b" \\ c'}}]},
        None,
        {"finish_reason": "stop"},
        None,
        {"text": "{not, an, array}"},
        None,
        {"n": [1, 2]},
    ]
    queue.enqueue_many([spec(text=str(i)) for i in range(len(texts) + 1)])
    *held, stale = queue.claim("codex", "w", 30, limit=len(texts) + 1)
    items = [
        Settlement(t.id, t.claim_token, Complete(text, model, detail=detail))
        for t, text, model, detail in zip(held, texts, models, details, strict=True)
    ]
    items.append(Settlement(stale.id, stale.claim_token + 1, Complete("never stored")))
    lost, _ = queue.settle_and_claim(items, "codex", "w", 30, limit=0)
    assert [r.task_id for r in lost] == [stale.id]
    for t, text, model, detail in zip(held, texts, models, details, strict=True):
        done = queue.get(t.id)
        note = None if model is None else f"model={model}"
        assert (done.status, done.result, done.result_note, done.result_detail) == (
            TaskStatus.DONE,
            text,
            note,
            detail,
        )
    assert queue.get(stale.id).status is TaskStatus.CLAIMED
