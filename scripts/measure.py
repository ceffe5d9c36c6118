"""Measuring a queue's consumers and producers, for scripts/compare.py: time, CPU
(the kernel's accounting of reaped children), peak RSS (sampled from /proc), and
a throwaway PostgreSQL database per run."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psycopg
import sqlalchemy as sa

PG_URL = os.environ.get(
    "AGENTBUS_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
)


@dataclass(frozen=True)
class Figures:
    drain: float  # tasks/s
    cpu_ms: float  # consumer CPU per task
    rss_mib: float  # peak RSS of one consumer process
    single: float | None = None  # enqueues/s, one per call
    batch: float | None = None  # enqueues/s, 500 per call
    # The whole machine's busy CPU per task while draining (/proc/stat): the consumers,
    # the database server and anything else running.
    machine_ms: float | None = None
    # Of it, the PostgreSQL server's processes' (``server_cpu``), when they run here.
    server_ms: float | None = None


def installed(*modules: str) -> bool:
    try:
        for module in modules:
            __import__(module)
    except ImportError:
        return False
    return True


@contextmanager
def pg_database() -> Iterator[str]:
    """A fresh Postgres database (libpq conninfo), dropped afterwards."""
    name = f"agentbus_cmp_{uuid.uuid4().hex[:8]}"
    admin = sa.make_url(PG_URL).set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    try:
        yield sa.make_url(admin).set(database=name).render_as_string(False)
    finally:
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


@contextmanager
def agentbus_database(backend: str) -> Iterator[str]:
    """A fresh database's SQLAlchemy URL for agentbus: a SQLite file in a temporary
    folder, or a PostgreSQL database (``pg_database``); gone afterwards."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory() as tmp:
            yield f"sqlite:///{tmp}/bench.db"
        return
    with pg_database() as conninfo:
        yield sa.make_url(conninfo).set(drivername="postgresql+psycopg").render_as_string(False)


def module(workdir: Path, source: str) -> Path:
    path = workdir / f"cmp_{uuid.uuid4().hex[:6]}.py"
    path.write_text(textwrap.dedent(source))
    return path


def compile_agentbus() -> None:
    """Write agentbus's bytecode, as installing a wheel does: the peers run from
    compiled modules, and so should our processes. (An editable install writes it
    at first import, unless PYTHONDONTWRITEBYTECODE is set: then every process
    would compile each module again, ~60 ms of start-up.)"""
    import compileall
    import importlib.util

    spec = importlib.util.find_spec("agentbus")
    assert spec is not None and spec.submodule_search_locations is not None
    for folder in spec.submodule_search_locations:
        compileall.compile_dir(folder, quiet=1)


def rss_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def idle_rss_kib(argv: list[str], env: dict[str, str], started: Callable[[], bool]) -> int:
    """VmRSS of the process ``argv`` once it is idle: after ``started()`` says it is
    up (its row is in the database), the largest of the readings over the next 3 s."""
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not started():
            if child.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"did not start: {argv}")
            time.sleep(0.05)
        readings = []
        for _ in range(30):
            time.sleep(0.1)
            readings.append(rss_kib(child.pid))
        return max(readings)
    finally:
        child.terminate()
        child.wait(timeout=60)


def import_floor_kib(modules: list[str], first: str = "") -> int:
    """VmRSS of an interpreter that runs ``first`` and imports ``modules``, nothing else:
    what a process that needs them holds before any code of its own."""
    code = f"{first}\nimport {', '.join(modules)}; print(open('/proc/self/status').read())"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout
    return next(int(line.split()[1]) for line in out.splitlines() if line.startswith("VmRSS:"))


def _descendants(pid: int) -> list[int]:
    found, stack = [], [pid]
    while stack:
        kids = _children(stack.pop())
        found += kids
        stack += kids
    return found


def lists_children(pids: Iterable[int]) -> bool:
    """Whether this kernel lists each of ``pids``'s children (/proc/<pid>/task/<tid>/children,
    CONFIG_PROC_CHILDREN)."""
    return all(os.path.exists(f"/proc/{pid}/task/{pid}/children") for pid in pids)


