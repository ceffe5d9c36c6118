"""What a call sends and what its answer teaches, against a local model endpoint:
the task's system prompt, conversation and parameters; the Anthropic provider;
finish reasons, tool calls and usage; rate-limit headers; the command provider's
request file."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog

from agentbus.catalog import AccountConfig, ProviderConfig, parse_catalog
from agentbus.errors import ConfigError, InvalidTask
from agentbus.providers import CallRequest, chat
from agentbus.providers.anthropic import DEFAULT_MAX_TOKENS, AnthropicProvider
from agentbus.providers.command import CommandProvider
from agentbus.providers.openai import OpenAIProvider
from agentbus.providers.outcomes import AuthFailed, Failed, RateLimited, Succeeded, TimedOut, Usage
from agentbus.providers.ratelimits import announced, exhausted_for, reset_in
from agentbus.queue.tasks import TaskSpec
from tests.mock_llm import ANTHROPIC_PATH, Answer, MockLLM, anthropic_answer, openai_answer

KEY = "sk-ant-test-5ecret-do-not-log"
NOW = 1_800_000_000.0


def call(
    payload: dict[str, Any] | None = None, params: dict[str, Any] | None = None
) -> CallRequest:
    payload = payload or {}
    return CallRequest(
        task_id=7,
        model="m",
        upstream="upstream-m",
        prompt="the task text",
        worker="w",
        timeout_sec=5,
        payload=payload,
        params=chat.params_for(params or {}, payload),
    )


def openai_at(url: str) -> OpenAIProvider:
    config = ProviderConfig(
        "oai", "openai", base_url=f"{url}/v1", accounts=(AccountConfig("default", "K"),)
    )
    return OpenAIProvider(config, {"K": KEY})


def anthropic_at(url: str, timeout: float | None = None) -> AnthropicProvider:
    config = ProviderConfig(
        "ant",
        "anthropic",
        base_url=url,
        timeout_sec=timeout,
        accounts=(AccountConfig("default", "K"),),
    )
    return AnthropicProvider(config, {"K": KEY})


# -- the task's conversation, checked at enqueue --------------------------------------


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"system": 3}, "payload.system must be a non-empty string"),
        ({"messages": "hi"}, "payload.messages must be a non-empty list of messages"),
        ({"messages": []}, "payload.messages must be a non-empty list of messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "payload.messages[0].role must be"),
        ({"messages": [{"role": "user"}]}, "payload.messages[0] has no content"),
        ({"messages": [{"role": "user", "content": 5}]}, "payload.messages[0].content must be"),
        ({"params": [1]}, "payload.params must be an object of parameters"),
        ({"params": {"temperature": 3}}, "payload.params.temperature must be a number from 0"),
        ({"params": {"temperature": True}}, "payload.params.temperature must be a number"),
        (
            {"params": {"max_tokens": 0}},
            "payload.params.max_tokens must be a whole number from 1 to",
        ),
        ({"params": {"max_tokens": "9"}}, "payload.params.max_tokens must be a whole number"),
        ({"params": {"stop": [1]}}, "payload.params.stop must be a string or a list"),
        ({"params": {"tools": {}}}, "payload.params.tools must be a list of objects"),
        ({"params": {"response_format": "json"}}, "payload.params.response_format must be"),
        ({"params": {"tool_choice": 1}}, "payload.params.tool_choice must be"),
        ({"params": {"model": "other"}}, "payload.params.model is set by agentbus"),
        ({"params": {"stream": True}}, "payload.params.stream is set by agentbus"),
    ],
)
def test_a_malformed_conversation_is_refused_at_enqueue(
    payload: dict[str, Any], message: str
) -> None:
    with pytest.raises(InvalidTask) as refused:
        TaskSpec(agent="a", command="x", models=("m",), payload=payload)
    assert refused.value.message.startswith(message)
    assert "\n" not in refused.value.message


def test_a_well_formed_conversation_passes_and_unknown_params_pass_through() -> None:
    TaskSpec(
        agent="a",
        command="x",
        models=("m",),
        payload={
            "system": "Be terse.",
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"},
            ],
            "params": {"temperature": 0, "stop": ["END"], "logit_bias": {"50256": -100}},
        },
    )


def test_the_task_text_is_the_last_user_turn_unless_messages_end_with_one() -> None:
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert chat.conversation("next", {"messages": history})[-1] == {
        "role": "user",
        "content": "next",
    }
    asked = [*history, {"role": "user", "content": "already asked"}]
    assert chat.conversation("a title", {"messages": asked}) == asked
    assert chat.conversation("alone", {}) == [{"role": "user", "content": "alone"}]


def test_model_default_params_are_checked_in_the_config_and_the_task_wins() -> None:
    doc = {
        "providers": {"p": {"kind": "openai", "base_url": "http://x/v1", "api_key_env": "K"}},
        "models": {"m": {"provider": "p", "params": {"temperature": 0.2, "max_tokens": 50}}},
    }
    defaults = parse_catalog(doc).model("m").params
    assert defaults == {"temperature": 0.2, "max_tokens": 50}
    assert chat.params_for(defaults, {"params": {"temperature": 0.9}}) == {
        "temperature": 0.9,
        "max_tokens": 50,
    }
    doc["models"]["m"]["params"] = {"temperature": "hot"}
    with pytest.raises(ConfigError, match=r"\[models.'m'\] params.temperature must be a number"):
        parse_catalog(doc)


# -- OpenAI-compatible ---------------------------------------------------------------


def test_openai_sends_system_messages_and_params_and_reads_tool_calls(mock_llm: MockLLM) -> None:
    tool = {"id": "call_1", "type": "function"}
    tool["function"] = {"name": "lookup", "arguments": '{"city": "Seoul"}'}  # type: ignore[assignment]
    mock_llm.queue(Answer(body=openai_answer("", finish="tool_calls", tool_calls=[tool])))
    payload = {
        "system": "Be terse.",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "params": {"temperature": 0.7, "tools": [{"type": "function"}]},
    }
    outcome = openai_at(mock_llm.url).call(call(payload, {"temperature": 0.1, "top_p": 0.5}))
    assert outcome == Succeeded(
        "",
        Usage(11, 7),
        finish_reason="tool_calls",
        tool_calls=({"id": "call_1", "name": "lookup", "arguments": {"city": "Seoul"}},),
    )
    (seen,) = mock_llm.seen
    assert seen.path == "/v1/chat/completions"
    assert seen.headers["authorization"] == f"Bearer {KEY}"
    assert seen.body == {
        "model": "upstream-m",
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
            {"role": "user", "content": "the task text"},
        ],
        "temperature": 0.7,
        "top_p": 0.5,
        "tools": [{"type": "function"}],
    }


def test_the_result_detail_keeps_finish_reason_tool_calls_and_usage() -> None:
    answer = Succeeded("t", Usage(3, 4), finish_reason="stop")
    assert answer.detail("m") == {
        "model": "m",
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 3, "completion_tokens": 4},
    }


# -- Anthropic ------------------------------------------------------------------------


def test_anthropic_sends_the_messages_api_shape(mock_llm: MockLLM) -> None:
    use = {"type": "tool_use", "id": "tu_1", "name": "lookup", "input": {"city": "Busan"}}
    mock_llm.queue(Answer(body=anthropic_answer("Let me look.", stop="tool_use", tool_use=[use])))
    payload = {
        "system": "Be terse.",
        "messages": [
            {"role": "system", "content": "Answer in Korean."},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "tu_0", "function": {"name": "lookup", "arguments": '{"city": "Seoul"}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "tu_0", "content": "sunny"},
        ],
        "params": {"stop": "END", "temperature": 0.3},
    }
    outcome = anthropic_at(mock_llm.url).call(call(payload))
    assert outcome == Succeeded(
        "Let me look.",
        Usage(13, 5),
        finish_reason="tool_use",
        tool_calls=({"id": "tu_1", "name": "lookup", "arguments": {"city": "Busan"}},),
    )
    (seen,) = mock_llm.seen
    assert seen.path == ANTHROPIC_PATH
    assert seen.headers["x-api-key"] == KEY
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert "authorization" not in seen.headers
    assert seen.body == {
        "model": "upstream-m",
        "system": "Be terse.\n\nAnswer in Korean.",
        "max_tokens": DEFAULT_MAX_TOKENS,
        "stop_sequences": ["END"],
        "temperature": 0.3,
        "messages": [
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "tu_0", "name": "lookup", "input": {"city": "Seoul"}}
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "tu_0", "content": "sunny"}],
            },
            {"role": "user", "content": "the task text"},
        ],
    }


@pytest.mark.parametrize(
    ("status", "headers", "expected"),
    [
        (429, {"retry-after": "20"}, RateLimited),
        (529, {"retry-after": "30"}, RateLimited),
        (503, {}, RateLimited),
        (401, {}, AuthFailed),
        (403, {}, AuthFailed),
        (408, {}, TimedOut),
        (500, {}, Failed),
        (400, {}, Failed),
    ],
)
def test_anthropic_status_mapping(
    mock_llm: MockLLM, status: int, headers: dict[str, str], expected: type
) -> None:
    body = {"type": "error", "error": {"type": "x", "message": f"bad key {KEY}"}}
    mock_llm.queue(Answer(status, body, headers))
    outcome = anthropic_at(mock_llm.url).call(call())
    assert isinstance(outcome, expected)
    assert KEY not in repr(outcome) and "bad key ***" in repr(outcome)
    if status == 529:
        assert outcome == RateLimited(outcome.detail, retry_after_sec=30.0, overloaded=True), (
            "529 is the API overloaded: the model cools for its retry-after"
        )
    if status == 429:
        assert isinstance(outcome, RateLimited) and not outcome.overloaded
        assert outcome.retry_after_sec == 20.0
    if status in (500, 400):
        assert isinstance(outcome, Failed) and outcome.retryable is (status == 500)


def test_anthropic_timeouts_missing_keys_and_malformed_answers(mock_llm: MockLLM) -> None:
    with socket.socket() as silent:  # takes the connection, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        port = silent.getsockname()[1]
        assert isinstance(
            anthropic_at(f"http://127.0.0.1:{port}", timeout=0.3).call(call()), TimedOut
        )
    unreachable = anthropic_at(f"http://127.0.0.1:{port}", timeout=2)  # closed now
    outcome = unreachable.call(call())
    assert isinstance(outcome, Failed) and outcome.retryable
    config = ProviderConfig(
        "ant", "anthropic", base_url=mock_llm.url, accounts=(AccountConfig("default", "K"),)
    )
    assert isinstance(AnthropicProvider(config, {}).call(call()), AuthFailed)
    mock_llm.queue(Answer(200, {"content": "not blocks"}))
    assert anthropic_at(mock_llm.url).call(call()) == Failed("ant: malformed answer", True)
    assert mock_llm.statuses() == [200]  # the missing key never reached the endpoint


def test_a_hand_written_malformed_conversation_fails_the_call(mock_llm: MockLLM) -> None:
    with pytest.raises(InvalidTask, match=r"payload\.messages"):
        anthropic_at(mock_llm.url).call(call({"messages": [{"role": "robot"}]}))
    assert mock_llm.seen == []


# -- rate-limit headers ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("6m0s", 360.0),
        ("1.5s", 1.5),
        ("20ms", 0.02),
        ("1h2m3s", 3723.0),
        ("17", 17.0),
        ("2027-01-15T08:00:30Z", 30.0),
        ("2027-01-15T17:00:30+09:00", 30.0),
        ("soon", None),
        ("-5", None),
        ("2027-01-15T08:00:30", None),  # no zone: cannot be placed
        ("", None),
        ("999999h", None),
    ],
)
def test_reset_values(value: str, seconds: float | None) -> None:
    now = 1_800_000_000.0  # 2027-01-15T08:00:00Z
    found = reset_in(value, now)
    assert found == (pytest.approx(seconds) if seconds is not None else None)


def test_exhausted_headers_of_both_vendors() -> None:
    openai = {"x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "6m0s"}
    assert exhausted_for(openai, NOW) == 360.0
    tokens = {
        "x-ratelimit-remaining-requests": "10",
        "x-ratelimit-reset-requests": "1s",
        "x-ratelimit-remaining-tokens": "0",
        "x-ratelimit-reset-tokens": "1.5s",
    }
    assert exhausted_for(tokens, NOW) == 1.5
    anthropic = {
        "anthropic-ratelimit-requests-remaining": "0",
        "anthropic-ratelimit-requests-reset": "2027-01-15T08:01:00Z",
        "anthropic-ratelimit-output-tokens-remaining": "0",
        "anthropic-ratelimit-output-tokens-reset": "2027-01-15T08:02:00Z",
    }
    assert exhausted_for(anthropic, NOW) == 120.0
    room = {"anthropic-ratelimit-requests-remaining": "3", "x-ratelimit-remaining-tokens": "9"}
    assert exhausted_for(room, NOW) is None


def test_malformed_rate_limit_headers_are_ignored_with_a_debug_line() -> None:
    with structlog.testing.capture_logs() as logs:
        found = exhausted_for(
            {
                "x-ratelimit-remaining-requests": "none",
                "anthropic-ratelimit-requests-remaining": "0",
                "anthropic-ratelimit-requests-reset": "tomorrow-ish",
                "x-ratelimit-remaining-tokens": "0",  # and no reset at all
            },
            NOW,
        )
    assert found is None
    ignored = [(e["log_level"], e["header"]) for e in logs]
    assert ignored == [
        ("debug", "x-ratelimit-remaining-requests"),
        ("debug", "x-ratelimit-reset-tokens"),
        ("debug", "anthropic-ratelimit-requests-reset"),
    ]


def test_a_success_whose_headers_say_nothing_is_left_carries_the_reset(mock_llm: MockLLM) -> None:
    spent = {"anthropic-ratelimit-requests-remaining": "0"}
    spent["anthropic-ratelimit-requests-reset"] = "45s"
    mock_llm.queue(Answer(200, None, spent), Answer(429, None, spent))
    provider = anthropic_at(mock_llm.url)
    answered = provider.call(call())
    assert isinstance(answered, Succeeded) and answered.limit_reset_sec == 45.0
    refused = provider.call(call())  # a 429 without retry-after: the reset says how long
    assert isinstance(refused, RateLimited) and refused.retry_after_sec == 45.0


def test_the_token_windows_an_answer_announces(mock_llm: MockLLM) -> None:
    assert announced(
        {
            "x-ratelimit-limit-tokens": "30000",
            "x-ratelimit-remaining-tokens": "29000",
            "anthropic-ratelimit-input-tokens-limit": " 40000 ",
            "anthropic-ratelimit-output-tokens-limit": "8000",
            "anthropic-ratelimit-output-tokens-remaining": "9000",  # more than the limit
            "anthropic-ratelimit-tokens-limit": "8000",  # the tighter of the two: no window
        }
    ) == {"tpm": (30000, 29000), "itpm": (40000, None), "otpm": (8000, None)}
    with structlog.testing.capture_logs() as logs:
        assert announced({"x-ratelimit-limit-tokens": "-3"}) == {}
        assert announced({"x-ratelimit-limit-tokens": "1e9"}) == {}
        assert announced({"anthropic-ratelimit-input-tokens-limit": "9" * 20}) == {}
    assert [e["header"] for e in logs] == [
        "x-ratelimit-limit-tokens",
        "x-ratelimit-limit-tokens",
        "anthropic-ratelimit-input-tokens-limit",
    ]
    said = {
        "anthropic-ratelimit-input-tokens-limit": "40000",
        "anthropic-ratelimit-input-tokens-remaining": "39000",
    }
    mock_llm.queue(Answer(200, None, said))
    answered = anthropic_at(mock_llm.url).call(call())
    assert isinstance(answered, Succeeded) and answered.announced == (("itpm", 40000, 39000),)
    assert answered.limit_reset_sec is None
    # A refusal announces them too: often the first a fleet hears of the limit.
    said = {"x-ratelimit-limit-tokens": "30000", "x-ratelimit-remaining-tokens": "0"}
    mock_llm.queue(Answer(429, None, {**said, "retry-after": "3"}))
    refused = anthropic_at(mock_llm.url).call(call())
    assert isinstance(refused, RateLimited) and refused.announced == (("tpm", 30000, 0),)


# -- the command provider's request file ----------------------------------------------

READER = """\
import json, os, sys
path = os.environ["AGENTBUS_REQUEST_FILE"]
request = json.load(open(path))
prompt = sys.stdin.read()
print(json.dumps({"path": path, "mode": oct(os.stat(path).st_mode & 0o777),
                  "request": request, "stdin": prompt}))
