"""Your own Python function as a model (``kind = "python"``): agents written against the
real openai and anthropic SDKs, whose errors (a 429 with its retry-after, a 529, a
timeout) count as the same answers from agentbus's own HTTP providers would."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anthropic
import openai
import pytest

from agentbus import errors
from agentbus.catalog import ProviderConfig
from agentbus.client import AgentBus
from agentbus.errors import ConfigError
from agentbus.providers import CallRequest
from agentbus.providers.outcomes import AuthFailed, Failed, RateLimited, Succeeded, TimedOut
from agentbus.providers.python import HandlerCrashed, PythonProvider, load, outcome_of
from tests.mock_llm import Answer, MockLLM, anthropic_answer, openai_answer
from tests.support import Proc

Spawn = Callable[..., Proc]

#: The agent code of the tests: a module on the worker's PYTHONPATH.
AGENT_CODE = """
import asyncio
import os

import anthropic
import openai

from agentbus import errors

STUB = os.environ.get("STUB_URL", "http://127.0.0.1:9")
client = openai.OpenAI(base_url=STUB + "/v1", api_key="sk-test-123456", max_retries=0)
claude = anthropic.AsyncAnthropic(base_url=STUB, api_key="sk-ant-test-123456", max_retries=0)


def ask_openai(request):
    system = [{"role": "system", "content": request.system}] if request.system else []
    reply = client.chat.completions.create(
        model=request.upstream, messages=system + request.messages, **request.params
    )
    return reply.choices[0].message.content


async def ask_claude(request):
    reply = await claude.messages.create(
        model=request.upstream, max_tokens=100, system=request.system or "",
        messages=request.messages,
    )
    return {"text": reply.content[0].text, "task": request.task_id}


def crash(request):
    raise KeyError("no tide table for sk-test-123456")


def slow_down(request):
    raise errors.RateLimited("the agent's own limit", retry_after=600)


def give_up(request):
    raise errors.Permanent("this prompt cannot be answered")


def a_set(request):
    return {"a set": {1, 2}}


async def forever(request):
    await asyncio.Event().wait()


def with_a_judge(request):
    with request.permit("judge") as p:  # the judge's call, under the shared admission
        verdict = "fair"
    return f"{request.prompt}: {verdict} ({p.model})"


def nothing(request):
    return None


def quits(request):
    raise SystemExit(3)


def no_arguments():
    return "never"


