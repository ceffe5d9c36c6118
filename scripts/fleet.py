#!/usr/bin/env python3
"""A fleet on one PostgreSQL through PgBouncer: N worker processes, 2 sweepers and
producers share accounts with rpm and concurrency limits; every task must be done once
and every limit must hold. Prints its figures and checks; exits 1 when a check fails.

    python scripts/bench.py fleet                           # 200 workers, 20,000 tasks
    python scripts/bench.py fleet --workers 10 --tasks 200  # the short run CI makes

The set-up, all of it the run's own and cleaned up when it ends:
- a PostgreSQL cluster (initdb) with ``max_connections = 100``, and a PgBouncer in
  transaction mode in front of it (``tests/pgbouncer.py``, the tests' own);
- ``--providers`` python providers (``fleet_model.answer``) of ``--accounts`` accounts
  each, every account ``--rpm`` calls a 60 s window, every provider ``--concurrency``
  calls in flight; every agent's tasks may use any of them;
- ``--workers`` ``worker`` processes over ``--agents`` agents (every 10th with
  ``--concurrency 4``, every 25th with 8), two ``sweeper`` processes, every process with
  the default settings through PgBouncer (polling: a transaction pooler carries no
  LISTEN);
- once every worker is up and has idled 15 s, the server's CPU over ``--idle-sec``;
- then ``--producers`` processes enqueue ``--tasks`` tasks, each a call of 0.1 to 2 s.

The checks, each from a record outside the code it checks:
- every task done, with exactly one call at the model (the model's own journal,
  ``fleet_model.py``) and one ``done`` event (``task_events``);
- no provider ever had more calls in flight than its limit (the journal's intervals);
- no account admitted more than its rpm in any 60 s window (every ``call_slots`` row,
  copied from the database each second before the sweeper may purge it);
- no process died or logged a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))  # tests.pg_cluster, tests.pgbouncer: the tests' own

from fleet_checks import WINDOW, judge, read_journal  # noqa: E402

from tests.pg_cluster import cluster  # noqa: E402
from tests.pgbouncer import PgBouncer  # noqa: E402

BIN = Path(sys.executable).parent
IDLE_SETTLE_SEC = 15.0  # past the looks of a worker's first seconds


# -- the processes ---------------------------------------------------------------------


def config_text(providers: int, accounts: int, concurrency: int, rpm: int) -> str:
    text = ""
    for p in range(providers):
        text += (
            f'[providers.p{p}]\nkind = "python"\ntarget = "fleet_model:answer"\n'
            f"concurrency = {concurrency}\nrpm = {rpm}\n"
        )
        text += "".join(f"[providers.p{p}.accounts.a{a}]\n" for a in range(accounts))
        text += f'[models."p{p}/m"]\nprovider = "p{p}"\n'
    return text


def models_for(agent: int, providers: int) -> list[str]:
    """Every provider's model, starting from a different one per agent."""
    return [f"p{(agent + k) % providers}/m" for k in range(providers)]


def bouncer_settings(workers: int, pool_size: int) -> dict[str, object]:
    """PgBouncer for a fleet (over ``tests/pgbouncer.py``'s transaction mode and trust
    auth): room for every client a worker may open (4 connections and a spare), a pool
    below the server's ``max_connections``, and PgBouncer's own defaults for the server
    connections' lives (the tests shorten them, to see an outage end sooner): a server
    connection closed after 5 s idle is opened again, a backend started, at the next
    transaction."""
    return {
        "max_client_conn": workers * 5 + 100,
        "default_pool_size": pool_size,
        "server_idle_timeout": 600,
        "server_lifetime": 3600,
        "query_wait_timeout": 120,
        "server_login_retry": 15,
    }


def produce(url: str, first: int, count: int, agents: int, providers: int, seed: int) -> None:
    """One producer: tasks ``first`` … ``first + count - 1``, 200 to a transaction."""
    from agentbus import AgentBus
    from agentbus.config import Settings

    rng = random.Random(seed)
    with AgentBus(url, settings=Settings()) as bus:
        for start in range(first, first + count, 200):
            items = []
            for i in range(start, min(start + 200, first + count)):
                agent = i % agents
                items.append(
                    {
                        "agent": f"agent{agent}",
                        "text": f"fleet task {i}",
                        "models": models_for(agent, providers),
                        "payload": {"sleep": round(rng.uniform(0.1, 2.0), 3)},
                    }
                )
            bus.enqueue_many(items)


