"""An operator acts from the dashboard: clicks in Chromium (through chromedriver's
WebDriver protocol, plain HTTP) retry a task with the operator token, and are
refused without it."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from agentbus.db import Database
from agentbus.queue import TaskQueue, reads
from tests.conftest import IN_CI
from tests.support import Proc, free_port, wait_until
from tests.test_serve import seed

pytestmark = pytest.mark.process


class WebDriver:
    """The W3C WebDriver protocol over plain HTTP (Debian's chromedriver)."""

    def __init__(self, url: str, browser: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=60)
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        options = {"binary": browser, "args": args}
        capabilities = {"alwaysMatch": {"goog:chromeOptions": options}}
        reply = self.http.post("/session", json={"capabilities": capabilities}).json()
        self.session = f"/session/{reply['value']['sessionId']}"

    def call(self, path: str, body: dict[str, Any] | None = None) -> Any:
        reply = self.http.post(self.session + path, json=body or {}).json()
        return reply["value"]

    def find(self, css: str) -> str:
        found = self.call("/element", {"using": "css selector", "value": css})
        return str(next(iter(found.values())))

    def text(self, css: str) -> str:
        element = self.find(css)
        return str(self.http.get(f"{self.session}/element/{element}/text").json()["value"])

    def close(self) -> None:
        self.http.delete(self.session)
        self.http.close()


def test_an_operator_retries_a_task_from_the_dashboard_with_the_token_only(
    db_url: str, spawn: Callable[..., Proc]
) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        if IN_CI:
            pytest.fail("CI needs Debian's chromium and chromium-driver", pytrace=False)
        pytest.skip("no chromium-driver here: apt-get install chromium-driver")
    facts = seed(db_url)
    token = "an-operator-token-of-some-length"
    port, driver_port = free_port(), free_port()
    env = {"AGENTBUS_ADMIN_TOKEN": token}
    argv = [
        "--db",
        db_url,
        "serve",
        "--port",
        str(port),
        "--admin-token-env",
        "AGENTBUS_ADMIN_TOKEN",
    ]
    spawn("busctl", *argv, env=env)
    chromedriver = subprocess.Popen(
        [driver, f"--port={driver_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: _answers(f"http://127.0.0.1:{driver_port}/status"))
        wait_until(lambda: _answers(base + "/healthz"))
        web = WebDriver(f"http://127.0.0.1:{driver_port}", browser)
    except BaseException:
        chromedriver.kill()
        raise
    try:
        failed = facts["failed"]
        web.call("/url", {"url": f"{base}/#task-{failed}"})
        wait_until(lambda: "HTTP 400: the prompt is too long" in web.text("#detail-body"))
        web.call(f"/element/{web.find(f'#detail-body #retry-{failed}')}/click")  # no token yet
        wait_until(lambda: "refused (401)" in web.text("#acted"))
        still = Database(db_url)
        assert TaskQueue(still).get(failed).status == "failed"
        still.dispose()
        web.call(f"/element/{web.find('#token')}/value", {"text": token})
        web.call(f"/element/{web.find(f'#detail-body #retry-{failed}')}/click")
        wait_until(lambda: f"retry task {failed}: done" in web.text("#acted"))
        wait_until(lambda: f"{failed} · writer · queued" in web.text("#detail-id"))
        web.call("/url", {"url": f"{base}/#task-{facts['done']}"})  # what the answer said
        wait_until(lambda: "finish tool_calls" in web.text("#detail-body"))
        assert "30 + 12 tokens · tool calls: search" in web.text("#detail-body")
    finally:
        web.close()
        chromedriver.terminate()
        chromedriver.wait(30)
    db = Database(db_url)
    assert TaskQueue(db).get(failed).status == "queued"
    last = reads.task_events(db, failed)[-1]
    assert last["reason"] == "retry" and last["worker"].startswith("dashboard:")
    db.dispose()
    refused = httpx.post(f"{base}/tasks/{failed}/cancel", headers={"Authorization": "Bearer wrong"})
    assert refused.status_code == 401
    assert (
        httpx.post(
            f"{base}/tasks/{failed}/frobnicate", headers={"Authorization": f"Bearer {token}"}
        ).status_code
        == 404
    )


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.TransportError:
        return False
