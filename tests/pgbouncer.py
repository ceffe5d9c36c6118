"""A PgBouncer of a test's own, in transaction mode, in front of the test PostgreSQL.

Debian's ``pgbouncer`` package (``.ci/run`` installs it); started on a free port,
every database name forwarded to the test server (``* =``), trust auth, and stopped
when the test session (or the test) ends. Run as root, it drops to the ``postgres``
user, as PgBouncer refuses to run as root.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import sqlalchemy as sa

from tests.support import free_port, wait_until

BINARY = "/usr/sbin/pgbouncer"


def available() -> bool:
    return Path(BINARY).exists() or shutil.which("pgbouncer") is not None


class PgBouncer:
    """One PgBouncer process; ``url(dbname)`` is a URL through it, in pooler mode."""

    def __init__(self, server_url: str, **settings: object) -> None:
        server = sa.make_url(server_url)
        self.server_host = server.host or "127.0.0.1"
        self.server_port = server.port or 5432
        self.user = server.username or "postgres"
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="agentbus-pgbouncer-"))
        values: dict[str, object] = {
            "listen_addr": "127.0.0.1",
            "listen_port": self.port,
            "unix_socket_dir": "",
            "auth_type": "trust",
            "auth_file": self.dir / "users.txt",
            "admin_users": self.user,
            "pool_mode": "transaction",
            "max_client_conn": 2000,
            "default_pool_size": 20,
            # A client waits this long for a server connection, then is told so (the
            # default, 120 s, outlasts a worker's lease: an outage would look like a hang).
            "query_wait_timeout": 5,
            # After a failed login to the server PgBouncer refuses every client this
            # long (15 s by default): an outage lasts that much longer through it.
            "server_login_retry": 1,
            "server_idle_timeout": 5,
            "server_lifetime": 60,
            "logfile": self.dir / "pgbouncer.log",
            "pidfile": self.dir / "pgbouncer.pid",
            "ignore_startup_parameters": "extra_float_digits",
            **settings,
        }
        if os.geteuid() == 0:  # PgBouncer refuses to run as root
            values["user"] = "postgres"
            shutil.chown(self.dir, "postgres")
        lines = [
            "[databases]",
            f"* = host={self.server_host} port={self.server_port}",
            "[pgbouncer]",
            *(f"{k} = {v}" for k, v in values.items()),
        ]
        self.ini = self.dir / "pgbouncer.ini"
        self.ini.write_text("\n".join(lines) + "\n")
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> PgBouncer:
        binary = BINARY if Path(BINARY).exists() else str(shutil.which("pgbouncer"))
        self.proc = subprocess.Popen(
            [binary, str(self.ini)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        proc = self.proc

        def listening() -> bool:
            if proc.poll() is not None:
                raise RuntimeError(f"pgbouncer exited at start: {self.log()[-2000:]}")
            with contextlib.suppress(OSError):
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return True
            return False

        try:
            wait_until(listening, timeout=20)
        except AssertionError:
            raise RuntimeError(f"pgbouncer did not start: {self.log()[-2000:]}") from None
        return self

    def url(self, dbname: str, *, pooler: bool = True) -> str:
        query = "?pooler=transaction" if pooler else ""
        return f"postgresql+psycopg://{self.user}@127.0.0.1:{self.port}/{dbname}{query}"

    def admin(self, command: str) -> list[tuple[object, ...]]:
        """A command on PgBouncer's admin console (``SHOW POOLS``, ``SHOW CLIENTS``…)."""
        import psycopg

        with psycopg.connect(
            f"host=127.0.0.1 port={self.port} user={self.user} dbname=pgbouncer",
            autocommit=True,
            prepare_threshold=None,
        ) as conn:
            cursor = conn.cursor()
            cursor.execute(command)
            return list(cursor.fetchall()) if cursor.description else []

    def log(self) -> str:
        try:
            return (self.dir / "pgbouncer.log").read_text()
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # shut down at once
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@contextlib.contextmanager
def pgbouncer(server_url: str, **settings: object) -> Iterator[PgBouncer]:
    bouncer = PgBouncer(server_url, **settings).start()
    try:
        yield bouncer
    finally:
        bouncer.stop()
