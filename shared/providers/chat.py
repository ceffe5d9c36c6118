"""What a model call sends: the task's system prompt, its conversation and its parameters.

A task's payload may carry, besides anything a provider of its own reads::

    {"system": "You are terse.",
     "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}],
     "params": {"temperature": 0.2, "max_tokens": 400}}

The conversation a model gets is ``messages`` followed by the task text as the
last user turn; when ``messages`` already ends with a user turn it is sent as
it is (the task text is then only the task's title). ``params`` go to the
endpoint as they are, over the model's configured ``params`` (the task's win).
Every check here is pure: the queue runs it at enqueue, the catalog on a
model's defaults, and a provider on what it is about to send.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_MESSAGES = 10_000
#: Parameters agentbus itself sets: a task cannot override them.
RESERVED = ("model", "messages", "system", "stream")
#: What the well-known parameters must look like (others pass through unchecked).
_NUMBERS = {"temperature": (0.0, 2.0), "top_p": (0.0, 1.0)}
_COUNTS = ("max_tokens", "max_completion_tokens", "n", "seed")
#: The largest max_tokens, max_completion_tokens or n (a token window adds them up).
MAX_COUNT = 2**31 - 1
#: The max_tokens a provider kind sends when the params set none (the API requires one).
DEFAULT_MAX_TOKENS = {"anthropic": 4096}


class ChatError(ValueError):
    """A malformed system prompt, conversation or parameter (one readable line)."""


def check_payload(payload: Mapping[str, Any]) -> None:
    """Raise ChatError when the payload's ``system``, ``messages`` or ``params`` is malformed."""
    if "system" in payload and not _text(payload["system"]):
        raise ChatError("payload.system must be a non-empty string")
    if "messages" in payload:
        check_messages(payload["messages"])
    if "params" in payload:
        check_params(payload["params"], "payload.params")


def check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise ChatError("payload.messages must be a non-empty list of messages")
    if len(messages) > MAX_MESSAGES:
        raise ChatError(f"payload.messages has more than {MAX_MESSAGES:,} messages")
    for i, message in enumerate(messages):
        where = f"payload.messages[{i}]"
        if not isinstance(message, dict):
            raise ChatError(f"{where} must be an object with role and content")
        if message.get("role") not in ROLES:
            raise ChatError(f"{where}.role must be one of {', '.join(ROLES)}")
        content = message.get("content")
        has_calls = isinstance(message.get("tool_calls"), list) and message["tool_calls"]
        if content is None and not has_calls:
            raise ChatError(f"{where} has no content")
        if content is not None and not (
            isinstance(content, str) or (isinstance(content, list) and content)
        ):
            raise ChatError(f"{where}.content must be a string or a non-empty list of parts")


def check_params(params: Any, where: str) -> None:
    if not isinstance(params, dict):
        raise ChatError(f"{where} must be an object of parameters")
    for key, value in params.items():
        if key in RESERVED:
            raise ChatError(f"{where}.{key} is set by agentbus, not by a parameter")
        if key in _NUMBERS:
            low, high = _NUMBERS[key]
            if not _number(value) or not low <= value <= high:
                raise ChatError(f"{where}.{key} must be a number from {low:g} to {high:g}")
        elif key in _COUNTS and (isinstance(value, bool) or not isinstance(value, int)):
            raise ChatError(f"{where}.{key} must be a whole number")
        elif key in _COUNTS and key != "seed" and not 1 <= value <= MAX_COUNT:
            raise ChatError(f"{where}.{key} must be a whole number from 1 to {MAX_COUNT:,}")
        elif key == "stop" and not (
            _text(value) or (isinstance(value, list) and value and all(_text(s) for s in value))
        ):
            raise ChatError(f"{where}.stop must be a string or a list of strings")
        elif key == "response_format" and not isinstance(value, dict):
            raise ChatError(f"{where}.response_format must be an object")
        elif key == "tools" and not (
            isinstance(value, list) and all(isinstance(t, dict) for t in value)
        ):
            raise ChatError(f"{where}.tools must be a list of objects")
        elif key == "tool_choice" and not isinstance(value, (str, dict)):
            raise ChatError(f"{where}.tool_choice must be a string or an object")


def conversation(text: str, payload: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The turns to send: the payload's ``messages`` and the task text as the last user
    turn (unless ``messages`` already ends with one). Raises ChatError if malformed."""
    check_payload(payload)
    messages = [dict(m) for m in payload.get("messages") or ()]
    if not messages or messages[-1]["role"] != "user":
        messages.append({"role": "user", "content": text})
    given = inputs_text(payload)
    if given is not None:  # what the tasks it waited for came to, before the request
        messages.insert(len(messages) - 1, {"role": "user", "content": given})
    return messages


def inputs_text(payload: Mapping[str, Any]) -> str | None:
    """The results of the tasks a task waited for (``payload["inputs"]``, filled at claim:
    ``agentbus.queue.dependencies``) as one user turn; None when it waited for none."""
    inputs = payload.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        return None
    if not all(isinstance(i, dict) and {"task", "status", "result"} <= i.keys() for i in inputs):
        return None  # a payload's own "inputs", not the queue's
    parts = ["Results of the tasks this one waited for:"]
    for given in inputs:
        result = given["result"] if isinstance(given["result"], str) else "(no result)"
        parts.append(f"[task {given['task']}, {given['status']}]\n{result}")
    return "\n\n".join(parts)


def system_of(payload: Mapping[str, Any]) -> str | None:
    system = payload.get("system")
    return system if isinstance(system, str) else None


def params_for(defaults: Mapping[str, Any], payload: Mapping[str, Any]) -> dict[str, Any]:
    """The model's configured parameters with the task's over them."""
    own = payload.get("params")
    return {**defaults, **own} if isinstance(own, dict) else dict(defaults)


def joined_text(parts: Sequence[Any]) -> str:
    """The text of a list of content parts (``{"type": "text", "text": …}``)."""
    return "".join(
        p.get("text", "") for p in parts if isinstance(p, dict) and p.get("type") == "text"
    )


def _text(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)
