"""Anthropic's Messages API (``POST {base_url}/v1/messages``), over httpx.

The key goes in ``x-api-key``, the API version in ``anthropic-version`` (the
provider's ``anthropic_version``). A task's conversation is written in the
OpenAI shape and translated: system turns join the top-level ``system``, a
``tool`` turn becomes a user turn carrying a ``tool_result`` block, an assistant
turn's ``tool_calls`` become ``tool_use`` blocks; content given as a list of
blocks goes as it is. ``stop`` is sent as ``stop_sequences``; ``max_tokens``,
which the API requires, defaults to ``DEFAULT_MAX_TOKENS``. An overloaded API
answers 529: the model cools down for its ``retry-after``.
"""

from __future__ import annotations

import json
from typing import Any

from agentbus.providers import CallRequest, chat
from agentbus.providers.http import HTTPProvider, tool_call
from agentbus.providers.outcomes import Succeeded, Usage

DEFAULT_MAX_TOKENS = chat.DEFAULT_MAX_TOKENS["anthropic"]


class AnthropicProvider(HTTPProvider):
    path = "/v1/messages"

    def headers(self, key: str) -> dict[str, str]:
        return {"x-api-key": key, "anthropic-version": self.config.anthropic_version}

    def body(self, request: CallRequest) -> dict[str, Any]:
        turns = chat.conversation(request.prompt, request.payload)
        system = [chat.system_of(request.payload) or ""]
        messages = []
        for turn in turns:
            if turn["role"] in ("system", "developer"):
                content = turn["content"]
                system.append(content if isinstance(content, str) else chat.joined_text(content))
            else:
                messages.append(_message(turn))
        params = dict(request.params)
        if "stop" in params:
            stop = params.pop("stop")
            params["stop_sequences"] = [stop] if isinstance(stop, str) else stop
        params.setdefault("max_tokens", DEFAULT_MAX_TOKENS)
        body = {**params, "model": request.upstream or request.model, "messages": messages}
        joined = "\n\n".join(s for s in system if s)
        if joined:
            body["system"] = joined
        return body

    def answer(self, data: Any) -> Succeeded:
        blocks = data["content"]
        text = "".join(b["text"] for b in blocks if b.get("type") == "text")
        calls = tuple(
            tool_call(b.get("id"), b["name"], b.get("input"))
            for b in blocks
            if b.get("type") == "tool_use"
        )
        usage = data.get("usage") or {}
        # Every input token the call processed, cached or not, counts against budgets.
        prompt = sum(
            int(usage.get(k) or 0)
            for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        )
        return Succeeded(
            text,
            Usage(prompt, int(usage.get("output_tokens", 0))),
            finish_reason=data.get("stop_reason"),
            tool_calls=calls,
        )


def _message(turn: dict[str, Any]) -> dict[str, Any]:
    """One OpenAI-shaped turn as a Messages API message."""
    role, content = turn["role"], turn.get("content")
    if role == "tool":
        result = {
            "type": "tool_result",
            "tool_use_id": turn.get("tool_call_id"),
            "content": content,
        }
        return {"role": "user", "content": [result]}
    calls = turn.get("tool_calls") or []
    if role == "assistant" and calls:
        blocks: list[Any] = []
        if isinstance(content, list):
            blocks.extend(content)
        elif content:
            blocks.append({"type": "text", "text": content})
        for call in calls:
            function = call.get("function") or call  # OpenAI's shape or agentbus's own
            arguments = function.get("arguments", function.get("input"))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = {"input": arguments}
            blocks.append(
                {
                    "type": "tool_use",
                    "id": call.get("id"),
                    "name": function.get("name"),
                    "input": arguments if arguments is not None else {},
                }
            )
        return {"role": "assistant", "content": blocks}
    return {"role": role, "content": content}
