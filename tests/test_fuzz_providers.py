"""Provider answers generated (hypothesis): an HTTP endpoint's statuses, headers
(garbage ``retry-after``, negative or huge resets, duplicated headers) and bodies
(non-JSON, truncated, huge), and a ``command`` provider's stdout bytes, exit codes and
stderr, each map to an outcome: a call never raises (so agentbus's own code never
marks a task ``error``), and no answer cools a model longer than the documented cap."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agentbus.admission.gates import cooldown_until, cools
from agentbus.catalog import AccountConfig, ProviderConfig, parse_catalog
from agentbus.config import Settings
from agentbus.providers import CallRequest
from agentbus.providers.anthropic import AnthropicProvider
from agentbus.providers.command import CommandProvider
from agentbus.providers.openai import OpenAIProvider
from agentbus.providers.outcomes import Outcome
from agentbus.providers.ratelimits import FAMILIES, MAX_RESET_SEC
from tests.fuzzing import FUZZ
from tests.mock_llm import anthropic_answer, openai_answer

SETTINGS = Settings()
#: The longest any answer may cool a model: the configured cooldowns, or what the
#: provider asks for up to two days (docs/models.md).
CAP = max(SETTINGS.model_cooldown_sec, SETTINGS.model_timeout_cooldown_sec, MAX_RESET_SEC)
REQUEST = CallRequest(
    task_id=7, model="m", prompt="hello", worker="w", timeout_sec=5, created_at=1000.0, payload={}
)

numbers = st.one_of(
    st.integers(-(10**12), 10**12).map(str),
    st.floats().map(str),
    st.sampled_from(["", " ", "1e999", "-1e999", "nan", "inf", "0x10", "1_000", "٣"]),
)
times = st.one_of(
    numbers,
    st.sampled_from(
        ["1h2m3s", "5ms", "999999h", "2026-12-07T00:00:00Z", "9999-12-31T23:59:59+00:00"]
    ),
    st.sampled_from(["Wed, 21 Oct 2015 07:28:00 GMT", "Fri, 31 Dec 9999 23:59:59 GMT", "Mon, 99"]),
    st.text(max_size=12),
)
limit_headers = [name for pair in FAMILIES for name in pair]
header_pairs = st.lists(
    st.tuples(
        st.sampled_from(["retry-after", "retry-after-ms", *limit_headers, "content-type"]), times
    ),
    max_size=6,
)  # a list: a name may come twice
bodies = st.one_of(
    st.binary(max_size=64),
    st.sampled_from([b"", b"{", b"null", b"[]", b'{"choices": []}', b'{"content": 5}']),
    st.builds(lambda d: json.dumps(d).encode(), st.just(openai_answer())),
    st.builds(lambda d: json.dumps(d).encode(), st.just(anthropic_answer())),
    st.builds(
        lambda d, n: json.dumps(d).encode()[:n], st.just(openai_answer()), st.integers(0, 80)
    ),
    st.just(b"x" * 3_000_000),
)
statuses = st.sampled_from([200, 201, 204, 301, 400, 401, 403, 404, 408, 413, 429, 500, 503, 529])


def check(outcome: Any) -> None:
    assert isinstance(outcome, Outcome), outcome
    if cools(outcome):
        now = time.time()
        until = cooldown_until(
            outcome, now, SETTINGS.model_cooldown_sec, SETTINGS.model_timeout_cooldown_sec
        )
        assert now <= until <= now + CAP, (outcome, until - now)


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
def test_any_http_answer_is_an_outcome(kind: str) -> None:
    config = ProviderConfig(
        "p", kind, base_url="http://llm.local/v1", accounts=(AccountConfig("default", "K"),)
    )
    provider_class = OpenAIProvider if kind == "openai" else AnthropicProvider

    @FUZZ
    @given(statuses | st.integers(100, 599), header_pairs, bodies)
    def answer(status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        # As bytes: a server may send any byte in a header's value.
        safe = [(n.encode(), v.encode("utf-8", "surrogateescape")) for n, v in headers]

        def handler(_request: httpx.Request) -> httpx.Response:
            return httpx.Response(status, headers=safe, content=body)

        provider = provider_class(config, {"K": "key"}, transport=httpx.MockTransport(handler))
        try:
            check(provider.call(REQUEST))
        finally:
            provider.close()

    answer()


def test_any_command_answer_is_an_outcome(tmp_path: Path) -> None:
    said = tmp_path / "said"
    script = tmp_path / "cli.py"
    script.write_text(
        "import os, sys\n"
        "sys.stdin.read()\n"
        "data = open(os.environ['SAID'], 'rb').read().split(b'\\0SPLIT\\0')\n"
        "sys.stdout.buffer.write(data[0]); sys.stderr.buffer.write(data[1])\n"
        "sys.exit(int(data[2]))\n"
    )
    catalog = parse_catalog(
        {
            "providers": {
                "cli": {
                    "kind": "command",
                    "argv": [sys.executable, str(script)],
                    "exit_codes": {"75": "overloaded", "76": "rate_limited"},
                    "stderr_patterns": {"rate_limited": "rate.?limit", "timeout": "timed out"},
                }
            }
        }
    )
    provider = CommandProvider(catalog.providers["cli"], {**os.environ, "SAID": str(said)})

    @FUZZ
    @given(
        st.binary(max_size=64) | st.just(b"\xff" * 10) | st.just(b"x" * 2_000_000),
        st.binary(max_size=32) | st.sampled_from([b"Error: 429 rate limit", b"timed out"]),
        st.sampled_from([0, 1, 2, 75, 76, 127, 255]),
    )
    def answer(stdout: bytes, stderr: bytes, code: int) -> None:
        said.write_bytes(stdout + b"\0SPLIT\0" + stderr + b"\0SPLIT\0" + str(code).encode())
        check(provider.call(REQUEST))

    answer()
