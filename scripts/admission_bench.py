"""Admission figures for scripts/bench.py: one process asking with every gate configured
and with none, and a fleet of 8 processes admitting at once (limits on 1 or 4 providers)."""

from __future__ import annotations

import tempfile
import time
from multiprocessing.synchronize import Event
from pathlib import Path

from processes import together

from agentbus.admission.admission import Admission, Permit
from agentbus.admission.cooldowns import CooldownStore
from agentbus.catalog import Catalog
from agentbus.config import Config, Settings, load_config
from agentbus.db import Database
from agentbus.providers.outcomes import Succeeded

ALL_GATES = """
global_concurrency = 1000
daily_token_budget = 1000000000000
daily_cost_budget = 1000000
[bulkheads]
heavy = 1000
[providers.sim]
kind = "simulated"
concurrency = 1000
rpm = 1000000
[providers.sim.accounts.a]
key_env = "BENCH_KEY"
[models."sim/gated"]
provider = "sim"
bulkhead = "heavy"
[agents.bench]
models = ["sim/gated"]
rate = 1000000
"""


def fleet_config(providers: int, global_limit: int) -> str:
    """Every gate on each of ``providers`` providers: concurrency, rpm, a circuit, a
    bulkhead of its own; per-agent rates; daily budgets; a global limit if given."""
    text = f"global_concurrency = {global_limit}\ndaily_token_budget = 1000000000000\n"
    text += "daily_cost_budget = 1000000\n[bulkheads]\n"
    text += "".join(f"heavy{p} = 1000\n" for p in range(providers))
    for p in range(providers):
        text += (
            f'[providers.p{p}]\nkind = "simulated"\nconcurrency = 1000\nrpm = 100000000\n'
            f'[models."p{p}/m"]\nprovider = "p{p}"\nbulkhead = "heavy{p}"\n'
        )
    for a in range(8):
        text += f'[agents.a{a}]\nmodels = ["p0/m"]\nrate = 100000000\n'
    return text


def admit_loop(
    url: str, config_text: str, n: int, calls: int, ready: Event, go: Event
) -> tuple[int, float]:
    """One process of the fleet: admit and finish ``calls`` times (agent a<n>, provider
    p<n mod providers>); returns the calls and the CPU seconds they took."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agentbus.toml"
        path.write_text(config_text)
        config = load_config(path, environ={})
    db = Database(url)
    adm = Admission(db, config, worker=f"f{n}", cooldowns=CooldownStore(db), environ={})
    providers = sum(1 for name in config.catalog.providers if name.startswith("p"))
    model = f"p{n % providers}/m"
    (candidate,) = adm.resolve(models=(model,), role=None, agent=f"a{n}").candidates
    adm.finish(adm.admit(candidate, agent=f"a{n}", task_id=1, lease_sec=60), Succeeded("ok"))  # type: ignore[arg-type]
    ready.set()
    go.wait()
    cpu = time.process_time()
    for _ in range(calls):
        permit = adm.admit(candidate, agent=f"a{n}", task_id=1, lease_sec=60)
        assert isinstance(permit, Permit), permit
        adm.finish(permit, Succeeded("ok"))
    cpu = time.process_time() - cpu
    db.dispose()
    return calls, cpu


def bench_fleet_admission(url: str, calls: int = 300) -> list[tuple[str, str]]:
    """Limited admissions per second across 8 processes (admit + finish, every gate), with
    the processes' own CPU per admission and release (the server's is not counted)."""
    rows = []
    for providers, global_limit in ((1, 0), (4, 0), (4, 100000)):
        text = fleet_config(providers, global_limit)
        results, elapsed = together(8, admit_loop, lambda n, text=text: (url, text, n, calls))
        done, cpu = sum(r[0] for r in results), sum(r[1] for r in results)
        scope = f"{providers} provider{'s' if providers > 1 else ''}"
        scope += ", a global limit too" if global_limit else ""
        figure = f"{done / elapsed:,.0f} /s, {cpu / done * 1000:.2f} ms CPU per admission"
        rows.append((f"limited admissions, 8 processes, {scope}", figure))
    return rows


def bench_admission(db: Database, calls: int) -> list[tuple[str, str]]:
    """Admission per call: every gate configured (one transaction), and none (no I/O)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agentbus.toml"
        path.write_text(ALL_GATES)
        config = load_config(path, environ={})
    env = {"BENCH_KEY": "k"}
    unlimited = Config(Settings(), Catalog(), None)
    rows = []
    for label, model, cfg in (
        ("every gate", "sim/gated", config),
        ("no limit configured", "sim/free", unlimited),
    ):
        cooldowns = CooldownStore(db)
        adm = Admission(db, cfg, worker="bench", cooldowns=cooldowns, environ=env)
        (candidate,) = adm.resolve(models=(model,), role=None, agent="bench").candidates
        admit_s = finish_s = 0.0
        for _ in range(calls):
            started = time.perf_counter()
            permit = adm.admit(candidate, agent="bench", task_id=1, lease_sec=60)
            admitted = time.perf_counter()
            assert isinstance(permit, Permit), permit
            adm.finish(permit, Succeeded("ok"))
            admit_s += admitted - started
            finish_s += time.perf_counter() - admitted
        rows.append((f"admission decision, {label}", f"{admit_s / calls * 1e6:,.0f} µs"))
        rows.append(
            (f"admission release + circuit count, {label}", f"{finish_s / calls * 1e6:,.0f} µs")
        )
    return rows


