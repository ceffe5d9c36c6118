"""Our processes import their libraries without optional modules they never use."""

from __future__ import annotations

import ctypes.util
import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.lean_imports import hidden, unused_by_sqlalchemy
from agentbus.queue import TaskQueue
from agentbus.queue.states import TaskStatus
from agentbus.queue.tasks import TaskSpec
from tests.conftest import IN_CI, PG_URL, Backends
from tests.pg_cluster import throwaway_cluster
from tests.support import clean_env


def test_a_hidden_module_fails_to_import_inside_and_imports_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "leanprobe.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "leanprobe", raising=False)
    with hidden("leanprobe", "json"):
        with pytest.raises(ImportError):
            import leanprobe
        import json  # imported already: not hidden

        assert json.loads("1") == 1
    import leanprobe

    assert leanprobe.LOADED
    monkeypatch.delitem(sys.modules, "leanprobe")


WORKER = """
import os, sys
from agentbus.worker.cli import worker
code = worker.main(["--agent", "lean", "--db", sys.argv[1], "--drain"], standalone_mode=False)
loaded = [name for name in ("ssl", "_hashlib", "sqlite3") if name in sys.modules]
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
import hashlib, sqlalchemy.util  # as the worker's code has them
print(code, ",".join(loaded) or "-", "libcrypto" in maps)
print(hashlib.sha256(b"key").hexdigest()[:16], sqlalchemy.util.md5_hex("label"))
import ssl  # as httpx does, for an HTTP provider
print(ssl.create_default_context().verify_mode == ssl.CERT_REQUIRED)
"""


def test_a_worker_runs_without_openssl_where_its_database_needs_none(
    db_url: str, backend: str, tmp_path: Path
) -> None:
    """SQLAlchemy and psycopg import asyncio's TLS support, and SQLAlchemy hashlib's OpenSSL
    constructors, which a worker never uses: it loads neither ``ssl`` nor, on SQLite,
    OpenSSL at all (psycopg's libpq brings an OpenSSL of its own on PostgreSQL); a
    PostgreSQL worker does not load sqlite3 either. Hashes come out the same, and a later
    import of ssl works."""
    db = Database(db_url)
    queue = TaskQueue(db)
    task_id = queue.enqueue(TaskSpec(agent="lean", command="hi", models=("sim/a",))).id
    done = subprocess.run(
        [sys.executable, "-c", WORKER, db_url],
        cwd=tmp_path,  # no agentbus.toml here
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    status, hashes, tls = done.stdout.splitlines()
    code, loaded, libcrypto = status.split()
    assert code == "0"
    assert "ssl" not in loaded.split(",")
    assert ("sqlite3" in loaded.split(",")) is (backend == "sqlite")
    if backend == "sqlite" and "_hashlib" in unused_by_sqlalchemy():  # Python's own hashes
        assert (loaded, libcrypto) == ("sqlite3", "False")
    expected = [hashlib.sha256(b"key").hexdigest()[:16], hashlib.md5(b"label").hexdigest()]
    assert hashes.split() == expected
    assert tls == "True"
    assert queue.get(task_id).status is TaskStatus.DONE
    db.dispose()


def test_hashlib_keeps_openssl_where_python_has_no_hashes_of_its_own() -> None:
    """A Python built to leave md5 and sha256 to OpenSSL keeps hashlib's OpenSSL
    constructors: only ``ssl`` is hidden then."""
    assert unused_by_sqlalchemy(lambda name: True) == ("ssl", "_hashlib")
    assert unused_by_sqlalchemy(lambda name: name != "_sha256") == ("ssl", "_hashlib")  # _sha2
    assert unused_by_sqlalchemy(lambda name: name not in ("_sha2", "_sha256")) == ("ssl",)
    assert unused_by_sqlalchemy(lambda name: name != "_md5") == ("ssl",)


PSYCOPG = """
import sys
from agentbus.lean_imports import import_psycopg
import_psycopg()
import psycopg
print(psycopg.pq.__impl__, "ssl" in sys.modules)
with psycopg.connect(sys.argv[1]) as conn:
    print(conn.execute("SELECT 1").fetchone()[0])
"""


@pytest.mark.parametrize("impl", ["binary", "python"])
def test_psycopg_imports_without_ssl_unless_its_implementation_needs_it(
    backends: Backends, impl: str
) -> None:
    """The binary package connects through its own libpq: no ``ssl``. The pure-Python
    implementation (the system's libpq through ctypes) imports ``ssl`` itself: the lean
    import gives way, and psycopg imports and connects as usual."""
    backends.require("postgresql")
    if impl == "python" and ctypes.util.find_library("pq") is None:
        if IN_CI:
            pytest.fail(
                "libpq is needed under CI: psycopg's pure-Python implementation uses it",
                pytrace=False,
            )
        pytest.skip("libpq is not installed")
    conninfo = sa.make_url(PG_URL).set(drivername="postgresql")
    done = subprocess.run(
        [sys.executable, "-c", PSYCOPG, conninfo.render_as_string(hide_password=False)],
        env={**clean_env(), "PSYCOPG_IMPL": impl},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [impl, str(impl == "python"), "1"]


@pytest.mark.process
def test_a_worker_connects_over_tls_through_libpq_without_pythons_ssl(tmp_path: Path) -> None:
    """Without ``ssl`` loaded, a worker still connects to a server over TLS when its URL
    asks for it (``sslmode=require`` refuses a plain connection): libpq makes the TLS
    connection with the OpenSSL it brings."""
    with throwaway_cluster(tls=True) as (url, _restart):
        db = Database(url)
        queue = TaskQueue(db)
        task_id = queue.enqueue(TaskSpec(agent="lean", command="hi", models=("sim/a",))).id
        done = subprocess.run(
            [sys.executable, "-c", WORKER, url + "?sslmode=require"],
            cwd=tmp_path,
            env=clean_env(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        code, loaded, _libcrypto = done.stdout.splitlines()[0].split()
        assert (code, "ssl" in loaded.split(",")) == ("0", False)
        assert queue.get(task_id).status is TaskStatus.DONE
        db.dispose()
