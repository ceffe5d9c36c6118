"""The MCP gateway: real server processes (``tests.mcp_tools``) governed by agentbus,
sharing one database, called through the SDK's own client over stdio and streamable
HTTP. Each process's tools journal their calls; the database says what was refused."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import sqlalchemy as sa
from mcp import Client, StdioServerParameters
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from mcp.types import Implementation

from agentbus.catalog import parse_catalog
from agentbus.db import Database
from agentbus.errors import ConfigError
from agentbus.schema import bus_counters, bus_events, circuits, route_log
from tests.support import clean_env, free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
CONFIG = """
database_url = "{url}"
cooldown_cache_sec = 0.2
[bulkheads]
heavy_pool = 3
[mcp]
client_rate = 20
client_rate_window_sec = 600
slot_wait_ms = 100
circuit_consecutive_failures = 5
circuit_open_sec = 1
client_header = "X-Agent"
[mcp.tools.heavy]
bulkhead = "heavy_pool"
"""
Connect = Callable[[str], contextlib.AbstractAsyncContextManager[Any]]


@pytest.fixture
def folder(db_url: str, tmp_path: Path) -> Path:
    (tmp_path / "agentbus.toml").write_text(CONFIG.format(url=db_url))
    return tmp_path


@pytest.fixture(params=["stdio", "http"])
def connect(request: pytest.FixtureRequest, folder: Path) -> Iterator[Connect]:
    """``connect(client)``: a client session with the next of two server processes,
    named ``client`` (stdio: each session is a process of its own, named by its
    clientInfo; streamable HTTP: two processes, the client named by a header)."""
    turn = iter(range(1_000_000))
    if request.param == "stdio":
        params = StdioServerParameters(
            command=sys.executable,
            args=["-m", "tests.mcp_tools", str(folder)],
            env=clean_env(),
            cwd=str(ROOT),
        )

        def stdio(client: str) -> Any:
            return Client(params, client_info=Implementation(name=client, version="1"))

        yield stdio
        return
    import httpx2

    ports = [free_port(), free_port()]
    logs = [(folder / f"server-{port}.log").open("w") for port in ports]
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests.mcp_tools", str(folder), "--http", str(port)],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
        for port, log in zip(ports, logs, strict=True)
    ]
    try:
        for port in ports:
            wait_until(lambda p=port: _listening(p), timeout=60)

        @contextlib.asynccontextmanager
        async def http(client: str) -> AsyncIterator[Any]:
            url = f"http://127.0.0.1:{ports[next(turn) % 2]}/mcp"
            async with httpx2.AsyncClient(headers={"X-Agent": client}) as web:
                transport = streamable_http_client(url, http_client=web)
                info = Implementation(name="not-me", version="1")  # the header wins
                async with Client(transport, client_info=info) as session:
                    yield session

        yield http
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=30)
        for log in logs:
            log.close()


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.asynccontextmanager
async def sessions(connect: Connect, client: str) -> AsyncIterator[list[Any]]:
    """Two sessions of ``client``, with the two server processes."""
    async with connect(client) as one, connect(client) as two:
        yield [one, two]


async def call(session: Any, tool: str, arguments: dict[str, Any]) -> Any:
    """``"ok"``, ``"error"`` (the tool's result said isError) or the refusal's code."""
    try:
        result = await session.call_tool(tool, arguments)
    except MCPError as exc:
        if exc.code in (-32000, -32001, -32002):  # a refusal, not the server's own error
            assert exc.data["suggested_action"] == "DO_NOT_RETRY_IMMEDIATELY"
            assert exc.data["retry_after_ms"] >= 0
        return exc.code
    return "error" if result.is_error else "ok"


def journal(folder: Path, tool: str) -> list[dict[str, Any]]:
    path = folder / "journal.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, lines) if e["tool"] == tool]


def most_at_once(events: list[dict[str, Any]]) -> int:
    running = peak = 0
    for e in sorted(events, key=lambda e: (e["t"], e["event"] == "start")):
        running += 1 if e["event"] == "start" else -1
        peak = max(peak, running)
    return peak


def test_a_flood_keeps_its_bulkhead_across_processes_and_others_pass(
    connect: Connect, folder: Path, db_url: str, run_busctl: Callable[..., Any]
) -> None:
    async def main() -> tuple[list[Any], list[Any], list[Any]]:
        async with sessions(connect, "flooder") as a, sessions(connect, "quiet") as b:
            heavy: list[Any] = []

            async def flood(i: int) -> None:
                heavy.append(await call(a[i % 2], "heavy", {"n": i}))

            async with anyio.create_task_group() as tg:
                for i in range(12):
                    tg.start_soon(flood, i)
                with anyio.fail_after(60):  # every call but the three held is refused
                    while len(heavy) < 9:
                        await anyio.sleep(0.01)
                # the green lane: another client's light calls, while the flood holds
                light = [await call(b[i % 2], "light", {}) for i in range(10)]
                (folder / "go").touch()
            # malformed arguments, more than the circuit's 5: the server's own answer,
            # which opens no circuit
            bad = [await call(a[i % 2], "heavy", {"n": "many"}) for i in range(6)]
            bad.append(await call(a[0], "heavy", {"n": 99}))
        return heavy, light, bad

    heavy, light, bad = anyio.run(main)
    assert sorted(heavy, key=str) == [-32002] * 9 + ["ok"] * 3
    assert light == ["ok"] * 10
    assert bad == ["error"] * 6 + ["ok"]
    calls = journal(folder, "heavy")
    assert len(calls) == 8 and most_at_once(calls) == 3  # 3 + 1 started and ended

    db = Database(db_url)
    try:
        rows = db.read(
            lambda conn: conn.execute(
                sa.select(route_log.c.agent, route_log.c.model, route_log.c.code)
            ).all()
        )
        holders = db.read(
            lambda conn: conn.execute(
                sa.select(sa.func.count(route_log.c.worker.distinct()))
            ).scalar()
        )
        counted = db.read(
            lambda conn: conn.execute(
                sa.select(bus_counters.c.value).where(
                    bus_counters.c.name == "admission_refusals",
                    bus_counters.c.label == "bulkhead_full",
                )
            ).scalar()
        )
    finally:
        db.dispose()
    assert sorted(rows) == [("mcp:flooder", "mcp:heavy", "bulkhead_full")] * 9
    assert counted == 9
    assert holders == 2  # each process had 6 calls, and refused 3 at least
    shown = run_busctl("refusals", "--json", env={"AGENTBUS_DATABASE_URL": db_url})
    assert shown.returncode == 0, shown.stderr
    listed = json.loads(shown.stdout)
    assert len(listed) == 9 and {r["agent"] for r in listed} == {"mcp:flooder"}
    assert {(r["candidate"], r["code"], r["task_id"]) for r in listed} == {
        ("mcp:heavy", -32002, None)
    }


def test_a_client_window_is_shared_by_the_processes(connect: Connect, folder: Path) -> None:
    async def main() -> list[Any]:
        async with sessions(connect, "chatty") as d:
            return [await call(d[i % 2], "light", {}) for i in range(26)]

    said = anyio.run(main)
    assert said[:20] == ["ok"] * 20  # client_rate = 20 per 600 s, both processes counted
    assert said[20:] == [-32000] * 6


def test_five_failures_open_the_circuit_everywhere_and_one_probe_closes_it(
    connect: Connect, folder: Path, db_url: str
) -> None:
    db = Database(db_url)

    def circuit() -> Any:
        query = sa.select(circuits).where(circuits.c.provider == "mcp:flaky")
        return db.read(lambda conn: conn.execute(query).first())

    async def main() -> dict[str, Any]:
        seen: dict[str, Any] = {}
        async with sessions(connect, "caller") as c:
            (folder / "broken").touch()
            seen["failing"] = [await call(c[i % 2], "flaky", {}) for i in range(5)]
            seen["open"] = await call(c[0], "flaky", {})  # the process that counted the 5th
            # The other learns of it at its next read of the circuits (cooldown_cache_sec).
            with anyio.fail_after(30):
                while await call(c[1], "flaky", {}) != -32001:
                    pass
            (folder / "broken").unlink()
            (folder / "hold").touch()
            opened = circuit()
            await anyio.to_thread.run_sync(
                lambda: wait_until(lambda: time.time() > opened.open_until + 0.05, timeout=30)
            )
            probes: list[Any] = []
            before = len(journal(folder, "flaky"))
            async with anyio.create_task_group() as tg:

                async def probe() -> None:
                    probes.append(await call(c[0], "flaky", {}))

                tg.start_soon(probe)
                with anyio.fail_after(60):  # the probe is in flight in the first process
                    while len(journal(folder, "flaky")) <= before:
                        await anyio.sleep(0.01)
                seen["half_open"] = await call(c[1], "flaky", {})
                (folder / "hold").unlink()
            seen["probe"] = probes
            seen["closed"] = await call(c[0], "flaky", {})  # the process of the probe
            with anyio.fail_after(30):  # the other, at its next read of the circuits
                while await call(c[1], "flaky", {}) != "ok":
                    pass
        return seen

    try:
        seen = anyio.run(main)
        after = circuit()
        kinds = db.read(
            lambda conn: (
                conn.execute(
                    sa.select(bus_events.c.kind)
                    .where(bus_events.c.kind.like("circuit_%"))
                    .order_by(bus_events.c.id)
                )
                .scalars()
                .all()
            )
        )
    finally:
        db.dispose()
    assert seen["failing"] == ["error"] * 5
    assert seen["open"] == -32001
    assert seen["half_open"] == -32001  # while the one probe is in flight
    assert seen["probe"] == ["ok"]
    assert seen["closed"] == "ok"
    assert after.state == "closed"
    assert kinds == ["circuit_open", "circuit_half_open", "circuit_closed"]


def test_unknown_or_bad_keys_in_mcp_are_one_clear_error() -> None:
    cases = {
        "[mcp]: unknown key 'client_rates'": {"mcp": {"client_rates": 5}},
        "[mcp] client_rate must be a whole number of at least 0": {"mcp": {"client_rate": -1}},
        "[mcp.tools.q]: give either concurrency or bulkhead": {"mcp": {"tools": {"q": {}}}},
        "[mcp.tools.q]: unknown bulkhead 'big' (not in [bulkheads])": {
            "mcp": {"tools": {"q": {"bulkhead": "big"}}}
        },
        "[mcp] slot_wait_ms must be a number, 0 or more": {"mcp": {"slot_wait_ms": "x"}},
    }
    for message, doc in cases.items():
        with pytest.raises(ConfigError) as caught:
            parse_catalog(doc)
        assert str(caught.value) == message


def test_the_example_of_docs_mcp_runs(db_url: str, tmp_path: Path) -> None:
    """docs/mcp.md: its server, over stdio, until its client's window is full."""
    text = (ROOT / "docs/mcp.md").read_text()
    example = text.split("```python\n", 1)[1].split("```", 1)[0]
    (tmp_path / "server.py").write_text(example)
    config = tmp_path / "agentbus.toml"
    config.write_text(f'database_url = "{db_url}"\n[mcp]\nclient_rate = 3\n')
    params = StdioServerParameters(
        command=sys.executable,
        args=[str(tmp_path / "server.py")],
        env=clean_env() | {"AGENTBUS_CONFIG": str(config)},
        cwd=str(tmp_path),
    )

    async def main() -> list[Any]:
        async with Client(params, client_info=Implementation(name="bot", version="1")) as s:
            said = [await call(s, "get_user_status", {"user": "ada"}) for _ in range(3)]
            return [*said, await call(s, "execute_analytics_query", {"sql": "select 1"})]

    assert anyio.run(main) == ["ok", "ok", "ok", -32000]


def test_a_low_level_server_is_governed_too(db_url: str, tmp_path: Path) -> None:
    """The SDK's low-level ``Server``: its tools' schemas come from its tools/list."""
    from mcp import types
    from mcp.server.lowlevel import Server

    from agentbus.mcp import govern

    config = tmp_path / "agentbus.toml"
    config.write_text(
        f'database_url = "{db_url}"\n[mcp]\nslot_wait_ms = 0\n[mcp.tools.slow]\nconcurrency = 1\n'
    )
    release, started = anyio.Event(), anyio.Event()
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}

    async def list_tools(ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[types.Tool(name="slow", input_schema=schema)])

    async def call_tool(ctx: Any, params: Any) -> types.CallToolResult:
        if params.name != "slow":
            raise MCPError(-32602, f"no tool {params.name}")
        started.set()
        await release.wait()
        return types.CallToolResult(content=[types.TextContent(type="text", text="done")])

    server = Server("low", on_list_tools=list_tools, on_call_tool=call_tool)
    gateway = govern(server, config=config)

    async def main() -> list[Any]:
        said: list[Any] = []
        async with Client(server, client_info=Implementation(name="lo", version="1")) as c:
            await c.list_tools()
            async with anyio.create_task_group() as tg:

                async def first() -> None:
                    said.append(await call(c, "slow", {"n": 1}))

                tg.start_soon(first)
                await started.wait()
                said.append(await call(c, "slow", {"n": 2}))  # its one slot is taken
                said.append(await call(c, "nope", {}))  # not a tool: the server's answer
                release.set()
        return said

    try:
        said = anyio.run(main)
        refused = gateway.gate.db.read(
            lambda conn: conn.execute(sa.select(route_log.c.model, route_log.c.code)).all()
        )
    finally:
        gateway.close()
    assert said == [-32002, -32602, "ok"]
    assert refused == [("mcp:slow", "bulkhead_full")]