def bench_permits(db: Database, calls: int) -> list[tuple[str, str]]:
    """``AgentBus.permit`` around a call agentbus does not make: enter and leave, p50 and
    p99, with every gate configured and with none."""
    from agentbus.admission.permits import Permits

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "agentbus.toml"
        path.write_text(ALL_GATES)
        config = load_config(path, environ={})
    unlimited = Config(Settings(), Catalog(), None)
    rows = []
    for label, model, cfg in (
        ("every gate", "sim/gated", config),
        ("no limit configured", "sim/free", unlimited),
    ):
        permits = Permits.open(db, cfg, holder="bench")
        permits.admission.environ = {"BENCH_KEY": "k"}
        with permits.permit(model, agent="bench"):  # warm: the catalog's answers kept
            pass
        took = []
        for _ in range(calls):
            started = time.perf_counter()
            with permits.permit(model, agent="bench"):
                pass
            took.append(time.perf_counter() - started)
        took.sort()
        p50, p99 = took[len(took) // 2], took[min(len(took) - 1, len(took) * 99 // 100)]
        rows.append((f"permit, {label}", f"p50 {p50 * 1e6:,.0f} µs, p99 {p99 * 1e6:,.0f} µs"))
    return rows


def bench_mcp(url: str, calls: int) -> list[tuple[str, str]]:
    """One MCP ``tools/call`` through the SDK's in-process client, p50 and p99: a server
    left alone, and one under ``agentbus.mcp.govern`` (a bulkhead and a circuit; then a
    client window as well)."""
    import anyio
    from mcp import Client
    from mcp.server.mcpserver import MCPServer
    from mcp.types import Implementation

    from agentbus.mcp import govern

    def server(config: str | None) -> tuple[MCPServer, object]:
        made = MCPServer("bench")

        @made.tool()
        def echo(text: str) -> str:
            return text

        if config is None:
            return made, None
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "agentbus.toml"
            path.write_text(f'database_url = "{url}"\n[mcp]\n{config}\n')
            return made, govern(made, config=path)

    async def timed(made: MCPServer) -> list[float]:
        info = Implementation(name="bench", version="1")
        async with Client(made, client_info=info) as client:
            await client.call_tool("echo", {"text": "warm"})
            took = []
            for _ in range(calls):
                started = time.perf_counter()
                await client.call_tool("echo", {"text": "hi"})
                took.append(time.perf_counter() - started)
        return sorted(took)

    rows = []
    for label, config in (
        ("ungoverned", None),
        ("governed: bulkhead and circuit", "client_rate = 0"),
        ("governed: client window as well", "client_rate = 1000000"),
    ):
        made, gateway = server(config)
        took = anyio.run(timed, made)
        if gateway is not None:
            gateway.close()  # type: ignore[attr-defined]
        p50, p99 = took[len(took) // 2], took[min(len(took) - 1, len(took) * 99 // 100)]
        rows.append(
            (f"MCP tools/call, {label}", f"p50 {p50 * 1e6:,.0f} µs, p99 {p99 * 1e6:,.0f} µs")
        )
    return rows
