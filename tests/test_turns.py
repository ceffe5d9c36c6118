"""The bench's turn clock (scripts/turns.py): it counts every writers' turn taken while
it is entered, with its COMMIT inside, and leaves the engine as it found it."""

from __future__ import annotations

from agentbus import sqlite_engine
from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from tests.support import script


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
