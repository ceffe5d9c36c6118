"""Database fixtures: every database test runs on SQLite, on PostgreSQL, and on
PostgreSQL through PgBouncer in transaction mode (``pgbouncer``).

Postgres is reached through $AGENTBUS_TEST_PG_URL (default: the local server).
Each test gets its own database, cloned from a migrated template made once per
session, and dropped afterwards; the ``pgbouncer`` runs reach theirs through a
PgBouncer this session starts on a free port (``tests.pgbouncer``), with URLs that
say ``?pooler=transaction``. Under CI=true an unreachable Postgres, or no
``pgbouncer`` program, fails the run instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.migrations import migrate
from agentbus.queue import TaskQueue
from tests import pgbouncer
from tests.support import FakeClock, Proc, clean_env

PG_URL = os.environ.get(
    "AGENTBUS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)
IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


class Pooled(str):
    """The ``pgbouncer`` backend: equal to "postgresql", so that a test's PostgreSQL
    branches hold for it as well; its databases are reached through the pooler."""


BACKENDS = ["sqlite", "postgresql", pytest.param(Pooled("postgresql"), id="pgbouncer")]
pytest_plugins = ["tests.mock_llm"]  # the mock_llm fixture: a local model endpoint


def _pg_conninfo(dbname: str | None = None) -> str:
    url = sa.make_url(PG_URL)
    if dbname:
        url = url.set(database=dbname)
    return url.set(drivername="postgresql").render_as_string(hide_password=False)


def _pg_url(dbname: str) -> str:
    return sa.make_url(PG_URL).set(database=dbname).render_as_string(hide_password=False)


def direct_conninfo(url: str) -> str:
    """libpq's conninfo of ``url``'s PostgreSQL database reached directly, never through
    the session's PgBouncer: where a LISTEN is heard (what ``listen_url`` gives)."""
    return _pg_conninfo(str(sa.make_url(url).database))


def _pg_admin(sql: str) -> None:
    with psycopg.connect(_pg_conninfo(), autocommit=True) as conn:
        conn.execute(sql)


class Backends:
    """Creates and drops per-test databases; one instance per test session."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tag = uuid.uuid4().hex[:8]
        self.pg_error: str | None = None
        self._sqlite_template: Path | None = None
        self._pg_template: str | None = None
        self._bouncer: pgbouncer.PgBouncer | None = None
        try:
            _pg_admin("SELECT 1")
        except psycopg.Error as exc:
            self.pg_error = str(exc).strip().splitlines()[0]

    def require(self, backend: str) -> None:
        if backend == "postgresql" and self.pg_error:
            message = f"PostgreSQL at {PG_URL} unreachable: {self.pg_error}"
            if IN_CI:
                pytest.fail(message + " (CI=true: Postgres tests must run)", pytrace=False)
            pytest.skip(message)
        if isinstance(backend, Pooled) and not pgbouncer.available():
            message = "no pgbouncer program (Debian's pgbouncer package)"
            if IN_CI:
                pytest.fail(message + " (CI=true: the pooler tests must run)", pytrace=False)
            pytest.skip(message)

    def bouncer(self) -> pgbouncer.PgBouncer:
        """The session's PgBouncer, started at first use."""
        if self._bouncer is None:
            self._bouncer = pgbouncer.PgBouncer(PG_URL).start()
        return self._bouncer

    def new(self, backend: str, *, migrated: bool = True) -> tuple[str, Path | str]:
        """A fresh database URL and the thing to remove afterwards."""
        self.require(backend)
        name = f"ab_{self.tag}_{uuid.uuid4().hex[:10]}"
        if backend == "sqlite":
            path = self.tmp / f"{name}.db"
            if migrated:
                shutil.copy(self._sqlite_template_path(), path)
            return f"sqlite:///{path}", path
        template = f" TEMPLATE {self._pg_template_name()}" if migrated else ""
        _pg_admin(f"CREATE DATABASE {name}{template}")
        if isinstance(backend, Pooled):
            return self.bouncer().url(name), name
        return _pg_url(name), name

    def drop(self, handle: Path | str) -> None:
        if isinstance(handle, Path):
            for suffix in ("", "-wal", "-shm"):
                Path(str(handle) + suffix).unlink(missing_ok=True)
        else:
            _pg_admin(f"DROP DATABASE IF EXISTS {handle} WITH (FORCE)")

    def _sqlite_template_path(self) -> Path:
        if self._sqlite_template is None:
            path = self.tmp / f"template_{self.tag}.db"
            db = Database(f"sqlite:///{path}")
            migrate(db)
            db.dispose()
            self._sqlite_template = path
        return self._sqlite_template

    def _pg_template_name(self) -> str:
        if self._pg_template is None:
            name = f"abtmpl_{self.tag}"
            _pg_admin(f"CREATE DATABASE {name}")
            db = Database(_pg_url(name))
            migrate(db)
            db.dispose()
            self._pg_template = name
        return self._pg_template

    def close(self) -> None:
        if self._bouncer is not None:
            self._bouncer.stop()
        if self._pg_template is not None:
            _pg_admin(f"DROP DATABASE IF EXISTS {self._pg_template} WITH (FORCE)")


@pytest.fixture(scope="session")
def backends(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Backends]:
    b = Backends(tmp_path_factory.mktemp("dbs"))
    yield b
    b.close()


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param if isinstance(request.param, Pooled) else str(request.param)


@pytest.fixture
def db_url(backends: Backends, backend: str) -> Iterator[str]:
    """URL of a fresh, migrated database of the current backend."""
    url, handle = backends.new(backend)
    yield url
    backends.drop(handle)


@pytest.fixture
def empty_db_url(backends: Backends, backend: str) -> Iterator[str]:
    """URL of a fresh database with no schema at all."""
    url, handle = backends.new(backend, migrated=False)
    yield url
    backends.drop(handle)


@pytest.fixture
def db(db_url: str) -> Iterator[Database]:
    database = Database(db_url)
    yield database
    database.dispose()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def queue(db: Database, clock: FakeClock) -> TaskQueue:
    return TaskQueue(db, clock=clock)


@pytest.fixture
def run_busctl() -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the installed ``busctl`` console script as a user would.

    The child sees none of this shell's AGENTBUS_* variables, only ``env``.
    """
    exe = Path(sys.executable).with_name("busctl")

    def run(
        *args: str,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        clean = clean_env()
        return subprocess.run(
            [str(exe), *args],
            capture_output=True,
            text=True,
            timeout=120,
            env={**clean, **(env or {})},
            cwd=cwd,
            input=input if input is not None else "",
        )

    return run


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., Proc]]:
    """Start an installed console script (``worker``, ``sweeper``) as a real process."""
    started: list[Proc] = []
    counter = iter(range(1000))

    def start(program: str, *args: str, env: dict[str, str] | None = None) -> Proc:
        clean = clean_env()
        exe = str(Path(sys.executable).with_name(program))
        proc = Proc(
            [exe, *args],
            {**clean, "PYTHONFAULTHANDLER": "1", **(env or {})},
            str(tmp_path / f"{program}-{next(counter)}.log"),
        )
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()
