"""The bench's turn clock (scripts/turns.py): it counts every writers' turn taken while
it is entered, with its COMMIT inside, and leaves the engine as it found it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from agentbus.db import Database
from agentbus.db import sqlite as sqlite_engine
from agentbus.queue import TaskQueue
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec
from tests.support import clean_env, script


def test_the_clock_counts_each_turn_and_puts_the_engine_back(db: Database) -> None:
    turns = script("turns")
    queue = TaskQueue(db)
    before = (
        sqlite_engine.WriterTurns.__enter__,
        sqlite_engine.WriterTurns.__exit__,
        sqlite_engine.statement,
    )
    with turns.TurnClock() as clock:
        ids = [queue.enqueue(TaskSpec(agent="a", command="t")).id for _ in range(3)]
    queue.enqueue(TaskSpec(agent="a", command="after"))  # not counted: the clock is out
    after = (
        sqlite_engine.WriterTurns.__enter__,
        sqlite_engine.WriterTurns.__exit__,
        sqlite_engine.statement,
    )
    assert after == before
    assert len(set(ids)) == 3
    taken, held, committing = clock.totals()
    if db.dialect == "sqlite":  # one turn, with one COMMIT, per enqueue
        assert taken == 3
        assert 0 < committing < held
        assert "at most" in turns.figures(taken, held, committing)
    else:  # PostgreSQL's writers take no turn
        assert (taken, held, committing) == (0, 0.0, 0.0)
        assert turns.figures(taken, held, committing) == ""


def test_the_worker_command_with_its_turns_timed_drains_and_writes_its_totals(
    db: Database, db_url: str, tmp_path: Path
) -> None:
    """``turns.py`` run as a script is the ``worker`` command, drain and exit status
    included, with its turns counted in place: one turn a claim on SQLite (and a few
    of its own: registration, heartbeat, the last look), none on PostgreSQL."""
    turns = script("turns")
    queue = TaskQueue(db)
    ids = [
        queue.enqueue(TaskSpec(agent="timed", command=f"t{i}", models=("sim/noop",))).id
        for i in range(3)
    ]
    command = ["--agent", "timed", "--db", db_url, "--drain"]
    done = subprocess.run(
        [sys.executable, turns.__file__, str(tmp_path), *command],
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert {queue.get(i).status for i in ids} == {TaskStatus.DONE}
    [written] = tmp_path.glob("*.json")
    record = json.loads(written.read_text())
    assert set(record) == set(turns.TOTALS)
    if db.dialect == "sqlite":
        assert record["turns"] >= len(ids)
        assert 0 < record["committing"] < record["held"]
    else:
        assert record == {"turns": 0, "held": 0.0, "committing": 0.0}
