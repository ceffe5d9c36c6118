"""SQLite: the write sets of agentbus's hot paths on a bare ``sqlite3`` connection, no
Python between their statements (every parameter made ahead): the rate and the CPU
those rows cost whatever the code around them, beside what agentbus's own paths cost.

- ``enqueue``: one enqueue's task row and event in one ``BEGIN IMMEDIATE``
  transaction.
- ``steady``: a worker's steady state at batch 1, as ``TaskQueue.settle_and_claim``
  writes it (``agentbus.queue.steady``): complete the last claim, claim the next,
  the two events, the routing row of the call and its usage, in one transaction;
  the processes take the writers' turn agentbus's writers take (an ``flock`` on the
  database's ``-writer`` file, ``sqlite_engine.WriterTurns``), timed as
  ``turns.TurnClock`` times ours: from the lock taken to after COMMIT. With
  ``between``, each process does that much other work after each turn (small,
  distinct objects encoded as JSON: a stand-in for what a worker does between its
  turns, reading the claimed row, admitting, calling and logging), so that the
  turns show what such work costs them.

Both use the statements agentbus compiles (``agentbus.prepared``) and the
connection settings of agentbus's engine: WAL, the same ``synchronous``, foreign keys.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
import uuid
from multiprocessing.synchronize import Event
from typing import Any

import counting
import turns
from processes import together

from agentbus.admission import usage
from agentbus.db import Database
from agentbus.queue import TaskQueue, events
from agentbus.queue.decisions import Complete, Settlement
from agentbus.queue.statements import (
    ENQUEUE_ONE,
    ENQUEUE_ONE_BINDS,
    INSERT_EVENT,
    INSERT_ROUTE,
    SETTLE,
    claim_statement,
    settle_params,
)
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec


def _connect(path: str, level: int) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None, timeout=30)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute(f"PRAGMA synchronous={level}")
    conn.execute("PRAGMA foreign_keys=ON")  # as on agentbus's connections
    return conn


def _synchronous(db: Database) -> int:
    return int(db.read(lambda c: c.exec_driver_sql("PRAGMA synchronous").scalar()))


def enqueue(queue: TaskQueue, spec: TaskSpec, single: int) -> float:
    """Enqueues per second of the bare write set, ``single`` of them, each its own
    transaction."""
    db = queue.db
    path = db.sqlite_path()
    assert path is not None
    now = time.time()
    row = queue.stored_row(spec, now)
    insert = db.prepared(ENQUEUE_ONE)
    task = insert.params({name: row[column] for name, column in ENQUEUE_ONE_BINDS})
    event = db.prepared(INSERT_EVENT)
    _task_id, *rest = event.params(
        events.event(0, None, TaskStatus.QUEUED.value, now, reason="enqueue")
    )
    conn = _connect(str(path), _synchronous(db))
    try:

        def one() -> None:
            conn.execute("BEGIN IMMEDIATE")
            task_id = conn.execute(insert.sql, task).lastrowid
            conn.execute(event.sql, [task_id, *rest])  # the task's id comes first
            conn.execute("COMMIT")

        began = time.perf_counter()
        for _ in range(single):
            one()
        return single / (time.perf_counter() - began)
    finally:
        conn.close()


def steady(url: str, processes: int, tasks: int, between: int = 0) -> tuple[float, float, str]:
    """``processes`` processes drain ``tasks`` no-op tasks with the bare steady-state
    write set, each doing ``between`` units of other work after each turn (``_work``):
    (tasks per second, the processes' CPU milliseconds per task, their writers' turns
    as ``turns.figures`` shows them, and with ``between`` the work's mean time)."""
    db = Database(url)
    if db.sqlite_path() is None:
        raise ValueError(f"the bare write set is SQLite's: not {db.dialect}")
    path, level = str(db.sqlite_path()), _synchronous(db)
    agent = f"floor{uuid.uuid4().hex[:6]}"
    spec = TaskSpec(agent=agent, command="t", models=("sim/noop",))
    queue = TaskQueue(db)
    for start in range(0, tasks, 500):
        queue.enqueue_many([spec] * min(500, tasks - start))
    db.dispose()
    results, elapsed = together(processes, _drain, lambda n: (url, path, level, agent, between))
    done, cpu = sum(r[0] for r in results), sum(r[1] for r in results)
    assert done == tasks, (done, tasks)
    taken = [sum(r[i] for r in results) for i in (2, 3, 4, 5)]
    held = turns.figures(int(taken[0]), *taken[1:3])
    if between:
        held += f"; {taken[3] / taken[0] * 1e3:.2f} ms of other work after each turn"
    return tasks / elapsed, cpu / tasks * 1000, held


#: ``_work``'s objects: made once per process, encoded again at every unit of work.
_OBJECTS = [{"id": i, "name": f"task {i}", "models": [f"m{i}", f"n{i}"]} for i in range(4096)]


def _work(units: int) -> None:
    """``units`` small, distinct objects encoded as JSON (a few µs each)."""
    for item in _OBJECTS[:units]:
        json.dumps(item)


def _positions(names: list[str], *wanted: str) -> list[int]:
    return [names.index(name) for name in wanted]


def _drain(
    url: str, path: str, level: int, agent: str, between: int, ready: Event, go: Event
) -> tuple[int, float, int, float, float, float]:
    """One process: complete the last claim and claim the next until none is left,
    ``between`` units of ``_work`` after each turn; (tasks completed, CPU seconds, turns
    taken, seconds they were held, seconds of their COMMITs, seconds of the work)."""
    db = Database(url)
    worker, now = f"floor{os.getpid()}", time.time()
    complete, claim = (
        db.prepared(SETTLE["complete"]),
        db.prepared(claim_statement("sqlite", single=True)),
    )
    insert_event, insert_route = db.prepared(INSERT_EVENT), db.prepared(INSERT_ROUTE)
    add_usage = db.prepared(usage.upsert("sqlite"))
    db.dispose()
    # The rows of one task (id 0, token 0) as agentbus makes them; each task's id and
    # token go in their places.
    route = counting.call_route(0, 0, agent, worker, now)
    done = Settlement(0, 0, Complete("ok", "sim/noop"), [route])
    completion = complete.params(
        {"p_id": 0, "p_token": 0, "p_now": now, **settle_params(done.decision)[1]}
    )
    settled = insert_event.params(events.for_settlement(done, worker, now))
    claimed = insert_event.params(
        events.event(
            0,
            TaskStatus.QUEUED.value,
            TaskStatus.CLAIMED.value,
            now,
            worker=worker,
            claim_token=0,
            reason="claim",
        )
    )
    routed = insert_route.params(route.row())
    used = [add_usage.params(row) for row in usage.rows([route])]
    claiming = claim.params(
        {"p_agent": agent, "p_worker": worker, "p_now": now, "p_lease_until": now + 60}
    )
    at_complete = _positions(complete.names, "p_id", "p_token")
    at_event = _positions(insert_event.names, "task_id", "claim_token")
    at_route = _positions(insert_route.names, "task_id", "claim_token")
    at_claimed = _positions(claim.columns, "id", "claim_token")

    def put(template: list[Any], places: list[int], task: tuple[int, int]) -> list[Any]:
        out = list(template)
        out[places[0]], out[places[1]] = task
        return out

    conn = _connect(path, level)
    cursor = conn.cursor()
    turn = os.open(f"{path}-writer", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    ready.set()
    go.wait()
    cpu, count, last = time.process_time(), 0, None
    taken, held, committing, working, clock = 0, 0.0, 0.0, 0.0, time.perf_counter
    while True:
        fcntl.flock(turn, fcntl.LOCK_EX)
        began = clock()
        conn.execute("BEGIN IMMEDIATE")
        moves = []
        if last is not None:
            cursor.execute(complete.sql, put(completion, at_complete, last))
            moves.append(put(settled, at_event, last))
        row = cursor.execute(claim.sql, claiming).fetchone()
        task = None if row is None else (row[at_claimed[0]], row[at_claimed[1]])
        if task is not None:
            moves.append(put(claimed, at_event, task))
        cursor.executemany(insert_event.sql, moves)
        if last is not None:
            cursor.execute(insert_route.sql, put(routed, at_route, last))
            cursor.executemany(add_usage.sql, used)
            count += 1
        commit = clock()
        conn.execute("COMMIT")
        ended = clock()
        fcntl.flock(turn, fcntl.LOCK_UN)
        taken, held, committing = taken + 1, held + ended - began, committing + ended - commit
        if task is None:
            break
        last = task
        if between:
            _work(between)
            working += clock() - ended
    cpu = time.process_time() - cpu
    conn.close()
    return count, cpu, taken, held, committing, working
