"""Model providers behind one small protocol: a ``CallRequest`` in, an ``Outcome`` out.

``simulated`` serves every ``sim/…`` model with scripted behaviour; ``openai``
speaks to any OpenAI-compatible chat-completions endpoint, ``anthropic`` to
Anthropic's Messages API (both on ``http``); ``command`` runs a CLI agent.
``chat`` says what a call sends (the task's system prompt, conversation and
parameters), ``ratelimits`` what an answer's headers say about the limits.
``outcomes`` is the one table of what a call can come to, and of
the names those outcomes go by. ``registry.Providers`` finds the provider of a
model. Each provider module is imported only when a model of its kind is called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentbus.providers.base import CallRequest, Provider
    from agentbus.providers.registry import Providers

__all__ = ["CallRequest", "Provider", "Providers"]


def __getattr__(name: str) -> Any:
    if name in ("CallRequest", "Provider"):
        from agentbus.providers import base

        return getattr(base, name)
    if name == "Providers":
        from agentbus.providers import registry

        return registry.Providers
    raise AttributeError(f"module 'agentbus.providers' has no attribute {name!r}")