class Fleet:
    """Every process of the run, each logging to a file of its own."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str]) -> subprocess.Popen[bytes]:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 (the child's)
        proc = subprocess.Popen(argv, env=self.env, stdout=log, stderr=log, cwd=self.workdir)
        log.close()
        self.procs[name] = proc
        return proc

    def died(self, prefix: str = "") -> list[str]:
        return [
            f"{name} (exit {p.returncode})"
            for name, p in self.procs.items()
            if name.startswith(prefix) and p.poll() is not None and p.returncode != 0
        ]

    def tracebacks(self) -> list[str]:
        return [
            name
            for name in self.procs
            if b"Traceback" in (self.workdir / f"{name}.log").read_bytes()
        ]

    def stop(self, prefix: str = "", timeout: float = 60.0) -> None:
        chosen = [p for name, p in self.procs.items() if name.startswith(prefix)]
        for p in chosen:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in chosen:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.1, deadline - time.monotonic()))
            if p.poll() is None:
                p.kill()
                p.wait()


# -- CPU, from /proc -------------------------------------------------------------------


def _stat(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as fh:
        stat = fh.read()
    return stat[stat.rindex(")") + 2 :].split()


def cpu_seconds(pid: int, *, reaped: bool = False) -> float:
    """A process's user + system CPU seconds; ``reaped``: with its children that it has
    waited for (a postmaster's: every backend that has exited)."""
    try:
        fields = _stat(pid)
    except OSError:
        return 0.0
    ticks = int(fields[11]) + int(fields[12])
    if reaped:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError):
                if int(_stat(int(entry))[1]) == pid:
                    found.append(int(entry))
    return found


def server_seconds(postmaster: int) -> float:
    """Every CPU second a PostgreSQL server has spent: its postmaster's, each backend's
    that has exited (reaped by the postmaster) and each live one's."""
    return cpu_seconds(postmaster, reaped=True) + sum(cpu_seconds(c) for c in children(postmaster))


# -- the run ---------------------------------------------------------------------------


