"""agentbus: a durable job queue for fleets of LLM agents.

Producers (an orchestrator written in Python) use :class:`AgentBus`, or
:class:`AsyncAgentBus` from asyncio code::

    from agentbus import AgentBus, AsyncAgentBus

The services are ``agentbus.worker`` and ``agentbus.sweeper``; operators use
``agentbus.admin`` (``busctl``). Importing this package imports nothing heavy:
``AgentBus`` is loaded on first use, so the command-line tools start quickly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentbus.async_client import AsyncAgentBus
    from agentbus.client import AgentBus
    from agentbus.errors import WaitTimeout

__all__ = ["AgentBus", "AsyncAgentBus", "WaitTimeout"]


def __getattr__(name: str) -> Any:
    if name == "AsyncAgentBus":
        from agentbus import async_client

        return async_client.AsyncAgentBus
    if name == "WaitTimeout":
        from agentbus import errors

        return errors.WaitTimeout
    if name in __all__:
        from agentbus import client

        return getattr(client, name)
    raise AttributeError(f"module 'agentbus' has no attribute {name!r}")