def test_the_client_is_its_principal_else_the_header_else_its_name() -> None:
    from types import SimpleNamespace

    from mcp.server.auth.middleware.auth_context import auth_context_var
    from mcp.server.auth.middleware.bearer_auth import AuthenticatedUser
    from mcp.server.auth.provider import AccessToken

    from agentbus.mcp import client_of

    def ctx(name: str | None, headers: dict[str, str] | None) -> Any:
        info = SimpleNamespace(client_info=SimpleNamespace(name=name))
        request = SimpleNamespace(headers=headers) if headers is not None else None
        return SimpleNamespace(session=SimpleNamespace(client_params=info), request=request)

    assert client_of(ctx("bot", None), "x-agent") == "bot"
    assert client_of(ctx("bot", {"x-agent": "billing"}), "x-agent") == "billing"
    assert client_of(ctx("bot", {"x-agent": "billing"}), None) == "bot"  # no header named
    assert client_of(ctx(None, None), None) == "anonymous"
    assert client_of(ctx("x" * 500, None), None) == "x" * 128
    token = AccessToken(token="t", client_id="team-a", scopes=[])
    held = auth_context_var.set(AuthenticatedUser(token))
    try:
        assert client_of(ctx("bot", {"x-agent": "billing"}), "x-agent") == "team-a"
    finally:
        auth_context_var.reset(held)


def test_a_config_that_does_not_read_stops_the_server_with_one_line(tmp_path: Path) -> None:
    (tmp_path / "agentbus.toml").write_text("[mcp]\nclient_rates = 5\n")
    done = subprocess.run(
        [sys.executable, "-m", "tests.mcp_tools", str(tmp_path)],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"agentbus.mcp: {tmp_path / 'agentbus.toml'}: [mcp]: unknown key 'client_rates'"
    ]
