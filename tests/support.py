"""Helpers shared by the tests: an injected clock and a poll-until helper."""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from agentbus.queue.tasks import TaskSpec

T = TypeVar("T")


class FakeClock:
    """A clock the test moves by hand: time passes only when the test says so."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> float:
        self.now += seconds
        return self.now


SCRIPTS = str(Path(__file__).resolve().parents[1] / "scripts")


def script(name: str) -> Any:
    """The module ``scripts/<name>.py`` (the bench's modules import one another by name,
    so their folder goes on the path)."""
    if SCRIPTS not in sys.path:
        sys.path.insert(0, SCRIPTS)
    return importlib.import_module(name)


def clean_env() -> dict[str, str]:
    """This process's environment without any AGENTBUS_* variable (for a child process)."""
    return {k: v for k, v in os.environ.items() if not k.startswith("AGENTBUS_")}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a server the test starts)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], T], *, timeout: float = 30.0, every: float = 0.05) -> T:
    """Poll ``predicate`` until it returns something truthy (for process tests)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout}s")
        time.sleep(every)


class Proc:
    """A real agentbus process (worker, sweeper) whose log goes to a file."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: str) -> None:
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in wait()
        self.popen = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait(self, timeout: float = 60) -> int:
        """The exit status; a process still running after ``timeout`` is made to print
        where each of its threads is (``faulthandler``, on SIGABRT) and the test fails
        with the end of its log."""
        try:
            return self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            self.popen.send_signal(signal.SIGABRT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(10)
            raise AssertionError(
                f"{self.popen.args[0]} still ran after {timeout}s; its log ends:\n"
                + self.text()[-6000:]
            ) from None
        finally:
            self._log.close()

    def signal(self, signum: int) -> None:
        self.popen.send_signal(signum)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()
        self.wait()

    def events(self) -> list[dict[str, object]]:
        """The JSON log lines (``--log-json``) written so far."""
        import json

        out = []
        with open(self.log_path) as fh:
            for line in fh:
                line = line.strip()
                if line.startswith("{"):
                    out.append(json.loads(line))
        return out

    def text(self) -> str:
        with open(self.log_path) as fh:
            return fh.read()


def waiting(gates: list[Path]) -> list[Path]:
    """The gates whose held call is in flight (the simulated provider's ``wait_for``)."""
    return [g for g in gates if Path(f"{g}.waiting").exists()]


def release_two_in_flight(gates: list[Path]) -> None:
    """Let held calls go one at a time, each only while two are in flight: overlap is
    shown however slowly the processes run."""
    pending = list(gates)
    while pending:
        wait_until(lambda: len(waiting(pending)) >= min(2, len(pending)), timeout=90)
        released = waiting(pending)[0]
        released.touch()
        pending.remove(released)


def enqueue_held(queue: Any, gates: list[Path], *, agent: str = "codex") -> list[int]:
    """One task per gate whose call on sim/a lasts until that gate's file exists."""
    return [
        queue.enqueue(
            TaskSpec(
                agent=agent,
                command=f"held {i}",
                models=("sim/a",),
                payload={"simulate": {"sim/a": {"wait_for": str(gate)}}},
            )
        ).id
        for i, gate in enumerate(gates)
    ]


def own_engine(url: str) -> Any:
    """An application's own engine on ``url``, made as its documentation says: behind a
    transaction pooler (the URL's ``?pooler=transaction``, which only agentbus reads)
    psycopg prepares no statement."""
    import sqlalchemy as sa

    parsed = sa.make_url(url)
    if parsed.query.get("pooler") == "transaction":
        parsed = parsed.difference_update_query(["pooler"])
        return sa.create_engine(parsed, connect_args={"prepare_threshold": None})
    return sa.create_engine(parsed)


def conninfo(url: str) -> str:
    """A SQLAlchemy URL as libpq reads it (the tests' own psycopg connections)."""
    import sqlalchemy as sa

    return sa.make_url(url).set(drivername="postgresql").render_as_string(False)