not_callable = 42
"""


def request(**more: Any) -> CallRequest:
    base: dict[str, Any] = {
        "task_id": 7,
        "model": "mine",
        "upstream": "gpt-4o-mini",
        "prompt": "When is high tide?",
        "worker": "w",
        "timeout_sec": 5.0,
        "payload": {"system": "You are a harbour pilot."},
    }
    return CallRequest(**{**base, **more})


@pytest.fixture
def agent_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    (tmp_path / "tide_agent.py").write_text(AGENT_CODE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    import sys

    sys.modules.pop("tide_agent", None)


def provider(target: str, **more: Any) -> PythonProvider:
    return PythonProvider(ProviderConfig("mine", "python", target=target, **more), {})


def test_the_sdks_own_errors_count_as_the_same_answers_over_http(mock_llm: MockLLM) -> None:
    client = openai.OpenAI(base_url=mock_llm.url + "/v1", api_key="sk-x", max_retries=0)

    def raised(status: int, headers: dict[str, str] | None = None) -> BaseException:
        mock_llm.queue(Answer(status, {"error": {"message": "scripted"}}, headers or {}))
        with pytest.raises(openai.APIError) as caught:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
        return caught.value

    limited = outcome_of(raised(429, {"retry-after": "300"}), "mine")
    assert isinstance(limited, RateLimited) and limited.retry_after_sec == 300
    assert not limited.overloaded
    busy = outcome_of(raised(503, {"retry-after-ms": "1500"}), "mine")
    assert isinstance(busy, RateLimited) and busy.overloaded and busy.retry_after_sec == 1.5
    assert isinstance(outcome_of(raised(401), "mine"), AuthFailed)
    assert isinstance(outcome_of(raised(408), "mine"), TimedOut)
    assert outcome_of(raised(500), "mine") == Failed(
        "mine: InternalServerError: Error code: 500 - scripted", retryable=True
    )
    bad = outcome_of(raised(400), "mine")
    assert isinstance(bad, Failed) and not bad.retryable
    # A 200 whose headers say nothing is left is the provider's to read: not an error here.
    claude = anthropic.Anthropic(base_url=mock_llm.url, api_key="sk-ant-x", max_retries=0)
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    mock_llm.queue(Answer(529, overloaded, {"retry-after": "600"}))
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.create(model="m", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    said = outcome_of(caught.value, "mine")
    assert isinstance(said, RateLimited) and said.overloaded and said.retry_after_sec == 600


def test_timeouts_and_lost_connections_of_the_sdks() -> None:
    with contextlib.closing(socket.socket()) as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=0.3
        )
        with pytest.raises(openai.APITimeoutError) as caught:
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert isinstance(outcome_of(caught.value, "mine"), TimedOut)
    closed = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0)
    with pytest.raises(openai.APIConnectionError) as refused:
        closed.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    lost = outcome_of(refused.value, "mine")
    assert isinstance(lost, Failed) and lost.retryable
    assert isinstance(outcome_of(TimeoutError("slow"), "mine"), TimedOut)
    assert isinstance(outcome_of(ConnectionResetError("reset"), "mine"), Failed)
    assert outcome_of(KeyError("a bug"), "mine") is None


def test_what_the_agent_says_itself() -> None:
    limited = outcome_of(errors.RateLimited("mine", retry_after=120), "mine")
    assert isinstance(limited, RateLimited) and limited.retry_after_sec == 120
    busy = outcome_of(errors.Overloaded("busy"), "mine")
    assert isinstance(busy, RateLimited) and busy.overloaded and busy.retry_after_sec is None
    assert outcome_of(errors.Retryable("again"), "mine") == Failed(
        "mine: Retryable: again", retryable=True
    )
    assert outcome_of(errors.Permanent("never"), "mine") == Failed(
        "mine: Permanent: never", retryable=False
    )


def test_a_handler_gets_the_request_and_its_conversation(
    agent_code: Path, mock_llm: MockLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("STUB_URL", mock_llm.url)
    import importlib

    importlib.reload(importlib.import_module("tide_agent"))
    mock_llm.queue(Answer(body=openai_answer("At 14:02.")))
    sync = provider("tide_agent:ask_openai")
    assert sync.call(request(params={"temperature": 0.3})) == Succeeded("At 14:02.")
    (seen,) = mock_llm.seen
    assert seen.body == {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are a harbour pilot."},
            {"role": "user", "content": "When is high tide?"},
        ],
        "temperature": 0.3,
    }
    mock_llm.queue(Answer(body=anthropic_answer("Fair winds.")))
    asynchronous = provider("tide_agent:ask_claude")
    try:
        answered = asynchronous.call(request(upstream="claude-x"))
        assert answered == Succeeded('{"text": "Fair winds.", "task": 7}')
        assert mock_llm.seen[-1].body["system"] == "You are a harbour pilot."
        assert mock_llm.seen[-1].body["messages"] == [
            {"role": "user", "content": "When is high tide?"}
        ]
    finally:
        asynchronous.close()


def test_a_crash_a_wrong_answer_and_a_call_that_outlasts_its_time(agent_code: Path) -> None:
    with pytest.raises(HandlerCrashed) as crashed:
        provider("tide_agent:crash").call(request())
    assert crashed.value.message.startswith("KeyError: 'no tide table for sk-")
    assert "123456" not in crashed.value.message  # masked
    with pytest.raises(HandlerCrashed, match="returned a dict JSON cannot write"):
        provider("tide_agent:a_set").call(request())
    slow = provider("tide_agent:forever", timeout_sec=0.2)
    try:
        assert isinstance(slow.call(request()), TimedOut)
    finally:
        slow.close()
    with pytest.raises(HandlerCrashed, match="SystemExit: 3"):  # ends the call, not the worker
        provider("tide_agent:quits").call(request())
    with pytest.raises(HandlerCrashed, match="returned NoneType, not a string or a dict"):
        provider("tide_agent:nothing").call(request())


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("tide_agent", "target must look like package.module:function"),
        ("no_such_agent:run", "does not import: ModuleNotFoundError"),
        ("tide_agent:nothing_here", "tide_agent has no nothing_here"),
        ("tide_agent:not_callable", "is not callable"),
        ("tide_agent:no_arguments", "must take one argument, the request"),
    ],
)
def test_a_target_that_cannot_be_called_is_a_configuration_error(
    agent_code: Path, target: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=said):
        load(target, "[providers.mine]")


def python_config(tmp_path: Path, models: dict[str, str]) -> str:
    """A config whose model ``name`` calls ``tide_agent:function``, for each pair."""
    parts = []
    for model, function in models.items():
        parts.append(
            f'[providers.{model}]\nkind = "python"\ntarget = "tide_agent:{function}"\n'
            f'[models.{model}]\nprovider = "{model}"\nname = "upstream-{model}"\n'
        )
    path = tmp_path / "agentbus.toml"
    path.write_text("\n".join(parts))
    return str(path)


@pytest.mark.process
def test_an_agent_on_the_openai_sdk_runs_and_its_429_pauses_the_task(
    db_url: str, spawn: Spawn, mock_llm: MockLLM, agent_code: Path, tmp_path: Path
) -> None:
    """The done-when of python models: an agent written against the real openai SDK
    answers, then meets a 429 with retry-after 300: the task pauses for those 300 s
    (longer than model_cooldown_sec) and spends no attempt. Its own code's crash, and
    a rate limit it says itself, are told apart the same way, and the worker goes on."""
    config = python_config(
        tmp_path,
        {"pilot": "ask_openai", "claude": "ask_claude", "broken": "crash", "own": "slow_down"},
    )
    env = {
        "AGENTBUS_DATABASE_URL": db_url,
        "AGENTBUS_CONFIG": config,
        "PYTHONPATH": str(agent_code),
        "STUB_URL": mock_llm.url,
    }
    mock_llm.queue(
        Answer(body=openai_answer("At 14:02.")),
        Answer(body=anthropic_answer("Fair winds.")),
        Answer(429, {"error": {"message": "Rate limit reached"}}, {"retry-after": "300"}),
    )
    with AgentBus(db_url) as bus:
        answered = bus.enqueue("codex", "When is high tide?", models=["pilot"])
        claude = bus.enqueue("codex", "Say goodbye", models=["claude"])
        limited = bus.enqueue("codex", "Again?", models=["pilot"])
        crashed = bus.enqueue("codex", "x", models=["broken"])
        own = bus.enqueue("codex", "y", models=["own"])
        worker = spawn("worker", "--agent", "codex", "--drain", env=env)
        assert worker.wait() == 0, worker.text()
        tasks = {
            name: bus.get(t)
            for name, t in [
                ("answered", answered),
                ("claude", claude),
                ("limited", limited),
                ("crashed", crashed),
                ("own", own),
            ]
        }
    assert (tasks["answered"].status, tasks["answered"].result) == ("done", "At 14:02.")
    assert mock_llm.seen[0].body["model"] == "upstream-pilot"
    assert (tasks["claude"].status, tasks["claude"].result) == (
        "done",
        f'{{"text": "Fair winds.", "task": {claude}}}',
    )
    paused = tasks["limited"]
    assert (paused.status, paused.attempts) == ("paused", 0)
    assert paused.resume_after is not None and paused.paused_at is not None
    assert 298 <= paused.resume_after - paused.paused_at <= 301
    error = tasks["crashed"]
    assert error.status == "error"
    assert error.last_error is not None and "KeyError: 'no tide table for sk-" in error.last_error
    assert "123456" not in error.last_error and "123456" not in worker.text()
    assert "Traceback" not in worker.text()
    mine = tasks["own"]
    assert (mine.status, mine.attempts) == ("paused", 0)
    assert mine.resume_after is not None and mine.paused_at is not None
    assert 598 <= mine.resume_after - mine.paused_at <= 601  # longer than the 180 s default


@pytest.mark.process
@pytest.mark.parametrize(
    ("function", "said"),
    [
        ("not_there", "tide_agent has no not_there"),
        ("not_callable", "is not callable"),
        ("no_arguments", "must take one argument, the request"),
    ],
)
def test_a_python_model_that_cannot_be_called_stops_the_worker_at_start(
    db_url: str, spawn: Spawn, agent_code: Path, tmp_path: Path, function: str, said: str
) -> None:
    config = python_config(tmp_path, {"pilot": function})
    env = {"AGENTBUS_DATABASE_URL": db_url, "AGENTBUS_CONFIG": config}
    env["PYTHONPATH"] = str(agent_code)
    with AgentBus(db_url) as bus:
        task = bus.enqueue("codex", "x", models=["pilot"])
        worker = spawn("worker", "--agent", "codex", "--drain", env=env)
        assert worker.wait() == 2
        lines = worker.text().strip().splitlines()
        assert len(lines) == 1 and said in lines[0] and "[providers.pilot]" in lines[0], lines
        after = bus.get(task)
    assert (after.status, after.attempts) == ("queued", 0)


def test_the_docs_example_runs(
    mock_llm: MockLLM, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docs/python-models.md: its config and its module, called as the worker would."""
    import re
    import sys
    import tomllib

    from agentbus.catalog import parse_catalog

    text = (Path(__file__).parents[1] / "docs/python-models.md").read_text()
    toml_block, python_block = re.findall(r"```(?:toml|python)\n(.*?)```", text, re.S)[:2]
    (tmp_path / "tide_agent.py").write_text(python_block)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("OPENAI_BASE_URL", mock_llm.url + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-docs-example")
    catalog = parse_catalog(tomllib.loads(toml_block))
    mock_llm.queue(Answer(body=openai_answer("At 14:02.")))
    try:
        model = catalog.model("pilot")
        made = PythonProvider(catalog.providers[model.provider], {})
        answered = made.call(request(upstream=model.upstream, params=dict(model.params)))
    finally:
        sys.modules.pop("tide_agent", None)
    assert answered == Succeeded("At 14:02.")
    assert mock_llm.seen[0].body["model"] == "gpt-4o-mini"
    assert mock_llm.seen[0].body["temperature"] == 0.2


@pytest.mark.process
def test_a_handlers_own_call_takes_a_permit_and_a_refused_one_pauses_the_task(
    db_url: str, spawn: Spawn, agent_code: Path, tmp_path: Path
) -> None:
    """Inside a python model, ``request.permit(model)`` admits the handler's own call
    (here a judge model allowed 1 call a minute): the first task's judge call passes,
    the second's is refused, and its task pauses until the window frees, no attempt
    spent."""
    config = python_config(tmp_path, {"pilot": "with_a_judge"})
    with open(config, "a") as more:
        more.write('\n[providers.judges]\nkind = "simulated"\nrpm = 1\n')
        more.write('[models.judge]\nprovider = "judges"\n')
    env = {"AGENTBUS_DATABASE_URL": db_url, "AGENTBUS_CONFIG": config}
    env["PYTHONPATH"] = str(agent_code)
    with AgentBus(db_url) as bus:
        first = bus.enqueue("codex", "Rate this", models=["pilot"])
        second = bus.enqueue("codex", "And this", models=["pilot"])
        worker = spawn("worker", "--agent", "codex", "--drain", env=env)
        assert worker.wait() == 0, worker.text()
        done, paused = bus.get(first), bus.get(second)
    assert (done.status, done.result) == ("done", "Rate this: fair (judge)")
    assert (paused.status, paused.attempts) == ("paused", 0)
    assert paused.resume_after is not None and paused.paused_at is not None
    assert 0 < paused.resume_after - paused.paused_at <= 61
    assert "candidate_refused" in worker.text() and "Traceback" not in worker.text()
