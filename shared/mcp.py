"""Govern an MCP server's ``tools/call`` with agentbus admission (the ``agentbus[mcp]``
extra, on the official ``mcp`` SDK)::

    from mcp.server.mcpserver import MCPServer
    from agentbus.mcp import govern

    server = MCPServer("analytics")

    @server.tool()
    def execute_analytics_query(sql: str) -> list[dict]: ...

    govern(server)  # the database and [mcp] of agentbus.toml (or $AGENTBUS_CONFIG)
    server.run()

Every ``tools/call`` passes a per-client sliding window, the tool's bulkhead (a slot
is waited for up to ``slot_wait_ms``) and the tool's circuit, kept in the agentbus
database: every replica of the server, on any host, shares one quota
(``agentbus.admission.tools``). A refused call gets a JSON-RPC error, ``-32000``
(rate limited), ``-32001`` (circuit open) or ``-32002`` (bulkhead full), with
``data: {retry_after_ms, suggested_action: "DO_NOT_RETRY_IMMEDIATELY"}``.

The client is the authenticated principal (MCP auth's ``client_id``); else, on
streamable HTTP, the header ``[mcp] client_header`` names; else the ``clientInfo.name``
of the initialize request. The last two are what the client says it is: a client that
lies about its name gets another's window, or one of its own.

A call that raises, or whose result says ``isError``, counts as a failure of the
tool; unless its arguments do not match the tool's input schema, or it names a tool
the server does not list: that is the caller's mistake. Such a call passes the gates
like any other (its client's window, a slot) and its error counts against no circuit.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from agentbus.admission.admission import Permit
from agentbus.admission.gates import SLOT_CODES, Code, Refusal
from agentbus.admission.tools import ToolGate
from agentbus.config import LiveConfig, load_config
from agentbus.db import Database
from agentbus.errors import BusError
from agentbus.logging import get_logger

log = get_logger("agentbus.mcp")

SUGGESTED_ACTION = "DO_NOT_RETRY_IMMEDIATELY"
#: The longest client or tool name kept (a longer one is cut): names become rows' keys.
MAX_NAME = 128
_SLOT_LOOK_SEC = 0.02  # how often a call waiting for a slot looks again
#: JSON-RPC errors that are the caller's mistake, not the tool's failure.
_CALLER_ERRORS = frozenset({-32602, -32601, -32600})  # invalid params, no method, invalid

Middleware = Callable[[Any, Callable[[Any], Awaitable[Any]]], Awaitable[Any]]


def govern(
    server: Any,
    *,
    config: str | Path | None = None,
    url: str | None = None,
    holder: str | None = None,
) -> Gateway:
    """Put ``server``'s ``tools/call`` under admission: an ``MCPServer`` or a low-level
    ``Server`` of the ``mcp`` SDK (2.x). ``config``: the agentbus config file (else
    $AGENTBUS_CONFIG, else ./agentbus.toml); ``url``: the database (else the config's).
    The gateway is the last middleware of the server's chain; it is returned.

    A config that does not read, or a database that is not there or not migrated, ends
    the server as it starts: one line on stderr and the exit status of the error (2 for
    a config error), as agentbus's own programs do (``Gateway.open`` raises instead)."""
    try:
        gateway = Gateway.open(config=config, url=url, holder=holder, tools=_tool_lister(server))
    except BusError as exc:
        print(f"agentbus.mcp: {exc.message}", file=sys.stderr)
        raise SystemExit(exc.exit_code) from None
    server.middleware.append(gateway)
    return gateway


class Gateway:
    """The middleware (``(ctx, call_next) -> result``) that admits ``tools/call``."""

    def __init__(
        self,
        gate: ToolGate,
        *,
        tools: Callable[[], Awaitable[list[Any]]] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.gate = gate
        self._list_tools = tools
        self._schemas: dict[str, Callable[[Any], bool]] | None = None  # tool -> validator
        self._clock = clock
        self._limiter = anyio.CapacityLimiter(32)

    @classmethod
    def open(
        cls,
        *,
        config: str | Path | None = None,
        url: str | None = None,
        holder: str | None = None,
        tools: Callable[[], Awaitable[list[Any]]] | None = None,
    ) -> Gateway:
        loaded = load_config(config, {"database_url": url} if url else None)
        settings = loaded.settings
        connections = settings.connections(2, 3, "an MCP gateway")
        db = Database.from_settings(
            settings, threads=8, name="agentbus-mcp", connections=connections
        )
        try:
            db.require_migrated()
        except BaseException:
            db.dispose()
            raise
        holder = holder or f"mcp:{socket.gethostname()}:{os.getpid()}"
        return cls(ToolGate(db, LiveConfig(loaded), holder=holder), tools=tools)

    def close(self) -> None:
        self.gate.db.dispose()

    async def __call__(self, ctx: Any, call_next: Callable[[Any], Awaitable[Any]]) -> Any:
        if ctx.method == "tools/list" and ctx.request_id is not None:
            result = await call_next(ctx)
            self._learn(result)
            return result
        if ctx.method != "tools/call" or ctx.request_id is None:
            return await call_next(ctx)
        params = ctx.params if isinstance(ctx.params, Mapping) else {}
        tool = params.get("name")
        if not isinstance(tool, str):
            return await call_next(ctx)  # names no tool: the server refuses the request
        tool = tool[:MAX_NAME]
        # Governed all the same; but a call the tool's schema refuses fails by the
        # caller's fault, not the tool's: its error counts against no circuit.
        counts = await self._well_formed(tool, params)
        client = client_of(ctx, self.gate.mcp.client_header)
        answer = await self._admit(tool, client)
        if isinstance(answer, Refusal):
            error = self._refused(tool, client, answer)
            await self._run(lambda: self._record(tool, client, answer))
            raise error
        failed: bool | None = None
        try:
            result = await call_next(ctx)
            failed = _is_error(result) if counts else None
            return result
        except Exception as exc:
            failed = counts and getattr(exc, "code", None) not in _CALLER_ERRORS
            raise
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled call still gives its slot back
                await self._run(lambda: self.gate.finish(answer, failed=failed))

    async def _admit(self, tool: str, client: str) -> Permit | Refusal:
        """A permit, or a refusal once a slot was waited for up to ``slot_wait_ms`` (the
        waiting is here, not in a thread: a flood's waiters hold no thread)."""
        deadline = self._clock() + self.gate.mcp.slot_wait_ms / 1000
        while True:
            answer: Permit | Refusal = await self._run(lambda: self.gate.admit(tool, client))
            if not (isinstance(answer, Refusal) and answer.code in SLOT_CODES):
                return answer
            if self._clock() >= deadline:
                return answer
            await anyio.sleep(min(_SLOT_LOOK_SEC, max(0.0, deadline - self._clock())))

    def _refused(self, tool: str, client: str, refusal: Refusal) -> Exception:
        from mcp.shared.exceptions import MCPError

        now = self.gate.admission.clock()
        said = refusal.as_dict(now)
        log.info(
            "tool_refused",
            tool=tool,
            client=client,
            code=refusal.code.value,
            retry_after_ms=said["retry_after_ms"],
            detail=refusal.detail,
        )
        number = refusal.code.number or Code.RATE_LIMITED.number
        message = f"{refusal.code.value}: {refusal.detail}"
        data = {
            "retry_after_ms": said["retry_after_ms"],
            "suggested_action": SUGGESTED_ACTION,
            "name": refusal.code.value,
        }
        return MCPError(number or -32000, message, data)

    def _record(self, tool: str, client: str, refusal: Refusal) -> None:
        try:
            self.gate.record([(tool, client, refusal)])
        except Exception as exc:  # the history is not worth a call's answer
            log.warning("tool_refusal_not_recorded", tool=tool, error=str(exc))

    async def _run(self, work: Callable[[], Any]) -> Any:
        return await anyio.to_thread.run_sync(work, limiter=self._limiter)

    # -- which calls are governed ------------------------------------------------

    async def _well_formed(self, tool: str, params: Mapping[str, Any]) -> bool:
        """Whether the call names a tool the server lists, with arguments its input
        schema takes (not known: yes; the schemas come from ``MCPServer.list_tools``, or
        from the tools/list results that pass)."""
        known = self._schemas is not None and tool in self._schemas
        if not known and self._list_tools is not None:  # a tool added since: list again
            try:
                self._learn({"tools": await self._list_tools()})
            except Exception as exc:
                log.warning("mcp_tools_not_listed", error=str(exc))
                self._list_tools = None
        if self._schemas is None:
            return True
        valid = self._schemas.get(tool)
        arguments = params.get("arguments")
        return valid is not None and valid({} if arguments is None else arguments)

    def _learn(self, result: Any) -> None:
        """Keep each tool's input schema from a tools/list result."""
        tools = _field(result, "tools")
        if not isinstance(tools, list):
            return
        schemas = dict(self._schemas or {})
        for tool in tools:
            name = _field(tool, "name")
            schema = _field(tool, "inputSchema", "input_schema")
            if isinstance(name, str):
                schemas[name] = _validator(schema)
        self._schemas = schemas


def client_of(ctx: Any, header: str | None) -> str:
    """Who calls: the authenticated principal, else the named header (streamable HTTP),
    else the initialize request's ``clientInfo.name``, else ``anonymous``."""
    from mcp.server.auth.middleware.auth_context import get_access_token

    token = get_access_token()
    name: Any = token.client_id if token is not None else None
    if not name and header:
        headers = getattr(ctx.request, "headers", None)
        name = headers.get(header) if headers is not None else None
    if not name:
        params = getattr(ctx.session, "client_params", None)
        info = getattr(params, "client_info", None)
        name = getattr(info, "name", None)
    return str(name)[:MAX_NAME] if name else "anonymous"


def _tool_lister(server: Any) -> Callable[[], Awaitable[list[Any]]] | None:
    """``server.list_tools`` where it lists without a request (``MCPServer``'s)."""
    import inspect

    lister = getattr(server, "list_tools", None)
    if lister is None or not inspect.iscoroutinefunction(lister):
        return None
    try:
        inspect.signature(lister).bind()
    except TypeError:
        return None
    return lister  # type: ignore[no-any-return]


def _validator(schema: Any) -> Callable[[Any], bool]:
    import jsonschema  # type: ignore[import-untyped]  # the mcp SDK's own dependency

    if not isinstance(schema, Mapping):
        return lambda arguments: isinstance(arguments, Mapping)
    try:
        checker = jsonschema.validators.validator_for(schema)(dict(schema))
    except Exception:
        return lambda arguments: isinstance(arguments, Mapping)
    return lambda arguments: isinstance(arguments, Mapping) and checker.is_valid(arguments)


def _field(value: Any, *names: str) -> Any:
    for name in names:
        found = value.get(name) if isinstance(value, Mapping) else getattr(value, name, None)
        if found is not None:
            return found
    return None


def _is_error(result: Any) -> bool:
    return bool(_field(result, "isError", "is_error"))
