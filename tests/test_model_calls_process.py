"""Real workers against a local model endpoint, on both databases: a task's
conversation and the answer's detail end to end, Anthropic's 529, and a cooldown
learnt from rate-limit headers before any 429."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.client import AgentBus
from agentbus.db import Database
from agentbus.schema import bus_commands, model_cooldown, route_log, usage_daily
from tests.mock_llm import Answer, MockLLM, anthropic_answer, openai_answer
from tests.support import Proc

pytestmark = pytest.mark.process
Spawn = Callable[..., Proc]
Busctl = Callable[..., subprocess.CompletedProcess[str]]


def config_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "agentbus.toml"
    path.write_text(text)
    return str(path)


def openai_config(tmp_path: Path, mock: MockLLM, more: str = "") -> str:
    """A config with model ``gpt`` on the mock's OpenAI-compatible endpoint (key $OAI_KEY)."""
    head = f"""
[providers.oai]
kind = "openai"
base_url = "{mock.url}/v1"
api_key_env = "OAI_KEY"
[models.gpt]
provider = "oai"
"""
    return config_file(tmp_path, head + more)


def rows(db_url: str, query: Any) -> list[Any]:
    db = Database(db_url)
    try:
        with db.engine.connect() as conn:
            return list(conn.execute(query).mappings())
    finally:
        db.dispose()


def test_a_conversation_with_params_runs_and_its_answer_detail_is_kept(
    db_url: str, spawn: Spawn, run_busctl: Busctl, mock_llm: MockLLM, tmp_path: Path
) -> None:
    config = openai_config(
        tmp_path,
        mock_llm,
        """name = "gpt-4o-mini"
params = { temperature = 0.2, max_tokens = 300 }
[agents.codex]
models = ["gpt"]
""",
    )
    env = {"AGENTBUS_DATABASE_URL": db_url, "AGENTBUS_CONFIG": config, "OAI_KEY": "sk-x"}
    call = {"id": "call_9", "type": "function"}
    call["function"] = {"name": "search", "arguments": '{"q": "tides"}'}  # type: ignore[assignment]
    mock_llm.queue(Answer(body=openai_answer("", finish="tool_calls", tool_calls=[call])))

    bad = run_busctl(
        "enqueue", "--agent", "codex", "--payload", '{"params": {"temperature": 5}}', "x", env=env
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().splitlines() == [
        "busctl: error: payload.params.temperature must be a number from 0 to 2"
    ]
    payload = {
        "system": "You are a harbour pilot.",
        "messages": [
            {"role": "user", "content": "When is high tide?"},
            {"role": "assistant", "content": "Which port?"},
        ],
        "params": {"temperature": 0.9, "tools": [{"type": "function", "function": {"name": "s"}}]},
    }
    added = run_busctl(
        "enqueue", "--agent", "codex", "--payload", json.dumps(payload), "Busan", env=env
    )
    assert added.returncode == 0, added.stderr
    task_id = int(added.stdout.split()[-1])
    assert len(rows(db_url, sa.select(bus_commands.c.id))) == 1  # the bad one wrote nothing

    worker = spawn("worker", "--agent", "codex", "--drain", env=env)
    assert worker.wait() == 0, worker.text()

    (seen,) = mock_llm.seen
    assert seen.body == {
        "model": "gpt-4o-mini",
        "messages": [
            {"role": "system", "content": "You are a harbour pilot."},
            *payload["messages"],  # type: ignore[misc]
            {"role": "user", "content": "Busan"},
        ],
        "temperature": 0.9,  # the task's, over the model's 0.2
        "max_tokens": 300,
        "tools": payload["params"]["tools"],  # type: ignore[index]
    }
    expected = {
        "model": "gpt",
        "finish_reason": "tool_calls",
        "tool_calls": [{"id": "call_9", "name": "search", "arguments": {"q": "tides"}}],
        "usage": {"prompt_tokens": 11, "completion_tokens": 7},
    }
    bus = AgentBus(db_url)
    try:
        task = bus.get(task_id)
    finally:
        bus.close()
    assert (task.status, task.result, task.result_detail) == ("done", "", expected)
    shown = run_busctl("show", str(task_id), "--json", env=env)
    assert json.loads(shown.stdout)["task"]["result_detail"] == expected
    text = run_busctl("show", str(task_id), env=env).stdout
    assert "finish reason: tool_calls" in text
    assert 'tool call: search {"q": "tides"}' in text
    assert "usage: 11 prompt + 7 completion tokens" in text


def test_anthropic_usage_a_529_with_retry_after_and_the_next_candidate(
    db_url: str, spawn: Spawn, mock_llm: MockLLM, tmp_path: Path
) -> None:
    config = config_file(
        tmp_path,
        f"""
[providers.claude]
kind = "anthropic"
base_url = "{mock_llm.url}"
api_key_env = "ANT_KEY"
[models.sonnet]
provider = "claude"
name = "claude-sonnet-4-5"
params = {{ max_tokens = 1000 }}
""",
    )
    env = {"AGENTBUS_DATABASE_URL": db_url, "AGENTBUS_CONFIG": config, "ANT_KEY": "sk-ant-x"}
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    mock_llm.queue(
        Answer(body=anthropic_answer("Fair winds.")),
        Answer(529, overloaded, {"retry-after": "600"}),
    )
    bus = AgentBus(db_url)
    try:
        first = bus.enqueue("codex", "Say goodbye", models=["sonnet"])
        paused = bus.enqueue("codex", "Again", models=["sonnet"])
        backup = bus.enqueue("codex", "Once more", models=["sonnet", "sim/backup"])
        worker = spawn("worker", "--agent", "codex", "--drain", env=env)
        assert worker.wait() == 0, worker.text()
        done, waiting, served = bus.get(first), bus.get(paused), bus.get(backup)
    finally:
        bus.close()

    assert [s.headers["x-api-key"] for s in mock_llm.seen] == ["sk-ant-x", "sk-ant-x"]
    assert mock_llm.seen[0].body["max_tokens"] == 1000
    assert (done.status, done.result, done.result_detail) == (
        "done",
        "Fair winds.",
        {
            "model": "sonnet",
            "finish_reason": "end_turn",
            "usage": {"prompt_tokens": 13, "completion_tokens": 5},
        },
    )
    # 529: overloaded; the model cools for the provider's 600 s (longer than the default 180 s).
    assert waiting.status == "paused"
    assert waiting.resume_after is not None and waiting.paused_at is not None
    assert 598 <= waiting.resume_after - waiting.paused_at <= 601
    (cooling,) = rows(db_url, sa.select(model_cooldown))
    assert (cooling["model_id"], cooling["reason"]) == ("sonnet", "overloaded")
    # The third task skips the cooling model without a call and completes on the next one.
    assert (served.status, served.result_detail["model"]) == ("done", "sim/backup")  # type: ignore[index]
    assert mock_llm.statuses() == [200, 529]
    (ledger,) = rows(db_url, sa.select(usage_daily).where(usage_daily.c.model == "sonnet"))
    assert (ledger["calls"], ledger["prompt_tokens"], ledger["completion_tokens"]) == (
        2,
        13,
        5,
    )  # two calls made, one answered


def test_a_cooldown_learnt_from_headers_spares_the_next_worker_its_429(
    db_url: str, spawn: Spawn, run_busctl: Busctl, mock_llm: MockLLM, tmp_path: Path
) -> None:
    config = openai_config(tmp_path, mock_llm)
    env = {"AGENTBUS_DATABASE_URL": db_url, "AGENTBUS_CONFIG": config, "OAI_KEY": "sk-x"}
    spent = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "6m0s"}
    mock_llm.queue(Answer(200, None, spent))
    mock_llm.then = Answer(
        429, {"error": "rate limit"}, {"retry-after": "360"}
    )  # what it would say

    bus = AgentBus(db_url)
    try:
        first = bus.enqueue("alpha", "first", models=["gpt"])
        one = spawn("worker", "--agent", "alpha", "--drain", env=env)
        assert one.wait() == 0, one.text()
        second = bus.enqueue("beta", "second", models=["gpt"])
        two = spawn("worker", "--agent", "beta", "--drain", env=env)
        assert two.wait() == 0, two.text()
        done, waiting = bus.get(first), bus.get(second)
    finally:
        bus.close()

    assert done.status == "done"
    assert mock_llm.statuses() == [200]  # the second worker never called, so never got a 429
    (cooling,) = rows(db_url, sa.select(model_cooldown))
    assert (cooling["model_id"], cooling["reason"]) == ("gpt", "limit_reached")
    assert done.updated_at is not None
    assert 355 <= cooling["cooldown_until"] - done.updated_at <= 361
    assert waiting.status == "paused"
    assert waiting.resume_after == pytest.approx(cooling["cooldown_until"])
    (skip,) = rows(db_url, sa.select(route_log).where(route_log.c.task_id == second))
    assert (skip["decision"], skip["code"]) == ("skip", "cooldown")
    listed = run_busctl("cooldowns", "--json", env=env)
    assert [(c["model_id"], c["reason"]) for c in json.loads(listed.stdout)] == [
        ("gpt", "limit_reached")
    ]


