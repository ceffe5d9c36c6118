"""SQLite: the write sets of agentbus's hot paths on a bare ``sqlite3`` connection, no
Python between their statements (every parameter made ahead): the rate and the CPU
those rows cost whatever the code around them, beside what agentbus's own paths cost.

- ``enqueue``: one enqueue's task row and event in one ``BEGIN IMMEDIATE``
  transaction, in the writers' turn agentbus's writers take (below).
- ``steady``: a worker's steady state at batch 1, as ``TaskQueue.settle_and_claim``
  writes it (``agentbus.queue.steady``): complete the last claim, claim the next,
  the two events, the routing row of the call and its usage, in one transaction;
  the processes take the writers' turn agentbus's writers take (an ``flock`` on the
  database's ``-writer`` file, ``sqlite_engine.WriterTurns``), timed as
  ``turns.TurnClock`` times ours: from the lock taken to after COMMIT. With
  ``between``, each process does that much other work after each turn (small,
  distinct objects encoded as JSON: a stand-in for what a worker does between its
  turns, reading the claimed row, admitting, calling and logging), so that the
  turns show what such work costs them. Without ``records``, only the two guarded
  updates of the task state machine run (no events, routing row or usage): what a
  queue that keeps no history of its tasks would write, and so what agentbus's
  records cost.
- ``one_committer``: the same write set of several processes committed by one
  more process, one commit for every request waiting (group commit): each
  process sends its turn's rows over a Unix socket and waits for its claim, then
  does its other work. agentbus has no such process; this measures what one
  would buy.

All use the statements agentbus compiles (``agentbus.prepared``) and the
connection settings of agentbus's engine: WAL, the same ``synchronous``, foreign keys.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import uuid
from collections.abc import Callable
from multiprocessing.connection import Client, Listener, wait
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

import counting
import turns
from processes import together

from agentbus import sqlite_engine
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
    turned = _Turns(str(path), _synchronous(db))  # the writers' turn agentbus's take
    try:

        def one(cursor: sqlite3.Cursor) -> None:
            task_id = cursor.execute(insert.sql, task).lastrowid
            cursor.execute(event.sql, [task_id, *rest])  # the task's id comes first

        began = time.perf_counter()
        for _ in range(single):
            turned.run(one)
        return single / (time.perf_counter() - began)
    finally:
        turned.close()


def steady(
    url: str, processes: int, tasks: int, between: int = 0, *, records: bool = True
) -> tuple[float, float, str]:
    """``processes`` processes drain ``tasks`` no-op tasks with the bare steady-state
    write set (without ``records``, its two updates alone), each doing ``between``
    units of other work after each turn (``_work``): (tasks per second, the processes'
    CPU milliseconds per task, their writers' turns as ``turns.figures`` shows them,
    and with ``between`` the work's mean time)."""
    path, level, agent = _prepare(url, tasks)
    setup = (url, path, level, agent, between, records)
    results, elapsed = together(processes, _drain, lambda n: setup)
    done, cpu = sum(r[0] for r in results), sum(r[1] for r in results)
    assert done == tasks, (done, tasks)
    taken = [sum(r[i] for r in results) for i in (2, 3, 4, 5)]
    held = turns.figures(int(taken[0]), *taken[1:3])
    if between:
        held += f"; {taken[3] / taken[0] * 1e3:.2f} ms of other work after each turn"
    return tasks / elapsed, cpu / tasks * 1000, held


def _prepare(url: str, tasks: int) -> tuple[str, int, str]:
    """``tasks`` no-op tasks queued for a new agent: (the database file, its
    ``synchronous`` level, the agent)."""
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
    return path, level, agent


#: ``_work``'s objects: made once per process, encoded again at every unit of work.
_OBJECTS = [{"id": i, "name": f"task {i}", "models": [f"m{i}", f"n{i}"]} for i in range(4096)]


def _work(units: int) -> None:
    """``units`` small, distinct objects encoded as JSON (a few µs each)."""
    for item in _OBJECTS[:units]:
        json.dumps(item)


def _positions(names: list[str], *wanted: str) -> list[int]:
    return [names.index(name) for name in wanted]


class _WriteSet(NamedTuple):
    """One process's steady-state statements (their SQL) and the parameters of one
    task's rows (id 0, token 0) as agentbus makes them, with the places each task's
    id and token go."""

    sql: dict[str, str]
    completion: list[Any]
    settled: list[Any]
    claimed: list[Any]
    routed: list[Any]
    used: list[list[Any]]
    claiming: list[Any]
    at_complete: list[int]
    at_event: list[int]
    at_route: list[int]
    at_claimed: list[int]

    @classmethod
    def make(cls, url: str, agent: str, worker: str) -> _WriteSet:
        db = Database(url)
        now = time.time()
        complete, claim = (
            db.prepared(SETTLE["complete"]),
            db.prepared(claim_statement("sqlite", single=True)),
        )
        insert_event, insert_route = db.prepared(INSERT_EVENT), db.prepared(INSERT_ROUTE)
        add_usage = db.prepared(usage.upsert("sqlite"))
        db.dispose()
        route = counting.call_route(0, 0, agent, worker, now)
        done = Settlement(0, 0, Complete("ok", "sim/noop"), [route])
        claim_event = events.event(
            0,
            TaskStatus.QUEUED.value,
            TaskStatus.CLAIMED.value,
            now,
            worker=worker,
            claim_token=0,
            reason="claim",
        )
        return cls(
            sql={
                "complete": complete.sql,
                "claim": claim.sql,
                "event": insert_event.sql,
                "route": insert_route.sql,
                "usage": add_usage.sql,
            },
            completion=complete.params(
                {"p_id": 0, "p_token": 0, "p_now": now, **settle_params(done.decision)[1]}
            ),
            settled=insert_event.params(events.for_settlement(done, worker, now)),
            claimed=insert_event.params(claim_event),
            routed=insert_route.params(route.row()),
            used=[add_usage.params(row) for row in usage.rows([route])],
            claiming=claim.params(
                {"p_agent": agent, "p_worker": worker, "p_now": now, "p_lease_until": now + 60}
            ),
            at_complete=_positions(complete.names, "p_id", "p_token"),
            at_event=_positions(insert_event.names, "task_id", "claim_token"),
            at_route=_positions(insert_route.names, "task_id", "claim_token"),
            at_claimed=_positions(claim.columns, "id", "claim_token"),
        )

    def request(self, last: tuple[int, int] | None, records: bool = True) -> dict[str, Any]:
        """The rows of one turn: complete ``last`` (the task claimed the turn before,
        when there is one) and claim the next, with their records (events, routing row,
        usage) or without; every parameter made."""
        out: dict[str, Any] = {
            "records": records,
            "claiming": self.claiming,
            "claimed": self.claimed,
            "at_event": self.at_event,
            "at_claimed": self.at_claimed,
        }
        if last is not None:
            out["complete"] = _put(self.completion, self.at_complete, last)
            out["settled"] = _put(self.settled, self.at_event, last)
            out["route"] = _put(self.routed, self.at_route, last)
            out["used"] = self.used
        return out


def _put(template: list[Any], places: list[int], task: tuple[int, int]) -> list[Any]:
    out = list(template)
    out[places[0]], out[places[1]] = task
    return out


def _apply(
    cursor: sqlite3.Cursor, sql: dict[str, str], request: dict[str, Any]
) -> tuple[int, int] | None:
    """One request's statements, in the transaction under way: the completion, the
    claim and, with the request's records, their events, the routing row and its
    usage; the task claimed (its id and token), if any."""
    done = "complete" in request
    if done:
        cursor.execute(sql["complete"], request["complete"])
    row = cursor.execute(sql["claim"], request["claiming"]).fetchone()
    at_id, at_token = request["at_claimed"]
    task = None if row is None else (row[at_id], row[at_token])
    if request["records"]:
        moves = [request["settled"]] if done else []
        if task is not None:
            moves.append(_put(request["claimed"], request["at_event"], task))
        cursor.executemany(sql["event"], moves)
        if done:
            cursor.execute(sql["route"], request["route"])
            cursor.executemany(sql["usage"], request["used"])
    return task


T = TypeVar("T")


class _Turns:
    """One process's transactions on its bare connection, each in the writers' turn
    agentbus's writers take (``sqlite_engine.WriterTurns``) and timed as
    ``turns.TurnClock`` times theirs: from the turn taken to after COMMIT."""

    def __init__(self, path: str, level: int) -> None:
        self.conn = _connect(path, level)
        self.cursor = self.conn.cursor()
        self._writers = sqlite_engine.WriterTurns(Path(path))
        self.taken, self.held, self.committing = 0, 0.0, 0.0

    def run(self, work: Callable[..., T], *args: Any) -> T:
        """``work(cursor, *args)`` between a BEGIN IMMEDIATE and a COMMIT, in a turn of
        its own."""
        clock = time.perf_counter
        with self._writers:
            began = clock()
            self.conn.execute("BEGIN IMMEDIATE")
            result = work(self.cursor, *args)
            commit = clock()
            self.conn.execute("COMMIT")
            ended = clock()
        self.taken += 1
        self.held += ended - began
        self.committing += ended - commit
        return result

    def close(self) -> None:
        self.conn.close()


def _apply_each(
    cursor: sqlite3.Cursor, sql: dict[str, str], requests: list[dict[str, Any]]
) -> list[tuple[int, int] | None]:
    """Several requests' statements in one transaction: the task each claimed."""
    return [_apply(cursor, sql, request) for request in requests]


def _drain(
    url: str,
    path: str,
    level: int,
    agent: str,
    between: int,
    records: bool,
    ready: Event,
    go: Event,
) -> tuple[int, float, int, float, float, float]:
    """One process: complete the last claim and claim the next until none is left, with
    their records or without, ``between`` units of ``_work`` after each turn; (tasks
    completed, CPU seconds, turns taken, seconds they were held, seconds of their
    COMMITs, seconds of the work)."""
    writes = _WriteSet.make(url, agent, f"floor{os.getpid()}")
    turned = _Turns(path, level)
    ready.set()
    go.wait()
    cpu, count, last, working = time.process_time(), 0, None, 0.0
    while True:
        request = writes.request(last, records)
        task = turned.run(_apply, writes.sql, request)
        count += last is not None
        if task is None:
            break
        last = task
        if between:
            began = time.perf_counter()
            _work(between)
            working += time.perf_counter() - began
    cpu = time.process_time() - cpu
    turned.close()
    return count, cpu, turned.taken, turned.held, turned.committing, working


# -- one committer for several processes -------------------------------------------


def one_committer(
    url: str, requesters: int, tasks: int, between: int, *, both: bool = False
) -> tuple[float, float, str]:
    """The steady state of ``requesters`` processes committed by one more process: each
    requester makes its turn's rows (as ``steady``'s processes do), sends them to the
    committer over a Unix socket and waits for the task it claimed, then does
    ``between`` units of other work; the committer runs the requests waiting for it in
    one transaction, one commit for all of them (with ``both``, it waits until every
    requester still draining has sent one). What committing for several workers in
    one process would buy, measured without such a process in agentbus. Returns
    (tasks per second, the processes' CPU milliseconds per task, the committer's turns
    as ``turns.figures`` shows them with the requests a turn)."""
    path, level, agent = _prepare(url, tasks)
    address = os.path.join(os.path.dirname(path), f"floor-{uuid.uuid4().hex[:8]}.sock")
    setup = _Committed(requesters, url, path, level, agent, address, between, both)
    results, elapsed = together(requesters + 1, _one_committer_part, lambda n: (n, setup))
    done, cpu = sum(r[0] for r in results), sum(r[1] for r in results)
    assert done == tasks, (done, tasks)
    taken, served, held, committing = results[0][2:]
    per_turn = served / taken
    figures = turns.figures(int(taken), held, committing, per_turn)
    return tasks / elapsed, cpu / tasks * 1000, f"{figures}; {per_turn:.2f} requests a turn"


class _Committed(NamedTuple):
    """What every process of ``one_committer`` is given."""

    requesters: int
    url: str
    path: str
    level: int
    agent: str
    address: str  # the committer's Unix socket
    between: int
    both: bool


def _one_committer_part(
    n: int, setup: _Committed, ready: Event, go: Event
) -> tuple[int, float, float, float, float, float]:
    """Process ``n`` of ``one_committer``: the committer (0) or a requester;
    (tasks completed, CPU seconds, and for the committer its turns, the requests it
    served, the seconds its turns were held and the seconds of their COMMITs)."""
    if n == 0:
        return _commit_for(setup, ready, go)
    writes = _WriteSet.make(setup.url, setup.agent, f"floor{os.getpid()}")
    deadline = time.monotonic() + 120  # a committer that never came up: give up
    while True:  # the committer listens once it is up
        try:
            channel = Client(setup.address, family="AF_UNIX")
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    ready.set()
    go.wait()
    cpu, count, last = time.process_time(), 0, None
    while True:
        channel.send(writes.request(last))
        count += last is not None
        task = channel.recv()
        if task is None:
            break
        last = task
        if setup.between:
            _work(setup.between)
    channel.send(None)  # drained
    channel.close()
    return count, time.process_time() - cpu, 0, 0, 0.0, 0.0


def _commit_for(
    setup: _Committed, ready: Event, go: Event
) -> tuple[int, float, float, float, float, float]:
    sql = _WriteSet.make(setup.url, setup.agent, f"floor{os.getpid()}").sql
    turned = _Turns(setup.path, setup.level)
    with Listener(setup.address, family="AF_UNIX") as listener:
        ready.set()
        channels = [listener.accept() for _ in range(setup.requesters)]
    go.wait()
    cpu, served = time.process_time(), 0
    live: list[Any] = list(channels)
    while live:
        waiting: list[tuple[Any, dict[str, Any]]] = []
        ready_now = wait(live)
        while True:
            for channel in ready_now:
                request = channel.recv()
                if request is None:  # that requester has drained
                    live.remove(channel)
                    channel.close()
                else:
                    waiting.append((channel, request))
            pending = [c for c in live if all(c is not w for w, _ in waiting)]
            if not setup.both or not pending:
                break
            ready_now = wait(pending)
        if not waiting:
            continue
        claimed = turned.run(_apply_each, sql, [request for _, request in waiting])
        served += len(waiting)
        for (channel, _), task in zip(waiting, claimed, strict=True):
            channel.send(task)
    turned.close()
    return 0, time.process_time() - cpu, turned.taken, served, turned.held, turned.committing
