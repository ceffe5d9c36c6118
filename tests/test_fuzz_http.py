"""``busctl serve`` fed generated requests (hypothesis), byte for byte on a socket:
any method, path, headers and body, oversized ones among them, gets a 2xx, 3xx or 4xx,
never a 5xx while the database is up, and the server keeps serving."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentbus.admin import serve, status
from agentbus.config import Settings
from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from tests.fuzzing import FUZZ

TOKEN = "fuzz-operator-token"

ascii_text = st.text(st.characters(min_codepoint=33, max_codepoint=126), max_size=20)
methods = st.sampled_from(
    ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "CONNECT", "BREW"]
) | st.text(st.characters(min_codepoint=65, max_codepoint=90), min_size=1, max_size=8)
paths = st.one_of(
    st.sampled_from(
        [
            "/",
            "/index.html",
            "/metrics",
            "/workspace/status",
            "/healthz",
            "/tasks/1",
            "/tasks/1/retry",
            "/tasks/1/cancel",
            "/tasks/1/resume",
            "/tasks/99999999999999999999999999",
            "/tasks/\u00b2",
            "/tasks/\u0663",
            "*",
            "",
            "//",
            "/" + "a" * 70_000,
        ]
    ),
    st.builds(lambda a, b: f"/tasks/{a}/{b}", ascii_text, ascii_text),
    ascii_text.map(lambda p: "/" + p),
    st.text(max_size=20).map(lambda p: "/" + p),  # any character: sent as UTF-8
)
versions = st.sampled_from(["HTTP/1.1", "HTTP/1.0", "HTTP/2.0", "HTTP/0.9", "HTTPS/1.1", ""])
header_names = st.sampled_from(
    ["Host", "Content-Length", "Authorization", "Content-Type", "Transfer-Encoding", "Expect"]
) | ascii_text.filter(bool)
header_values = st.one_of(
    st.sampled_from(
        [
            "127.0.0.1",
            "evil.example",
            "[::1]:1",
            "-1",
            "99999999999999999999",
            "chunked",
            "100-continue",
            f"Bearer {TOKEN}",
            "Bearer wrong",
        ]
    ),
    ascii_text,
    st.text(max_size=10),
)
bodies = st.one_of(st.binary(max_size=200), st.just(b"x" * 1_100_000), st.just(b""))


@st.composite
def requests(draw: st.DrawFn) -> bytes:
    line = f"{draw(methods)} {draw(paths)} {draw(versions)}".rstrip()
    headers = draw(st.lists(st.tuples(header_names, header_values), max_size=5))
    lines = [line, *(f"{name}: {value}" for name, value in headers)]
    head = "\r\n".join(lines).encode("utf-8", errors="surrogateescape")
    return head + b"\r\n\r\n" + draw(bodies)


def status_of(port: int, request: bytes) -> int | None:
    """The status the server answers ``request`` with (None: it closed without one)."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        with contextlib.suppress(OSError):  # it answered and closed while the body went
            conn.sendall(request)
        answer = b""
        try:
            while b"\r\n" not in answer:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                answer += chunk
        except ConnectionResetError:
            pass
    first = answer.split(b"\r\n", 1)[0].split()
    return int(first[1]) if len(first) >= 2 and first[1].isdigit() else None


@pytest.fixture
def port(db: Database) -> Iterator[int]:
    settings = Settings()
    queue = TaskQueue(db)
    queue.enqueue(TaskSpec(agent="codex", command="t", models=("sim/a",)))

    def act(action: str, task_id: int) -> bool:
        if action == "cancel":
            return bool(queue.cancel([task_id], by="fuzz"))
        if action == "resume":
            return bool(queue.resume([task_id], by="fuzz"))
        queue.retry(task_id, by="fuzz")
        return True

    def task(task_id: int) -> dict[str, object] | None:
        from agentbus.errors import TaskNotFound
        from agentbus.queue import reads

        try:
            return {"task": reads.get_task(db, task_id).as_dict()}
        except TaskNotFound:
            return None

    server = serve.make_server(
        "127.0.0.1",
        0,
        lambda kpis: status.snapshot(db, settings, kpis=kpis),
        task=task,
        act=act,
        token=TOKEN,
        timeout=5,
    )
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def test_any_request_gets_no_server_error(port: int) -> None:
    @FUZZ
    @given(requests())
    def check(request: bytes) -> None:
        code = status_of(port, request)
        assert code is None or code < 500, (request[:200], code)
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=10).status_code == 200

    check()
