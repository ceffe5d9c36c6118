"""A PostgreSQL cluster of a test's own (initdb + pg_ctl): to restart it mid-run, or to
serve TLS."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from agentbus.db import Database
from agentbus.migrations import migrate
from tests.conftest import IN_CI
from tests.support import free_port


class ClusterUnavailable(RuntimeError):
    """This machine lacks a tool a cluster needs (``initdb``, ``openssl``)."""


@contextlib.contextmanager
def throwaway_cluster(
    *, tls: bool = False, settings: dict[str, object] | None = None
) -> Iterator[tuple[str, Callable[[], None]]]:
    """A migrated database ``bus`` on a cluster of its own: its URL, and a way to restart
    the cluster. ``tls``: the server offers TLS (a self-signed certificate);
    ``settings``: the server's own (``max_connections``…). Skipped where a tool is
    missing (failed under CI)."""
    try:
        with cluster(tls=tls, settings=settings) as found:
            yield found
    except ClusterUnavailable as e:
        if IN_CI:
            pytest.fail(f"{e} needed under CI", pytrace=False)
        pytest.skip(f"no {e} on this machine")


@contextlib.contextmanager
def cluster(
    *, tls: bool = False, settings: dict[str, object] | None = None
) -> Iterator[tuple[str, Callable[[], None]]]:
    """``throwaway_cluster`` outside a test (scripts/fleet.py): ``ClusterUnavailable``
    where a tool is missing."""
    bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    needed = {"initdb": bool(bins), "openssl": not tls or shutil.which("openssl") is not None}
    missing = [tool for tool, found in needed.items() if not found]
    if missing:
        raise ClusterUnavailable(" and ".join(missing))
    bindir = bins[-1].parent
    root = Path(tempfile.mkdtemp(prefix="agentbus-pg-"))
    run_as: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root
        run_as = ["runuser", "-u", "postgres", "--"]
        shutil.chown(root, "postgres")
    port = free_port()
    data = root / "data"
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    options += "".join(f" -c {name}={value}" for name, value in (settings or {}).items())
    pg_ctl = [*run_as, str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w"]
    subprocess.run(
        [*run_as, str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust"],
        check=True,
        capture_output=True,
    )
    if tls:
        request = ["req", "-new", "-x509", "-days", "1", "-nodes", "-subj", "/CN=localhost"]
        certificate = ["-out", str(data / "server.crt"), "-keyout", str(data / "server.key")]
        subprocess.run(
            [*run_as, "openssl", *request, *certificate], check=True, capture_output=True
        )
        options += " -c ssl=on"
    pg_ctl += ["-o", options]
    subprocess.run([*pg_ctl, "start"], check=True, capture_output=True)
    try:
        with psycopg.connect(
            f"host=127.0.0.1 port={port} user=postgres dbname=postgres", autocommit=True
        ) as conn:
            conn.execute("CREATE DATABASE bus")
        url = f"postgresql+psycopg://postgres@127.0.0.1:{port}/bus"
        db = Database(url)
        migrate(db)
        db.dispose()
        yield (
            url,
            lambda: subprocess.run(
                [*pg_ctl, "-m", "fast", "restart"], check=True, capture_output=True
            ),
        )
    finally:
        subprocess.run([*pg_ctl, "-m", "immediate", "stop"], capture_output=True, check=False)
        shutil.rmtree(root, ignore_errors=True)
