"""``busctl demo``: the whole mission, live, on a fresh embedded database.

A sweeper and three agents' workers run as real subprocesses. About 60 tasks
are queued over simulated models: ``sim/opus`` answers 429 for the first
~15 s (asking, through Retry-After, to wait that long), and ``sim/haiku`` is
slow. Tasks that only have opus are paused — not failed — and resumed by the
sweeper the moment the cooldown ends; tasks with haiku as a fallback finish
on it. The demo shortens the cooldown and the sweeper's interval through the
ordinary settings (environment variables of the children), nothing else.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentbus.admin import kpi
from agentbus.admission.cooldowns import CooldownStore
from agentbus.db import Database
from agentbus.migrations import migrate
from agentbus.queue import TaskQueue, reads
from agentbus.queue.states import TERMINAL, TaskStatus
from agentbus.queue.tasks import TaskSpec

AGENTS = ("codex", "analyst-macro", "ron")
TOPICS = (
    "macro news",
    "KOSPI earnings",
    "energy prices",
    "shipbuilding orders",
    "bond yields",
    "the sector report",
)


@dataclass(frozen=True)
class Plan:
    tasks: int = 60
    limited_for: float = 15.0  # sim/opus answers 429 for this long
    cooldown: float = 5.0  # MODEL_COOLDOWN_SEC for the children (Retry-After is longer)
    slow_ms: int = 400  # sim/haiku's latency
    timeout: float = 120.0


QUICK = Plan(tasks=15, limited_for=5.0, cooldown=1.0, slow_ms=100, timeout=60.0)


def enqueue_tasks(queue: TaskQueue, plan: Plan, started: float) -> list[int]:
    until = started + plan.limited_for
    opus = {"behaviour": "rate_limited", "until": until, "retry_after_s": plan.limited_for}
    specs = []
    for i in range(plan.tasks):
        fallback = i % 3 == 2
        specs.append(
            TaskSpec(
                agent=AGENTS[i % len(AGENTS)],
                command=f"Summarise {TOPICS[i % len(TOPICS)]} (#{i + 1})",
                models=("sim/opus", "sim/haiku") if fallback else ("sim/opus",),
                payload={
                    "simulate": {
                        "sim/opus": opus,
                        "sim/haiku": {"behaviour": "ok", "latency_ms": plan.slow_ms},
                    }
                },
            )
        )
    return queue.enqueue_many(specs)


class Demo:
    def __init__(self, url: str, plan: Plan, echo: Callable[[str], None], workdir: Path) -> None:
        self.url = url
        self.plan = plan
        self.echo = echo
        self.workdir = workdir
        self.children: list[subprocess.Popen[bytes]] = []

    def run(self) -> int:
        db = Database(self.url)
        try:
            migrate(db)
            self.echo(f"database: {self.url}")
            self._start_children()
            if not self._wait_for_workers(db):
                self.echo(f"the workers did not start (see the logs in {self.workdir})")
                return 1
            started = time.time()  # the rate-limit episode starts now that all run
            ids = enqueue_tasks(TaskQueue(db), self.plan, started)
            self.echo(
                f"queued {len(ids)} tasks for {', '.join(AGENTS)}; sim/opus is "
                f"rate-limited for {self.plan.limited_for:g} s, sim/haiku is slow\n"
            )
            finished = self._watch(db, started, len(ids))
            self._stop_children()
            return self._report(db, finished, len(ids))
        finally:
            self._stop_children()
            db.dispose()

    def _start_children(self) -> None:
        config = self.workdir / "demo.toml"
        config.write_text("# busctl demo: no providers needed, sim/* models only\n")
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("AGENTBUS_")},
            "AGENTBUS_DATABASE_URL": self.url,
            "AGENTBUS_CONFIG": str(config),
            "AGENTBUS_MODEL_COOLDOWN_SEC": str(self.plan.cooldown),
            "AGENTBUS_SWEEP_INTERVAL_SEC": "10",
            "AGENTBUS_SWEEP_PEEK_SEC": "0.5",
            "AGENTBUS_POLL_SEC": "0.2",
            "AGENTBUS_LEASE_SEC": "30",
        }
        bindir = Path(sys.executable).parent
        commands = [["sweeper"]] + [["worker", "--agent", agent] for agent in AGENTS]
        for argv in commands:
            name = "-".join(argv[::2])
            log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - child's stderr
            self.children.append(
                subprocess.Popen(
                    [str(bindir / argv[0]), *argv[1:], "--log-json"],
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                )
            )
            log.close()
        self.echo(f"started a sweeper and {len(AGENTS)} workers (logs in {self.workdir})")

    def _wait_for_workers(self, db: Database) -> bool:
        """Until every agent's worker has registered (however slowly the machine
        starts processes), so the tasks meet the rate limit they are meant to."""
        deadline = time.monotonic() + self.plan.timeout
        while time.monotonic() < deadline:
            if reads.live_agents(db) >= set(AGENTS):
                return True
            if any(c.poll() is not None for c in self.children):
                return False
            time.sleep(0.1)
        return False

    def _watch(self, db: Database, started: float, total: int) -> bool:
        cooldowns = CooldownStore(db, cache_sec=1e-9)
        tty = sys.stdout.isatty()
        last_line = 0.0
        while True:
            counts = reads.counts(db)
            by_status = {
                s.value: sum(n for (st, _), n in counts.items() if st == s) for s in TaskStatus
            }
            now = time.time()
            cooling = (
                ", ".join(
                    f"{m} {until - now:.0f}s" for m, until in sorted(cooldowns.active().items())
                )
                or "none"
            )
            line = (
                f"{now - started:5.1f}s  "
                + "  ".join(f"{k} {v:>2}" for k, v in by_status.items())
                + f"  | cooling: {cooling}"
            )
            if tty:
                sys.stdout.write("\r" + line.ljust(110))
                sys.stdout.flush()
            elif now - last_line >= 2:
                self.echo(line)
                last_line = now
            dead = [c for c in self.children if c.poll() is not None]
            done = sum(by_status[s] for s in TERMINAL) == total
            if done or dead or now - started > self.plan.timeout:
                if tty:
                    sys.stdout.write("\n")
                if dead and not done:
                    self.echo(f"a child process exited early (see the logs in {self.workdir})")
                if not done and not dead:
                    self.echo(f"not finished after {self.plan.timeout:g} s")
                return done
            time.sleep(0.5)

    def _stop_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for child in self.children:
            try:
                child.wait(timeout=40)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        self.children = []

    def _report(self, db: Database, finished: bool, total: int) -> int:
        kpis = kpi.compute(db)
        counts = reads.counts(db)
        done = sum(n for (status, _), n in counts.items() if status == TaskStatus.DONE)
        failed = sum(n for (status, _), n in counts.items() if status == TaskStatus.FAILED)
        self.echo(
            f"\n{done} of {total} tasks done, {failed} failed; "
            f"{kpis[0].numerator} paused on a cooldown instead of failing, "
            f"{kpis[1].denominator} resumed by the sweeper\n"
        )
        self.echo(kpi.render(kpis))
        path = self.url.removeprefix("sqlite:///")
        busctl = _command("busctl")
        self.echo(
            "\nLook around:\n"
            f"  {busctl} --db {self.url} tasks --status done\n"
            f"  {busctl} --db {self.url} show 1\n"
            f"  {busctl} --db {self.url} routes --task 1\n"
            f"  {busctl} --db {self.url} kpi\n"
            f"  {busctl} --db {self.url} serve     # then open http://127.0.0.1:8765/\n"
            + (f"  {busctl} kpi --sql | sqlite3 {path}\n" if self.url.startswith("sqlite") else "")
        )
        showed = kpis[0].numerator > 0 and kpis[1].denominator > 0
        if not showed:
            self.echo(
                "nothing was paused and resumed: the demo did not show what it is for "
                f"(see the logs in {self.workdir})"
            )
        ok = finished and done == total and kpis[0].passed is not False and kpis[3].passed
        return 0 if ok and showed else 1


def _command(name: str) -> str:
    """How the user can type one of our commands: bare if on PATH, else its path."""
    exe = Path(sys.executable).with_name(name)
    if shutil.which(name) == str(exe):
        return name
    try:
        return str(exe.relative_to(Path.cwd()))
    except ValueError:
        return str(exe)


def default_url(workdir: Path) -> str:
    return f"sqlite:///{workdir / 'demo.db'}"


def new_workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="agentbus-demo-"))
