"""What every provider takes and answers: a ``CallRequest`` in, an ``Outcome`` out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

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


class Provider(Protocol):
    def call(self, request: CallRequest) -> Outcome: ...
