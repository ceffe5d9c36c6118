"""Any OpenAI-compatible chat-completions endpoint (``POST {base_url}/chat/completions``).

Sends the task's system prompt as the first message, its conversation and its
parameters; reads the text, the finish reason, the tool calls and the usage.
"""

from __future__ import annotations

from typing import Any

from agentbus.providers import CallRequest, chat
from agentbus.providers.http import HTTPProvider, tool_call
from agentbus.providers.outcomes import Succeeded, Usage


class OpenAIProvider(HTTPProvider):
    path = "/chat/completions"

    def headers(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {key}"}

    def body(self, request: CallRequest) -> dict[str, Any]:
        messages = chat.conversation(request.prompt, request.payload)
        system = chat.system_of(request.payload)
        if system is not None:
            messages.insert(0, {"role": "system", "content": system})
        return {**request.params, "model": request.upstream or request.model, "messages": messages}

    def answer(self, data: Any) -> Succeeded:
        choice = data["choices"][0]
        message = choice["message"]
        content = message.get("content")
        text = chat.joined_text(content) if isinstance(content, list) else content or ""
        calls = tuple(
            tool_call(c.get("id"), c["function"]["name"], c["function"].get("arguments"))
            for c in message.get("tool_calls") or ()
        )
        usage = data.get("usage") or {}
        return Succeeded(
            str(text),
            Usage(int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0))),
            finish_reason=choice.get("finish_reason"),
            tool_calls=calls,
        )
