"""Admission of MCP ``tools/call``: the gates of model calls, shared through the same
tables, with tools in the place of models and clients in the place of agents.

A tool is the one model of a provider of its own, ``mcp:<tool>``: its circuit is that
provider's, with the rules of ``[mcp]`` (``circuit_consecutive_failures`` failures in a
row open it for ``circuit_open_sec``, then one probe across every process closes or
reopens it). Its concurrency is a bulkhead: its own (``mcp:<tool>``, sized by
``[mcp.tools.<tool>] concurrency`` or ``default_concurrency``) or a pool of
``[bulkheads]``. A client is an agent, ``mcp:<client>``, whose sliding window is
``client_rate`` calls per ``client_rate_window_sec``. Nothing else of the workers'
admission applies: no global concurrency, no daily budgets, no client budget.

``ToolGate.admit`` answers a permit or a refusal; ``finish`` counts the call in the
tool's circuit and gives its slot back; ``record`` writes refusals to the routing
history, where ``busctl refusals``, the status, the dashboard and /metrics read them
beside the models'.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from agentbus.admission.admission import Admission, Permit
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Refusal
from agentbus.admission.routing import Candidate, Route
from agentbus.catalog import Catalog, ProviderConfig
from agentbus.catalog.model import AgentConfig, McpConfig
from agentbus.config import LiveConfig, Settings
from agentbus.db import Database
from agentbus.providers.outcomes import Failed, Outcome, Succeeded
from agentbus.queue.events import record_routes

PREFIX = "mcp:"  # of the provider, model and bulkhead of a tool, and of a client's agent
_V = TypeVar("_V")


class _ForEvery(Mapping[str, _V], Generic[_V]):
    """A mapping that has a value for every name, made by ``make`` (tools and clients
    are not listed in advance). Iterates over none: nothing enumerates them."""

    def __init__(self, make: Callable[[str], _V]) -> None:
        self._make = functools.lru_cache(maxsize=1024)(make)

    def __getitem__(self, name: str) -> _V:
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0


def tool_settings(settings: Settings, mcp: McpConfig) -> Settings:
    """The settings admission reads for tool calls: the circuit of ``[mcp]``, and none
    of the limits that count model calls."""
    return settings.replace(
        global_concurrency=0,
        daily_token_budget=0,
        daily_cost_budget=0,
        admission_wait_ms=0,  # the gateway waits for a slot itself, holding no thread
        circuit_consecutive_failures=mcp.circuit_consecutive_failures,
        circuit_min_calls=mcp.circuit_consecutive_failures,
        circuit_failure_rate=1.0,  # only failures in a row open a tool's circuit
        circuit_open_sec=mcp.circuit_open_sec,
    )


def tool_catalog(catalog: Catalog) -> Catalog:
    """The catalog admission reads for tool calls: a provider per tool, an agent with
    the client window per client, each tool's bulkhead beside the pools of [bulkheads]."""
    mcp = catalog.mcp
    client = AgentConfig(
        "mcp client", rate=mcp.client_rate or None, rate_window_sec=mcp.client_rate_window_sec
    )

    def provider(name: str) -> ProviderConfig:
        return ProviderConfig(name, "mcp")

    def bulkhead(name: str) -> int:
        if not name.startswith(PREFIX):
            return catalog.bulkheads[name]
        tool = mcp.tools.get(name[len(PREFIX) :])
        return tool.concurrency if tool and tool.concurrency else mcp.default_concurrency

    return Catalog(
        providers=_ForEvery(provider),
        agents=_ForEvery(lambda _: client),
        bulkheads=_ForEvery(bulkhead),
        mcp=mcp,
    )


class ToolView:
    """What admission reads as its config for tool calls: ``settings`` and ``catalog``
    derived from a process's live config, made again when it reloads (the same objects
    until then: admission keeps answers while they are)."""

    def __init__(self, live: LiveConfig) -> None:
        self.live = live
        self._lock = threading.Lock()
        self._from: tuple[object, object] = (None, None)
        self._view: tuple[Settings, Catalog] | None = None

    def _derived(self) -> tuple[Settings, Catalog]:
        settings, catalog = self.live.settings, self.live.catalog
        with self._lock:
            if self._view is None or self._from[0] is not settings or self._from[1] is not catalog:
                self._view = (tool_settings(settings, catalog.mcp), tool_catalog(catalog))
                self._from = (settings, catalog)
            return self._view

    @property
    def settings(self) -> Settings:
        return self._derived()[0]

    @property
    def catalog(self) -> Catalog:
        return self._derived()[1]


def candidate(tool: str, mcp: McpConfig) -> Candidate:
    """A tool as admission's candidate: the model of its own provider, in its bulkhead."""
    name = PREFIX + tool
    entry = mcp.tools.get(tool)
    pool = entry.bulkhead if entry is not None and entry.bulkhead else name
    return Candidate(name, name, "", tool, bulkhead=pool)


class ToolGate:
    """The admission of one MCP server process's ``tools/call``."""

    def __init__(self, db: Database, live: LiveConfig, *, holder: str) -> None:
        self.db = db
        self.live = live
        settings = live.settings
        cooldowns = CooldownStore.configured(db, settings)
        self.admission = Admission(
            db,
            ToolView(live),
            worker=holder,
            cooldowns=cooldowns,
            environ=None,
            cache_sec=settings.cooldown_cache_sec,
        )

    @property
    def mcp(self) -> McpConfig:
        return self.live.catalog.mcp

    def admit(self, tool: str, client: str) -> Permit | Refusal:
        """Leave for one call of ``tool`` by ``client`` now, or the refusal of the gate
        that admits last (the caller waits for a slot: ``agentbus.mcp``)."""
        self.live.refresh()
        c = candidate(tool, self.mcp)
        return self.admission.admit(c, agent=PREFIX + client, task_id=None)

    def finish(self, permit: Permit, *, failed: bool | None) -> None:
        """The call is over: give its slot back and count it in the tool's circuit
        (``failed`` None: it ended without an answer, a cancelled call)."""
        outcome: Outcome | None
        if failed is None:
            outcome = None
        elif failed:
            outcome = Failed(f"{permit.candidate.model}: the tool failed", retryable=True)
        else:
            outcome = Succeeded("")
        self.admission.finish(permit, outcome)

    def record(self, refused: list[tuple[str, str, Refusal]]) -> None:
        """Write refusals ((tool, client, refusal), …) to the routing history."""
        worker = self.admission.worker
        now = self.admission.clock()
        routes = [
            Route(
                0,
                0,
                PREFIX + client,
                PREFIX + tool,
                "refuse",
                now,
                worker=worker,
                provider=PREFIX + tool,
                code=refusal.code.value,
                retry_after=refusal.retry_after,
                gates=refusal.gates,
                refusal=refusal.as_dict(now),
            )
            for tool, client, refusal in refused
        ]
        self.db.write(lambda conn: record_routes(conn, routes), durable=False)
