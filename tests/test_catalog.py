"""The model catalog from the config file: every problem one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared.catalog import Catalog
from shared.config import load_config
from shared.errors import ConfigError

GOOD = """
lease_sec = 30
[providers.main]
kind = "openai"
base_url = "http://127.0.0.1:9/v1"
api_key_env = "MAIN_KEY"

[models."gpt-x"]
provider = "main"
name = "gpt-x-2026"

[roles.coder]
models = ["gpt-x", "sim/backup"]

[agents.codex]
role = "coder"

[agents.ron]
models = ["sim/a"]
"""


def test_a_good_config(tmp_path: Path) -> None:
    path = tmp_path / "agentbus.toml"
    path.write_text(GOOD)
    config = load_config(path, environ={})
    cat = config.catalog
    assert config.settings.lease_sec == 30
    assert cat.models["gpt-x"].upstream == "gpt-x-2026"
    assert cat.chain_for(models=None, role=None, agent="codex") == ("gpt-x", "sim/backup")
    assert cat.chain_for(models=None, role="coder", agent="ron") == ("gpt-x", "sim/backup")
    assert cat.chain_for(models=("sim/z",), role="coder", agent="ron") == ("sim/z",)
    with pytest.raises(ConfigError, match="unknown role 'writer'"):
        cat.chain_for(models=None, role="writer", agent="ron")
    with pytest.raises(ConfigError, match="no model chain for agent 'ghost'"):
        cat.chain_for(models=None, role=None, agent="ghost")
    with pytest.raises(ConfigError, match="unknown model 'gpt-y'"):
        cat.chain_for(models=("gpt-y",), role=None, agent="ron")


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"providers": {"p": {"kind": "grpc"}}}, "kind must be one of"),
        (
            {"providers": {"p": {"kind": "openai", "base_url": "ftp://x", "api_key_env": "K"}}},
            "base_url must start with",
        ),
        ({"providers": {"p": {"kind": "openai", "base_url": "http://x"}}}, "api_key_env"),
        ({"providers": {"p": {"kind": "command", "argv": []}}}, "argv must be"),
        (
            {"providers": {"p": {"kind": "command", "argv": ["x"], "exit_codes": {"2": "meh"}}}},
            "exit_codes",
        ),
        (
            {
                "providers": {
                    "p": {"kind": "command", "argv": ["x"], "stderr_patterns": {"auth": "("}}
                }
            },
            "not a regex",
        ),
        ({"models": {"m": {"provider": "nope"}}}, "unknown provider 'nope'"),
        ({"roles": {"r": {"models": ["ghost"]}}}, "unknown model 'ghost'"),
        ({"roles": {"r": {"models": []}}}, "non-empty list"),
        ({"agents": {"a": {"role": "nope"}}}, "unknown role 'nope'"),
        ({"agents": {"a": {"role": "r", "models": ["sim/a"]}}}, "either role or models"),
        ({"agents": {"a": {"models": ["sim/a"], "colour": "red"}}}, "unknown key 'colour'"),
    ],
)
def test_bad_catalogs(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Catalog.from_doc(doc)


def test_unknown_section_is_named(tmp_path: Path) -> None:
    path = tmp_path / "agentbus.toml"
    path.write_text("[budgets]\ndaily = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[budgets\]"):
        load_config(path, environ={})