"""


def test_the_command_provider_hands_the_request_over_as_a_json_file(tmp_path: Path) -> None:
    script = tmp_path / "agent.py"
    script.write_text(READER)
    config = ProviderConfig("cli", "command", argv=(sys.executable, str(script)))
    payload = {"system": "Be terse.", "params": {"temperature": 0.5}, "extra": [1, 2]}
    outcome = CommandProvider(config, {"PATH": "/usr/bin"}).call(call(payload, {"top_p": 0.9}))
    assert isinstance(outcome, Succeeded)
    seen = json.loads(outcome.text)
    assert seen["stdin"] == "the task text"
    assert seen["mode"] == "0o600"
    assert seen["request"] == {
        "task_id": 7,
        "model": "upstream-m",
        "text": "the task text",
        "system": "Be terse.",
        "messages": [{"role": "user", "content": "the task text"}],
        "params": {"top_p": 0.9, "temperature": 0.5},
        "payload": payload,
    }
    assert not Path(seen["path"]).exists()  # removed when the call ended


def test_an_anthropic_provider_in_the_config() -> None:
    doc: dict[str, Any] = {"providers": {"ant": {"kind": "anthropic", "api_key_env": "K"}}}
    provider = parse_catalog(doc).providers["ant"]
    assert (provider.base_url, provider.anthropic_version) == (
        "https://api.anthropic.com",
        "2023-06-01",
    )
    doc["providers"]["ant"].update(base_url="http://llm.local/", anthropic_version="2024-01-01")
    provider = parse_catalog(doc).providers["ant"]
    assert (provider.base_url, provider.anthropic_version) == ("http://llm.local", "2024-01-01")
    for broken, message in (
        ({"kind": "anthropic"}, "name the variable holding the key"),
        ({"kind": "anthropic", "api_key_env": "K", "argv": ["x"]}, "unknown key 'argv'"),
        ({"kind": "anthropic", "api_key_env": "K", "base_url": "ftp://x"}, "base_url must start"),
        ({"kind": "openai", "api_key_env": "K"}, "base_url must be a non-empty string"),
    ):
        with pytest.raises(ConfigError, match=message):
            parse_catalog({"providers": {"p": broken}})