def run(args: argparse.Namespace) -> bool:
    workdir = Path(tempfile.mkdtemp(prefix="agentbus-fleet-"))
    journal = workdir / "journal.txt"
    config = workdir / "agentbus.toml"
    config.write_text(config_text(args.providers, args.accounts, args.concurrency, args.rpm))
    os.chmod(workdir, 0o755)
    with contextlib.ExitStack() as stack:
        url, _restart = stack.enter_context(
            cluster(settings={"max_connections": args.max_connections})
        )
        direct = url.replace("postgresql+psycopg://", "postgresql://")
        bouncer = PgBouncer(url, **bouncer_settings(args.workers, args.pool_size)).start()
        stack.callback(bouncer.stop)
        pooled = bouncer.url("bus")
        env = {
            **os.environ,
            "AGENTBUS_DATABASE_URL": pooled,
            "AGENTBUS_CONFIG": str(config),
            "PYTHONPATH": str(HERE),
            "FLEET_JOURNAL": str(journal),
        }
        env.pop("AGENTBUS_LISTEN_URL", None)
        fleet = Fleet(workdir, env)
        stack.callback(fleet.stop)
        monitor = stack.enter_context(psycopg.connect(direct, autocommit=True))
        postmaster = postmaster_pid(monitor)

        began = time.monotonic()
        for s in range(2):
            fleet.start(f"sweeper{s}", [str(BIN / "sweeper")])
        for w in range(args.workers):
            argv = [str(BIN / "worker"), "--agent", f"agent{w % args.agents}"]
            if w % 25 == 24:
                argv += ["--concurrency", "8"]
            elif w % 10 == 9:
                argv += ["--concurrency", "4"]
            fleet.start(f"worker{w}", argv)
        deadline = began + args.timeout
        while scalar(monitor, "SELECT count(*) FROM workers") < args.workers:
            if fleet.died() or time.monotonic() > deadline:
                raise SystemExit(f"the fleet did not start: {fleet.died() or 'timed out'}")
            time.sleep(0.5)
        say(
            f"{args.workers} workers + 2 sweepers up, through PgBouncer",
            f"{time.monotonic() - began:.1f} s",
        )

        # -- idle --
        time.sleep(IDLE_SETTLE_SEC)
        workers = [p.pid for name, p in fleet.procs.items() if name.startswith("worker")]
        server0, bouncer0 = server_seconds(postmaster), cpu_seconds(bouncer.proc.pid)  # type: ignore[union-attr]
        workers0 = sum(cpu_seconds(pid) for pid in workers)
        xacts0, t0 = xacts(monitor), time.monotonic()
        peak_idle = 0
        while time.monotonic() - t0 < args.idle_sec:
            peak_idle = max(peak_idle, connections(monitor))
            time.sleep(0.5)
        idle = time.monotonic() - t0
        server = (server_seconds(postmaster) - server0) / idle
        say(
            f"idle fleet over {idle:.0f} s: the server's CPU (target at most 5 % of a core)",
            f"{server * 100:.1f} % of a core ({'met' if server <= 0.05 else 'NOT met'})",
        )
        bouncer_cpu = (cpu_seconds(bouncer.proc.pid) - bouncer0) / idle  # type: ignore[union-attr]
        workers_cpu = (sum(cpu_seconds(pid) for pid in workers) - workers0) / idle
        say(
            "idle fleet: PgBouncer's CPU; the workers' own, all of them",
            f"{bouncer_cpu * 100:.1f} % / {workers_cpu * 100:.1f} % of a core",
        )
        say(
            "idle fleet: transactions a second at the server; its connections",
            f"{(xacts(monitor) - xacts0) / idle:,.1f}; at most {peak_idle}",
        )

        # -- the work --
        per = -(-args.tasks // args.producers)
        t0 = time.monotonic()
        producers = []
        for n in range(args.producers):
            first, count = n * per, min(per, args.tasks - n * per)
            if count > 0:
                argv = [sys.executable, __file__, "--produce", pooled, str(first), str(count)]
                argv += [str(args.agents), str(args.providers), str(args.seed + n)]
                producers.append(fleet.start(f"producer{n}", argv))
        admissions: dict[int, tuple[str, str, float]] = {}
        peak = 0
        done = 0
        enqueued_in: float | None = None
        last_poll = 0.0
        while done < args.tasks:
            now = time.monotonic()
            if now > deadline:
                print(f"timed out with {done:,} of {args.tasks:,} done", file=sys.stderr)
                break
            peak = max(peak, connections(monitor))
            if enqueued_in is None and all(p.poll() is not None for p in producers):
                enqueued_in = now - t0
            if now - last_poll >= 1.0:
                last_poll = now
                copy_admissions(monitor, admissions)
                done = scalar(monitor, "SELECT count(*) FROM bus_commands WHERE status = 'done'")
                if fleet.died():
                    print(f"died: {fleet.died()}", file=sys.stderr)
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        copy_admissions(monitor, admissions)
        enqueued_in = enqueued_in or elapsed
        say(
            f"{args.tasks:,} tasks, calls of 0.1-2 s, {args.producers} producers: enqueued in",
            f"{enqueued_in:.1f} s ({args.tasks / enqueued_in:,.0f} tasks/s)",
        )
        in_flight = args.providers * args.concurrency / 1.05  # a call lasts 1.05 s on average
        per_minute = args.providers * args.accounts * args.rpm / WINDOW
        say(
            "throughput, first enqueue to last done (the slots allow; the rpm, past a minute)",
            f"{done / elapsed:,.1f} tasks/s in {elapsed:.0f} s "
            f"({in_flight:,.1f}; {per_minute:,.1f} tasks/s)",
        )
        say(
            f"server connections at most (max_connections {args.max_connections}, "
            f"PgBouncer pool {args.pool_size})",
            f"{max(peak, peak_idle)}",
        )
        pauses = scalar(monitor, "SELECT count(*) FROM task_events WHERE to_status = 'paused'")
        say("pauses (every model refused: limits full), resumed by the sweepers", f"{pauses:,}")

        fleet.stop("worker")
        fleet.stop("sweeper")
        tasks = [int(r[0]) for r in monitor.execute("SELECT id FROM bus_commands ORDER BY id")]
        statuses = Counter(
            {
                s: int(n)
                for s, n in monitor.execute(
                    "SELECT status, count(*) FROM bus_commands GROUP BY status"
                )
            }
        )
        done_events = Counter(
            {
                int(t): int(n)
                for t, n in monitor.execute(
                    "SELECT task_id, count(*) FROM task_events "
                    "WHERE to_status = 'done' GROUP BY task_id"
                )
            }
        )
        by_account: dict[tuple[str, str], list[float]] = defaultdict(list)
        for provider, account, at in admissions.values():
            by_account[(provider, account)].append(at)
        calls = read_journal(journal)
        verdict = judge(tasks, statuses, done_events, calls, by_account, args.concurrency, args.rpm)
        died, tracebacks = fleet.died(), fleet.tracebacks()
        verdict.check(
            "processes that died or logged a traceback",
            f"{len(died)} died, {len(tracebacks)} tracebacks"
            + (f" ({(died + tracebacks)[:5]})" if died or tracebacks else ""),
            not died and not tracebacks,
        )
        for what, figure, ok in verdict.lines:
            say(what, f"{figure}  [{'ok' if ok else 'FAILED'}]")
        say("fleet", "PASS" if verdict.ok else "FAIL")
        if verdict.ok:
            import shutil

            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"the processes' logs: {workdir}", file=sys.stderr)
        return verdict.ok


