"""Permits for the calls agentbus does not make: the worker's admission, shared by every
process, around an agent's own SDK calls."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.async_client import AsyncAgentBus
from agentbus.client import AgentBus
from agentbus.errors import ConfigError, Refused
from agentbus.schema import model_cooldown
from tests.support import clean_env, wait_until

CONFIG = """
admission_wait_ms = 0

[providers.llm]
kind = "simulated"
rpm = {rpm}
concurrency = {concurrency}

[models.gpt]
provider = "llm"
name = "gpt-4o-mini"
"""


class StatusError(Exception):
    """An SDK's error as the openai, anthropic and httpx ones are: a response with a
    status and headers."""

    def __init__(self, status: int, headers: dict[str, str]) -> None:
        super().__init__(f"Error code: {status}")
        self.status_code = status
        self.response = type("Response", (), {"status_code": status, "headers": headers})()


@pytest.fixture
def bus(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[AgentBus]:
    config = tmp_path / "agentbus.toml"
    config.write_text(CONFIG.format(rpm=3, concurrency=1))
    monkeypatch.setenv("AGENTBUS_CONFIG", str(config))
    with AgentBus(db_url) as made:
        yield made


def test_a_permit_passes_the_rate_window_and_the_slots(bus: AgentBus) -> None:
    with bus.permit("gpt", agent="codex") as p:
        assert (p.model, p.upstream) == ("gpt", "gpt-4o-mini")
        # concurrency 1: the slot is taken
        with pytest.raises(Refused) as inner, bus.permit("gpt", agent="codex"):
            pass
    assert inner.value.code == "concurrency_full"
    for _ in range(2):
        with bus.permit("gpt", agent="codex"):
            pass
    # rpm 3: the window is full
    with pytest.raises(Refused) as refused, bus.permit("gpt", agent="codex"):
        pass
    assert refused.value.code == -32000 and refused.value.suggested_action
    assert 0 < refused.value.retry_after_ms <= 60_000
    assert "rate_limited" in refused.value.message


def test_a_429_inside_a_permit_cools_the_model_for_everyone(bus: AgentBus, db_url: str) -> None:
    with pytest.raises(StatusError), bus.permit("gpt", agent="codex"):
        raise StatusError(429, {"retry-after": "300"})
    # another process's view: the database's
    other = AgentBus(db_url)
    try:
        with pytest.raises(Refused) as refused, other.permit("gpt", agent="codex"):
            pass
    finally:
        other.close()
    assert refused.value.code == "cooldown"
    assert 290_000 <= refused.value.retry_after_ms <= 300_000
    with bus.db.engine.connect() as conn:
        (row,) = conn.execute(sa.select(model_cooldown)).mappings()
    assert (row["model_id"], row["reason"]) == ("gpt", "rate_limited")


def test_what_a_permit_reports_teaches_admission(bus: AgentBus) -> None:
    with bus.permit("gpt", agent="codex") as p:
        p.report(status=503, headers={"Retry-After": "600"})
    with pytest.raises(Refused) as refused, bus.permit("gpt", agent="codex"):
        pass
    assert refused.value.code == "cooldown" and refused.value.retry_after_ms > 590_000


def test_a_bug_in_the_block_gives_the_slot_back_and_teaches_nothing(bus: AgentBus) -> None:
    with pytest.raises(KeyError), bus.permit("gpt", agent="codex"):
        raise KeyError("a bug of the caller's")
    with bus.permit("gpt", agent="codex"):  # the slot is free again, no cooldown
        pass


def test_a_permit_for_what_the_config_does_not_know(bus: AgentBus) -> None:
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'"), bus.permit("gpt-5", agent="c"):
        pass


def test_an_async_permit(db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "agentbus.toml"
    config.write_text(CONFIG.format(rpm=1, concurrency=1))
    monkeypatch.setenv("AGENTBUS_CONFIG", str(config))

    async def main() -> tuple[str, Any]:
        bus = AsyncAgentBus(db_url)
        try:
            async with bus.permit("gpt", agent="codex") as p:
                model = p.model
            try:
                async with bus.permit("gpt", agent="codex"):
                    pass
            except Refused as exc:
                return model, exc.code
            return model, None
        finally:
            await bus.close()

    assert asyncio.run(main()) == ("gpt", -32000)


#: One process of the fleet: asks ``tries`` permits as fast as it can; each one it gets
#: is a journal line (when it began and ended), written while the permit is held.
PERMIT_LOOP = """
import json, os, sys, time
from agentbus.client import AgentBus
from agentbus.errors import Refused

journal, tries = sys.argv[1], int(sys.argv[2])
refused = []
with AgentBus() as bus:
    bus.list(limit=1)  # connected before the start
    open(f"{journal}.{os.getpid()}.ready", "w").close()
    sys.stdin.readline()  # all start together, when the test says go
    for _ in range(tries):
        try:
            with bus.permit("gpt", agent="codex"):
                began = time.time()
                bus.list(limit=1)  # the call: a read, so that slots would overlap if they could
                line = {"pid": os.getpid(), "began": began, "ended": time.time()}
                with open(journal, "a") as out:
                    out.write(json.dumps(line) + "\\n")
        except Refused as exc:
            refused.append(exc.code)