def test_a_token_window_learnt_by_one_worker_holds_for_the_next(
    db_url: str, spawn: Spawn, mock_llm: MockLLM, tmp_path: Path
) -> None:
    """No tpm configured: the first answer's headers announce one, and another process
    then admits by it: a call larger than it fails for good, a call it has no room for
    pauses until the call before it leaves the window."""
    from agentbus.schema import call_slots

    config = openai_config(tmp_path, mock_llm)
    env = {"AGENTBUS_DATABASE_URL": db_url, "AGENTBUS_CONFIG": config, "OAI_KEY": "sk-x"}
    said = {"x-ratelimit-limit-tokens": "2000", "x-ratelimit-remaining-tokens": "1900"}
    used = {**openai_answer(), "usage": {"prompt_tokens": 1000, "completion_tokens": 100}}
    mock_llm.then = Answer(200, used, said)
    params = {"params": {"max_tokens": 100}}

    bus = AgentBus(db_url)
    try:
        first = bus.enqueue("alpha", "hello", models=["gpt"], payload=params)
        one = spawn("worker", "--agent", "alpha", "--drain", env=env)
        assert one.wait() == 0, one.text()
        huge = bus.enqueue("beta", "word " * 1800, models=["gpt"], payload=params)  # ~2,350
        fits = bus.enqueue("beta", "word " * 800, models=["gpt"], payload=params)  # ~1,108
        waits = bus.enqueue("beta", "word " * 800, models=["gpt"], payload=params)
        two = spawn("worker", "--agent", "beta", "--drain", env=env)
        assert two.wait() == 0, two.text()
        tasks = [bus.get(t) for t in (first, huge, fits, waits)]
    finally:
        bus.close()

    assert [t.status for t in tasks] == ["done", "failed", "done", "paused"]
    assert "no usable model" in (tasks[1].last_error or "")
    assert "more than the 2,000 per 60s gpt through oai/default" in (tasks[1].last_error or "")
    assert mock_llm.statuses() == [200, 200]  # the huge one and the last were never sent
    (slot,) = rows(db_url, sa.select(call_slots).where(call_slots.c.task_id == fits))
    assert (slot["tokens_in"], slot["tokens_out"]) == (1000, 100)  # what the answer said
    assert tasks[3].resume_after == pytest.approx(slot["admitted_at"] + 60)