def postmaster_pid(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    data = Path(str(scalar_text(conn, "SHOW data_directory")))
    return int((data / "postmaster.pid").read_text().split()[0])


def scalar(conn: psycopg.Connection[tuple[object, ...]], sql: str) -> int:
    row = conn.execute(sql).fetchone()
    return int(row[0]) if row and row[0] is not None else 0  # type: ignore[call-overload]


def scalar_text(conn: psycopg.Connection[tuple[object, ...]], sql: str) -> str:
    row = conn.execute(sql).fetchone()
    return str(row[0]) if row else ""


def connections(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    """Client connections at the server, this monitor's own left out."""
    return scalar(
        conn,
        "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
        "AND pid <> pg_backend_pid()",
    )


def xacts(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    return scalar(
        conn, "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = 'bus'"
    )


def copy_admissions(
    conn: psycopg.Connection[tuple[object, ...]], into: dict[int, tuple[str, str, float]]
) -> None:
    """Every ``call_slots`` row admitted in the last 30 s (the sweeper purges none younger
    than a window), into ``into`` by id: read each second, each row is seen however late
    its transaction commits."""
    for row_id, provider, account, at in conn.execute(
        "SELECT id, provider, account, admitted_at FROM call_slots "
        "WHERE admitted_at > (SELECT coalesce(max(admitted_at), 0) - 30 FROM call_slots)"
    ):
        into[int(row_id)] = (str(provider), str(account), float(at))


def say(what: str, figure: str) -> None:
    """One figure, printed at once (a large run takes a while)."""
    print(f"{what:<84}  {figure}", flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=200)
    p.add_argument("--tasks", type=int, default=20_000)
    p.add_argument("--agents", type=int, default=40, help="at most --workers")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--providers", type=int, default=2)
    p.add_argument("--accounts", type=int, default=2, help="accounts per provider")
    p.add_argument("--rpm", type=int, default=600, help="calls per account a 60 s window")
    p.add_argument("--concurrency", type=int, default=20, help="calls in flight per provider")
    p.add_argument("--max-connections", type=int, default=100)
    p.add_argument("--pool-size", type=int, default=80, help="PgBouncer's default_pool_size")
    p.add_argument("--idle-sec", type=float, default=30.0)
    p.add_argument("--timeout", type=float, default=3600.0, help="the whole run at most")
    p.add_argument("--seed", type=int, default=1)
    return p


def main(argv: list[str]) -> int:
    if argv[:1] == ["--produce"]:
        url, first, count, agents, providers, seed = argv[1:]
        produce(url, int(first), int(count), int(agents), int(providers), int(seed))
        return 0
    args = parser().parse_args(argv)
    args.agents = min(args.agents, args.workers)  # every agent has a worker
    # Stopped (``timeout``, Ctrl-C), the run still stops its processes, PgBouncer and
    # the cluster on the way out.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    return 0 if run(args) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
