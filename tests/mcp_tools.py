"""An MCP server governed by agentbus, for the tests: ``python -m tests.mcp_tools DIR
[--http PORT]``. Its tools journal each call to DIR/journal.jsonl and are steered by
files in DIR: ``heavy`` runs until DIR/go exists, ``flaky`` fails while DIR/broken
exists and holds while DIR/hold exists. DIR/agentbus.toml is its config."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import anyio
from mcp.server.mcpserver import MCPServer

from agentbus.mcp import govern

HOLD_SEC = 60.0  # the longest a tool waits for its file


def build(folder: Path) -> MCPServer:
    server = MCPServer("agentbus-test-tools")

    def journal(event: str, tool: str) -> None:
        line = json.dumps({"event": event, "tool": tool, "pid": os.getpid(), "t": time.time()})
        with open(folder / "journal.jsonl", "a") as out:
            out.write(line + "\n")

    async def until(gone: bool, name: str) -> None:
        deadline = time.monotonic() + HOLD_SEC
        while (folder / name).exists() == gone and time.monotonic() < deadline:
            await anyio.sleep(0.01)

    @server.tool()
    async def heavy(n: int) -> int:
        journal("start", "heavy")
        await until(False, "go")
        journal("end", "heavy")
        return n

    @server.tool()
    def light() -> str:
        return "ok"

    @server.tool()
    async def flaky() -> str:
        journal("start", "flaky")
        if (folder / "broken").exists():
            raise RuntimeError("the backend is down")
        await until(True, "hold")
        journal("end", "flaky")
        return "ok"

    govern(server, config=folder / "agentbus.toml")
    return server


def main() -> None:
    folder = Path(sys.argv[1])
    server = build(folder)
    if len(sys.argv) > 3 and sys.argv[2] == "--http":
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[3]))
    else:
        server.run()


if __name__ == "__main__":
    main()
