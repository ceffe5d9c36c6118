"""SQLite: the writers' turns a process holds, timed where they are taken.

SQLite commits one writer at a time, and agentbus's writers take turns
(``agentbus.db.sqlite.WriterTurns``: from before BEGIN IMMEDIATE to after
COMMIT), so the turns of every process add up to at most the time elapsed. With
one turn per claim, ``batch`` / (the mean turn) is the most tasks per second
that any worker writing the same rows, however little it did around its turns,
could settle; with one turn per enqueue, 1 / (the mean turn) is the most
enqueues per second.

``TurnClock`` sums this process's turns and the COMMITs inside them, for as long
as it is entered, by wrapping ``WriterTurns`` and ``sqlite_engine.statement``
(which sends COMMIT): what they do is unchanged. One thread at a time.

Run as a script, ``python turns.py OUT WORKER-ARGS...`` is the ``worker`` command
with its own turns timed in place: it runs the command in this process, inside a
``TurnClock``, and on exit writes the clock's totals to ``OUT/<pid>.json``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from agentbus.db import sqlite as sqlite_engine

#: What ``TurnClock.totals`` gives, by name (the records the script writes).
TOTALS = ("turns", "held", "committing")


class TurnClock:
    """Entered: this process's writers' turns (``turns``), the seconds they were held
    (``held``) and the seconds of their COMMITs (``committing``). The clock's own work
    (two clock readings and a call a turn, ~1 µs) is inside what it measures."""

    def __init__(self) -> None:
        self.turns = 0
        self.held = 0.0
        self.committing = 0.0
        self._saved: tuple[Any, Any, Any] | None = None

    def __enter__(self) -> TurnClock:
        kind = sqlite_engine.WriterTurns
        enter, leave, statement = self._saved = (
            kind.__enter__,
            kind.__exit__,
            sqlite_engine.statement,
        )
        began = [0.0]

        def timed_enter(turns: sqlite_engine.WriterTurns) -> None:
            enter(turns)
            began[0] = time.perf_counter()

        def timed_exit(turns: sqlite_engine.WriterTurns, *exc: object) -> None:
            self.held += time.perf_counter() - began[0]
            self.turns += 1
            leave(turns, *exc)

        def timed_statement(driver: Any, sql: str) -> None:
            if sql != "COMMIT":
                return statement(driver, sql)
            start = time.perf_counter()
            try:
                return statement(driver, sql)
            finally:
                self.committing += time.perf_counter() - start

        kind.__enter__ = timed_enter  # type: ignore[method-assign]
        kind.__exit__ = timed_exit  # type: ignore[method-assign]
        sqlite_engine.statement = timed_statement
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._saved is not None
        kind = sqlite_engine.WriterTurns
        kind.__enter__, kind.__exit__, sqlite_engine.statement = self._saved  # type: ignore[method-assign]

    def totals(self) -> tuple[int, float, float]:
        return self.turns, self.held, self.committing


def figures(turns: int, held: float, committing: float, per_turn: float = 1) -> str:
    """What the summed turns of one or more processes show: the mean turn, the COMMIT
    inside it and the bound it sets (``per_turn`` tasks a turn); empty without turns
    (PostgreSQL takes none)."""
    if not turns:
        return ""
    turn, commit = held / turns * 1e6, committing / turns * 1e6
    return (
        f"writers' turn {turn:,.0f} µs (COMMIT {commit:,.0f} of it): "
        f"at most {per_turn * 1e6 / turn:,.0f}/s"
    )


def _worker(out: Path, args: list[str]) -> None:
    """The ``worker`` command with ``args``, its turns timed; their totals written to
    ``out/<pid>.json`` however it ends (a drain exits through SystemExit)."""
    from agentbus.worker.cli import main

    sys.argv = ["worker", *args]
    with TurnClock() as clock:
        try:
            main()
        finally:
            record = dict(zip(TOTALS, clock.totals(), strict=True))
            (out / f"{os.getpid()}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    _worker(Path(sys.argv[1]), sys.argv[2:])