print(json.dumps(refused))
"""


@pytest.mark.process
def test_permits_from_three_processes_never_exceed_the_window_or_the_slots(
    db_url: str, tmp_path: Path
) -> None:
    config = tmp_path / "agentbus.toml"
    config.write_text(CONFIG.format(rpm=20, concurrency=2))
    script = tmp_path / "permits.py"
    script.write_text(textwrap.dedent(PERMIT_LOOP))
    journal = tmp_path / "journal.jsonl"
    env = {**clean_env(), "AGENTBUS_DATABASE_URL": db_url, "AGENTBUS_CONFIG": str(config)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(journal), "40"],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(3)
    ]
    wait_until(lambda: len(list(tmp_path.glob("journal.jsonl.*.ready"))) == 3, timeout=60)
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()  # communicate() closes it
    refused: list[int | str] = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        refused += json.loads(out)
    calls = [json.loads(line) for line in journal.read_text().splitlines()]
    # 120 asked within the minute: the window lets 20 through, whoever asks; the
    # others are refused, by the window or by the slots.
    assert len(calls) == 20 and len(refused) == 100
    assert set(refused) <= {-32000, "concurrency_full"} and -32000 in refused
    # Never more than 2 at once, across the processes.
    edges = sorted([(c["began"], 1) for c in calls] + [(c["ended"], -1) for c in calls])
    running = most = 0
    for _, step in edges:
        running += step
        most = max(most, running)
    assert most <= 2


def test_the_docs_example_runs(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mock_llm: Any
) -> None:
    """docs/permits.md: its example, against the local endpoint, then refused."""
    import re

    from tests.mock_llm import Answer

    text = (Path(__file__).parents[1] / "docs/permits.md").read_text()
    (example,) = re.findall(r"```python\n(.*?)```", text, re.S)
    config = tmp_path / "agentbus.toml"
    config.write_text(CONFIG.format(rpm=1, concurrency=1))
    monkeypatch.setenv("AGENTBUS_CONFIG", str(config))
    monkeypatch.setenv("AGENTBUS_DATABASE_URL", db_url)
    monkeypatch.setenv("OPENAI_BASE_URL", mock_llm.url + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-docs-example")
    mock_llm.queue(Answer())
    exec(compile(example, "docs/permits.md", "exec"), {})
    assert mock_llm.seen[0].body["model"] == "gpt-4o-mini"
    printed: list[str] = []
    exec(compile(example, "docs/permits.md", "exec"), {"print": printed.append})
    assert len(mock_llm.seen) == 1  # the second was refused: rpm 1
    assert printed and printed[0].startswith("not now: -32000, again in ")


def test_a_permits_call_and_its_tokens_are_in_the_usage_ledger(bus: AgentBus) -> None:
    from agentbus.schema import usage_daily

    with bus.permit("gpt", agent="codex") as p:
        p.report(usage={"prompt_tokens": 812, "completion_tokens": 96})
    with pytest.raises(StatusError), bus.permit("gpt", agent="codex"):
        raise StatusError(500, {})
    with bus.db.engine.connect() as conn:
        (row,) = conn.execute(sa.select(usage_daily)).mappings()
    assert (row["model"], row["calls"], row["prompt_tokens"], row["completion_tokens"]) == (
        "gpt",
        2,
        812,
        96,
    )


def test_the_tokens_a_permit_names_count_against_the_daily_budget(
    db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentbus.errors import InvalidTask
    from agentbus.schema import usage_daily

    config = tmp_path / "agentbus.toml"
    text = CONFIG.format(rpm=100, concurrency=5).replace(
        "admission_wait_ms = 0", "admission_wait_ms = 0\ndaily_token_budget = 1000"
    )
    config.write_text(text)
    monkeypatch.setenv("AGENTBUS_CONFIG", str(config))
    with AgentBus(db_url) as bus:
        for bad in (-1, 1.5, True, "many"):
            with (
                pytest.raises(InvalidTask, match="tokens must be"),
                bus.permit(
                    "gpt",
                    agent="codex",
                    tokens=bad,  # type: ignore[arg-type]
                ),
            ):
                pass
        with bus.permit("gpt", agent="codex", tokens=300) as p:  # reported: the report wins
            p.report(usage={"prompt_tokens": 20, "completion_tokens": 5})
        with bus.permit("gpt", agent="codex", tokens=600):  # nothing reported: its tokens
            pass
        with bus.permit("gpt", agent="codex", tokens=400):  # 625 used: under the budget
            pass
        with pytest.raises(Refused) as refused, bus.permit("gpt", agent="codex", tokens=1):
            pass
        with bus.db.engine.connect() as conn:
            (row,) = conn.execute(sa.select(usage_daily)).mappings()
    assert refused.value.name == "budget_exhausted"
    assert (row["calls"], row["prompt_tokens"], row["completion_tokens"]) == (3, 1020, 5)
