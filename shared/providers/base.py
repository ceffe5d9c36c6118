"""What every provider takes and answers: a ``CallRequest`` in, an ``Outcome`` out."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentbus.errors import BusError
from agentbus.providers.outcomes import Outcome


@dataclass(frozen=True)
class CallRequest:
    task_id: int
    model: str
    prompt: str
    worker: str
    timeout_sec: float
    created_at: float | None = None
    upstream: str | None = None  # the provider's name for the model, when it differs
    account: str = ""  # the provider account the call goes through ("" when unnamed)
    payload: Mapping[str, Any] = field(default_factory=dict)
    params: Mapping[str, Any] = field(default_factory=dict)  # the model's defaults + the task's
    #: ``permit(model, tokens=None)``: leave for a call of the handler's own (a python
    #: model's), under the worker's admission, as ``AgentBus.permit``; None where the
    #: worker gives none.
    permit: Callable[..., AbstractContextManager[Any]] | None = field(
        default=None, compare=False, repr=False
    )

    @functools.cached_property
    def system(self) -> str | None:
        """The task's system prompt (``payload["system"]``), if any."""
        from agentbus.providers import chat

        return chat.system_of(self.payload)

    @functools.cached_property
    def messages(self) -> list[dict[str, Any]]:
        """The conversation, the task text its last user turn (``chat.conversation``)."""
        from agentbus.providers import chat

        return chat.conversation(self.prompt, self.payload)


class HandlerCrashed(BusError):
    """Code of the user's own, called as a model, raised what no outcome stands for or
    returned what is no answer: the task ends in ``error`` with this message."""


class Provider(Protocol):
    def call(self, request: CallRequest) -> Outcome: ...