def _children(pid: int) -> list[int]:
    """The processes ``pid`` started that still run (none once it is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                kids += [int(k) for k in fh.read().split()]
        except OSError:
            continue
    return kids


def consume(
    argv: list[str],
    procs: int,
    tasks: int,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    drained: Callable[[], bool] | None = None,
) -> Figures:
    """Start ``procs`` consumers; time them until they exit (or until ``drained()``,
    then stop them), with their CPU and one process's peak RSS."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    busy_before, server = machine_busy(), ServerWatch()
    began = time.perf_counter()
    children = [
        subprocess.Popen(
            argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        for _ in range(procs)
    ]
    peak_kib = 0
    try:
        while True:
            for child in children:
                for pid in (child.pid, *_descendants(child.pid)):
                    peak_kib = max(peak_kib, rss_kib(pid))
            server.poll()
            if drained is None and all(c.poll() is not None for c in children):
                break
            if drained is not None and drained():
                break
            if any(c.poll() not in (None, 0) for c in children):
                raise RuntimeError(f"a consumer failed: {argv}")
            time.sleep(0.05)
        seconds = time.perf_counter() - began
        busy = machine_busy() - busy_before
        if drained is None and any(c.returncode for c in children):  # all exited at once
            raise RuntimeError(f"a consumer failed: {argv}")
    finally:
        for child in children:
            if child.poll() is None:
                child.terminate()
            child.wait(timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return Figures(
        tasks / seconds,
        cpu / tasks * 1000,
        peak_kib / 1024,
        machine_ms=busy / tasks * 1000,
        server_ms=server.per_task_ms(tasks),
    )


def machine_busy() -> float:
    """Seconds of CPU the whole machine has spent busy since boot, all cores: user,
    nice, system, irq and softirq time (not idle, I/O wait or time stolen by a
    hypervisor), from /proc/stat."""
    user, nice, system, _idle, _iowait, irq, softirq, _steal = _cpu_times()
    return user + nice + system + irq + softirq


#: CPU seconds spent by each of a server's processes, by pid (``server_cpu``).
Spent = dict[int, float]


def server_cpu(pids: Iterable[int] | None = None) -> Spent:
    """CPU seconds (user + system) each process of a PostgreSQL server on this machine
    has spent, by pid: its backends, WAL writer, checkpointer, autovacuum (empty where
    none runs here, say a server on another host); with ``pids``, of those alone."""
    return {pid: _cpu_seconds(fields) for pid, fields in _postgres_stats(pids)}


def postmasters(stats: dict[int, list[str]]) -> list[int]:
    """The main process of each PostgreSQL server among ``stats`` (``_postgres_stats`` of
    every process): the ``postgres`` process whose parent is not one (every other
    process of a server, its backends included, is a child of it)."""
    return [pid for pid, fields in stats.items() if int(fields[1]) not in stats]


def _cpu_seconds(fields: list[str]) -> float:
    """User + system CPU seconds from the fields of /proc/<pid>/stat after the name."""
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _postgres_stats(pids: Iterable[int] | None) -> Iterator[tuple[int, list[str]]]:
    """The fields of /proc/<pid>/stat after the name (state, parent, …) of each
    ``postgres`` process among ``pids`` (None: every process on the machine)."""
    for pid in pids if pids is not None else (int(e) for e in os.listdir("/proc") if e.isdigit()):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
        except OSError:  # gone meanwhile
            continue
        if stat[stat.index("(") + 1 : stat.rindex(")")] == "postgres":
            yield pid, stat[stat.rindex(")") + 2 :].split()


class ServerWatch:
    """A local PostgreSQL server's CPU while processes run that connect to it and exit
    (their backends exit with them): read at each ``poll``, each server process's
    latest reading is kept. Each poll reads the processes known and the server's new
    children (``postmasters``; on a kernel that does not list a process's children,
    every process), so a backend is seen from the first poll of its life: what it
    spends after the last poll before it exits is not."""

    def __init__(self) -> None:
        stats = dict(_postgres_stats(None))  # one look through /proc for both
        self.first = {pid: _cpu_seconds(fields) for pid, fields in stats.items()}
        self.latest = dict(self.first)
        self._postmasters = postmasters(stats)
        self._listed = lists_children(self._postmasters)

    def poll(self) -> None:
        if not self._listed:
            self.latest.update(server_cpu())
            return
        pids = set(self.latest)
        for postmaster in self._postmasters:
            pids.update(_children(postmaster))
        self.latest.update(server_cpu(pids))

    def per_task_ms(self, tasks: int) -> float | None:
        spent = server_spent(self.first, self.latest)
        return None if spent is None else spent / tasks * 1000


def server_spent(before: Spent, after: Spent) -> float | None:
    """The server's CPU seconds between two ``server_cpu`` readings: a process that
    started meanwhile counts whole, one that ended meanwhile not at all (a backend
    lives as long as its connection: read while the connections are open). None
    when no server process was seen."""
    if not after:
        return None
    return sum(seconds - before.get(pid, 0.0) for pid, seconds in after.items())


def server_spent_over(readings: Iterable[tuple[Spent, Spent]]) -> float | None:
    """The server's CPU seconds over several processes' (start, end) readings of
    ``server_cpu``: each server process from its earliest reading at a start to its
    latest at an end (a process reads while its own connection is open: its backend
    is in both of its readings, whatever the others have closed by then)."""
    starts: Spent = {}
    ends: Spent = {}
    for start, end in readings:
        for pid, seconds in start.items():
            starts[pid] = min(seconds, starts.get(pid, seconds))
        for pid, seconds in end.items():
            ends[pid] = max(seconds, ends.get(pid, seconds))
    return server_spent(starts, ends)


def joined(*parts: str) -> str:
    """A table cell of several figures, the empty ones left out."""
    return "; ".join(part for part in parts if part)


def machine_bound(per_task: float | None, server: float | None = None) -> str:
    """The machine's busy CPU milliseconds per task (``per_task``: from ``machine_busy``;
    with ``server``, the database server's of it) and the most tasks per second its
    cores allow at that cost."""
    if not per_task:  # a run shorter than the kernel's accounting tick
        return ""
    cores = os.cpu_count() or 1
    at_most = cores * 1000 / per_task
    of_it = f" (the server's {server:.2f})" if server is not None else ""
    return (
        f"machine CPU {per_task:.2f} ms per task{of_it}: at most {at_most:,.0f}/s on {cores} cores"
    )


class Stolen:
    """The share of the machine's cores a hypervisor gave to others while a ``with``
    block ran (/proc/stat's steal time over wall time and cores): a bench's figures
    from a stretch with much of it are slower than the machine is."""

    share = 0.0

    def __enter__(self) -> Stolen:
        self._began, self._steal = time.perf_counter(), _cpu_times()[-1]
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._began
        cores = os.cpu_count() or 1
        self.share = (_cpu_times()[-1] - self._steal) / (wall * cores) if wall > 0 else 0.0

    def line(self) -> str:
        return f"# CPU stolen by the hypervisor meanwhile: {self.share:.0%} of the machine's cores"


def _cpu_times() -> list[float]:
    """/proc/stat's first eight times of all cores, in seconds: user, nice, system,
    idle, iowait, irq, softirq, steal."""
    with open("/proc/stat") as fh:
        ticks = [int(v) for v in fh.readline().split()[1:9]]
    return [t / os.sysconf("SC_CLK_TCK") for t in ticks]


def rate(n: int, work: Callable[[], object]) -> float:
    began = time.perf_counter()
    work()
    return n / (time.perf_counter() - began)


def execute(conninfo: str, sql: str) -> None:
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute(sql)


def count_rows(conninfo: str, sql: str) -> int:
    with psycopg.connect(conninfo) as conn:
        row = conn.execute(sql).fetchone()
    return int(row[0]) if row is not None else -1


def expect_zero(conninfo: str, sql: str) -> None:
    """The run counts only if the queue was really drained."""
    if count_rows(conninfo, sql) != 0:
        raise RuntimeError(f"queue not drained: {sql}")
