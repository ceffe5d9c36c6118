"""Providers map what a model answered to outcomes (no internet: mock transport, local scripts)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest

from agentbus.catalog import AccountConfig, ProviderConfig, parse_catalog
from agentbus.errors import InvalidTask
from agentbus.providers import CallRequest
from agentbus.providers.command import CommandProvider
from agentbus.providers.openai import OpenAIProvider
from agentbus.providers.outcomes import AuthFailed, Failed, RateLimited, Succeeded, TimedOut, Usage
from agentbus.providers.ratelimits import retry_after
from agentbus.providers.simulated import SimulatedProvider

KEY = "sk-test-5ecret-do-not-log"
CONFIG = ProviderConfig(
    "oai", "openai", base_url="http://llm.local/v1", accounts=(AccountConfig("default", "OAI_KEY"),)
)


def request(payload: dict[str, object] | None = None, model: str = "gpt") -> CallRequest:
    return CallRequest(
        task_id=7,
        model=model,
        prompt="hello there",
        worker="w",
        timeout_sec=5,
        created_at=1000.0,
        payload=payload or {},
    )


def openai(handler: object, key: str = KEY) -> OpenAIProvider:
    return OpenAIProvider(CONFIG, {"OAI_KEY": key}, transport=httpx.MockTransport(handler))


def test_openai_success_reports_text_and_usage() -> None:
    seen = {}

    def handler(req: httpx.Request) -> httpx.Response:
        seen["auth"] = req.headers["authorization"]
        seen["body"] = json.loads(req.content)
        return httpx.Response(
            200,
            json={
                "choices": [{"message": {"content": "hi!"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 2},
            },
        )

    assert openai(handler).call(request()) == Succeeded("hi!", Usage(3, 2))
    assert seen["auth"] == f"Bearer {KEY}"
    assert seen["body"]["messages"][0]["content"] == "hello there"


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (429, {"retry-after": "400"}, RateLimited),
        (529, {}, RateLimited),
        (503, {}, RateLimited),
        (408, {}, TimedOut),
        (401, {}, AuthFailed),
        (403, {}, AuthFailed),
        (400, {}, Failed),
        (404, {}, Failed),
        (500, {}, Failed),
    ],
)
def test_openai_status_mapping(status: int, headers: dict[str, str], expected: type) -> None:
    def handler(req: httpx.Request) -> httpx.Response:
        # A hostile server echoing our credentials back must not leak them.
        return httpx.Response(status, headers=headers, text=f"echo {req.headers['authorization']}")

    outcome = openai(handler).call(request())
    assert isinstance(outcome, expected)
    assert KEY not in repr(outcome)
    if status == 429:
        assert outcome == RateLimited(outcome.detail, retry_after_sec=400.0)  # type: ignore[union-attr]
    if status in (503, 529):
        assert outcome.overloaded  # type: ignore[union-attr]
    if isinstance(outcome, Failed):
        assert outcome.retryable == (status >= 500)


def test_openai_timeouts_connection_errors_and_missing_key() -> None:
    def slow(req: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("slow", request=req)

    def refused(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError(f"refused {KEY}", request=req)

    assert isinstance(openai(slow).call(request()), TimedOut)
    failed = openai(refused).call(request())
    assert isinstance(failed, Failed) and failed.retryable and KEY not in failed.detail
    missing = openai(slow, key="").call(request())
    assert missing == AuthFailed("$OAI_KEY is not set for provider oai")


def test_retry_after_forms() -> None:
    assert retry_after({"retry-after": "12"}) == 12.0
    assert retry_after({"retry-after-ms": "1500"}) == 1.5
    assert retry_after({"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}, now=1445412470.0) == 10.0
    assert retry_after({}) is None


def script(tmp_path: Path, body: str) -> tuple[str, ...]:
    path = tmp_path / "agent.py"
    path.write_text("import sys\n" + body)
    return (sys.executable, str(path))


def command(tmp_path: Path, body: str, **kw: object) -> CommandProvider:
    cat = parse_catalog(
        {"providers": {"cli": {"kind": "command", "argv": list(script(tmp_path, body)), **kw}}}
    )
    return CommandProvider(cat.providers["cli"], os.environ)


def test_command_provider(tmp_path: Path) -> None:
    echo = command(tmp_path, "print('answer:', sys.stdin.read())")
    assert echo.call(request()) == Succeeded("answer: hello there")
    limited = command(
        tmp_path,
        "sys.stderr.write('Error: 429 rate limit'); sys.exit(1)",
        stderr_patterns={"rate_limited": "rate limit"},
    )
    assert isinstance(limited.call(request()), RateLimited)
    coded = command(tmp_path, "sys.exit(75)", exit_codes={"75": "overloaded"})
    assert coded.call(request()) == RateLimited("cli: exit 75", overloaded=True)
    other = command(tmp_path, "sys.exit(3)")
    assert other.call(request()) == Failed("cli: exit 3", retryable=True)
    slow = command(tmp_path, "sys.stdin.read(); import signal; signal.pause()", timeout_sec=0.3)
    assert isinstance(slow.call(request()), TimedOut)
    cat = parse_catalog({"providers": {"cli": {"kind": "command", "argv": ["/no/such/bin"]}}})
    missing = CommandProvider(cat.providers["cli"], os.environ).call(request())
    assert isinstance(missing, Failed) and not missing.retryable


def test_simulated_behaviours_windows_and_journal(tmp_path: Path) -> None:
    journal = tmp_path / "journal.jsonl"
    now = [1010.0]
    sim = SimulatedProvider(journal=str(journal), clock=lambda: now[0])
    payload = {
        "simulate": {
            "sim/a": {"behaviour": "rate_limited", "for_s": 15, "retry_after_s": 5},
            "sim/b": "timeout",
        }
    }
    assert sim.call(request(payload, "sim/a")) == RateLimited(
        "simulated rate_limited from sim/a", retry_after_sec=5
    )
    assert isinstance(sim.call(request(payload, "sim/b")), TimedOut)
    assert isinstance(sim.call(request(payload, "sim/c")), Succeeded)
    told = {"simulate": {"sim/c": {"usage": {"prompt_tokens": 700}}}}
    answer = sim.call(request(told, "sim/c"))
    assert isinstance(answer, Succeeded) and answer.usage == Usage(700, 8)
    now[0] = 1015.0  # created at 1000 + 15 s: the window is over
    assert isinstance(sim.call(request(payload, "sim/a")), Succeeded)
    lines = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(e["model"], e["outcome"]) for e in lines] == [
        ("sim/a", "rate_limited"),
        ("sim/b", "timeout"),
        ("sim/c", "ok"),
        ("sim/c", "ok"),
        ("sim/a", "ok"),
    ]


@pytest.mark.parametrize(
    "payload",
    [
        {"simulate": "rate_limited"},
        {"simulate": {"sim/a": "explode"}},
        {"simulate": {"sim/a": {"behaviour": "ok", "for_s": -1}}},
        {"simulate": {"sim/a": {"behavior": "ok"}}},
        {"simulate": {"sim/a": {"usage": {"prompt_tokens": -1}}}},
        {"simulate": {"sim/a": {"usage": {"prompt_tokens": 2**40}}}},
        {"simulate": {"sim/a": {"usage": {"input": 3}}}},
    ],
)
def test_malformed_simulation_scripts(payload: dict[str, object]) -> None:
    with pytest.raises(InvalidTask, match=r"payload\.simulate"):
        SimulatedProvider().call(request(payload, "sim/a"))
