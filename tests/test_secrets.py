"""No secret in any output: CLI agents and HTTP endpoints that echo keys and the database
password leave no trace of them in logs, busctl output, tables or HTTP responses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import pytest
import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import metadata
from tests.support import Proc, wait_until

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]

HTTP_KEY = "sk-proj-HTTPKEY-must-not-leak-1234567890"
CLI_KEY = "cli-key-MUST-NOT-LEAK-0987654321"
DB_PASSWORD = "pg-pass-MUST-NOT-LEAK-77"

AGENT = """\
import os, sys
with open(sys.argv[1], "w") as env_out:
    env_out.write("\\n".join(sorted(os.environ)))
print(open(sys.argv[2]).read().strip(), file=sys.stderr)
sys.exit(1)
"""


class _Echoing(BaseHTTPRequestHandler):
    """An endpoint that refuses the key and echoes it (and a half of it) back."""

    def do_POST(self) -> None:
        key = self.headers["Authorization"].removeprefix("Bearer ")
        body = f"invalid api key {key}; did you mean {key[:20]}?".encode()
        self.send_response(401)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def endpoint() -> Iterator[int]:
    server = HTTPServer(("127.0.0.1", 0), _Echoing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_port
    server.shutdown()
    server.server_close()


def test_no_secret_reaches_logs_busctl_tables_or_http(
    db_url: str,
    backend: str,
    spawn: Spawn,
    run_busctl: Callable[..., subprocess.CompletedProcess[str]],
    endpoint: int,
    tmp_path: Path,
) -> None:
    url = db_url
    secrets = [HTTP_KEY, CLI_KEY]
    if backend == "postgresql":  # trust auth accepts any password: one in the URL
        url = sa.make_url(db_url).set(password=DB_PASSWORD).render_as_string(hide_password=False)
        secrets.append(DB_PASSWORD)
    agent, leak, env_seen = tmp_path / "agent.py", tmp_path / "leak.txt", tmp_path / "env.txt"
    agent.write_text(AGENT)
    # What a confused CLI agent prints: its key, another provider's, the database
    # password, and a key cut in the middle.
    leak.write_text(f"401 invalid api key {CLI_KEY} {HTTP_KEY} {url} {HTTP_KEY[:30]}")
    config = tmp_path / "agentbus.toml"
    config.write_text(
        f"""
[providers.http]
kind = "openai"
base_url = "http://127.0.0.1:{endpoint}/v1"
api_key_env = "HTTP_KEY"
[providers.cli]
kind = "command"
argv = [{json.dumps(sys.executable)}, {json.dumps(str(agent))},
        {json.dumps(str(env_seen))}, {json.dumps(str(leak))}]
exit_codes = {{ 1 = "auth" }}
[providers.cli.accounts.main]
key_env = "CLI_KEY"
[models."gpt-x"]
provider = "http"
[models."cli-model"]
provider = "cli"
"""
    )
    db = Database(db_url)
    queue = TaskQueue(db)
    ids = [
        queue.enqueue(TaskSpec(agent="codex", command="x", models=(model,))).id
        for model in ("gpt-x", "cli-model")
    ]
    env = {"HTTP_KEY": HTTP_KEY, "CLI_KEY": CLI_KEY, "AGENTBUS_DATABASE_URL": url}
    env["AGENTBUS_CONFIG"] = str(config)
    worker = spawn("worker", "--agent", "codex", "--drain", "--log-json", env=env)
    assert worker.wait() == 0, worker.text()
    assert [queue.get(i).status for i in ids] == ["failed", "failed"]
    assert "credential_refused" in worker.text()

    seen = set(env_seen.read_text().split())  # the CLI agent's environment
    assert "CLI_KEY" in seen and "PATH" in seen
    assert not seen & {"HTTP_KEY", "AGENTBUS_DATABASE_URL", "AGENTBUS_CONFIG"}

    outputs = [worker.text()]
    for args in (
        ["tasks", "--json"],
        ["show", str(ids[0]), "--json"],
        ["show", str(ids[1])],
        ["routes", "--json"],
        ["events"],
        ["status", "--json"],
        ["cooldowns"],
    ):
        done = run_busctl(*args, env=env)
        assert done.returncode == 0, done.stderr
        outputs += [done.stdout, done.stderr]
    serve = spawn("busctl", "serve", "--port", "0", env=env)
    address = wait_until(lambda: _served_at(serve.text()))
    for path in ("/", "/workspace/status", "/metrics"):
        outputs.append(httpx.get(f"{address}{path}").text)
    serve.signal(signal.SIGTERM)
    assert serve.wait(timeout=30) == 0
    outputs.append(serve.text())
    with db.engine.connect() as conn:
        for table in metadata.sorted_tables:
            outputs.append(repr(conn.execute(sa.select(table)).all()))
    db.dispose()

    everything = "\n".join(outputs)
    assert "invalid api key ***" in everything  # the lines are there, masked
    for secret in secrets:
        assert secret not in everything
    assert HTTP_KEY[:20] not in everything  # nor a part left by a cut


def _served_at(log: str) -> str | None:
    for line in log.splitlines():
        if "serving http://" in line:
            return line.split("serving ")[1].split("/ ")[0].rstrip("/")
    return None


def test_the_mask_function() -> None:
    from agentbus import masking

    masking.register(["a-registered-secret-value", "short"])
    assert masking.mask("x a-registered-secret-value y") == "x *** y"
    assert masking.mask("short words stay") == "short words stay"  # too short to be a secret
    assert masking.mask("cut sk-ant-api03-abcdefgh") == "cut sk-ant-***"
    assert masking.mask("Authorization: Bearer abcdefghijk123") == "Authorization: Bearer ***"
    assert masking.mask_value({"a": ["api_key=ABCDEFGH1234", 3]}) == {"a": ["api_key=***", 3]}
    assert masking.mask("risk-free task-12345678") == "risk-free task-12345678"
    assert os.environ.get("NOT_SET_ANYWHERE") is None


def test_a_text_seen_clean_is_masked_once_its_secret_is_registered() -> None:
    """Short texts that needed no masking are remembered; registering a secret forgets
    them, so a text seen before the secret was known is masked after."""
    from agentbus import masking

    text = "worker w-7f3a9c21e4 answered"
    assert masking.mask(text) == text
    assert masking.mask(text) == text  # now answered from the remembered clean texts
    masking.register(["w-7f3a9c21e4"])
    assert masking.mask(text) == "worker *** answered"
    long_text = "x" * 5000 + " w-7f3a9c21e4"
    assert masking.mask(long_text) == "x" * 5000 + " ***"
