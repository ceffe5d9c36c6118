"""A local model endpoint for tests: OpenAI's chat completions and Anthropic's messages.

Answers come from a script the test queues (status, headers, body); with the
script empty it answers ``then`` (a success by default). Every request and the
status it got are recorded, so a test can say what the endpoint really saw.
"""

from __future__ import annotations

import json
import threading
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

OPENAI_PATH = "/v1/chat/completions"
ANTHROPIC_PATH = "/v1/messages"


def openai_answer(
    text: str = "done", *, finish: str = "stop", tool_calls: list[Any] | None = None
) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7},
    }


def anthropic_answer(
    text: str = "done", *, stop: str = "end_turn", tool_use: list[Any] | None = None
) -> dict[str, Any]:
    blocks: list[Any] = [{"type": "text", "text": text}] if text else []
    blocks.extend(tool_use or ())
    return {
        "type": "message",
        "role": "assistant",
        "content": blocks,
        "stop_reason": stop,
        "usage": {"input_tokens": 13, "output_tokens": 5},
    }


@dataclass
class Answer:
    status: int = 200
    body: Any = None  # None: a success in the dialect of the path asked
    headers: Mapping[str, str] = field(default_factory=dict)


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: Any
    status: int = 0


class MockLLM:
    def __init__(self) -> None:
        self.script: deque[Answer] = deque()
        self.then = Answer()
        self.seen: list[Seen] = []
        self._lock = threading.Lock()
        mock = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length)
                seen = Seen(self.path, {k.lower(): v for k, v in self.headers.items()}, None)
                try:
                    seen.body = json.loads(raw)
                except ValueError:
                    seen.body = raw.decode(errors="replace")
                with mock._lock:
                    answer = mock.script.popleft() if mock.script else mock.then
                    seen.status = answer.status
                    mock.seen.append(seen)
                body = answer.body
                if body is None and answer.status == 200:
                    body = anthropic_answer() if self.path == ANTHROPIC_PATH else openai_answer()
                data = json.dumps(body if body is not None else {"error": "scripted"}).encode()
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in answer.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, args=(0.05,), daemon=True
        )
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    def queue(self, *answers: Answer) -> None:
        with self._lock:
            self.script.extend(answers)

    def statuses(self) -> list[int]:
        with self._lock:
            return [s.status for s in self.seen]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def mock_llm() -> Iterator[MockLLM]:
    server = MockLLM()
    yield server
    server.close()
