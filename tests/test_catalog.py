"""The model catalog from the config file: every problem one clear error."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbus.admission.routing import resolve
from agentbus.catalog import parse_catalog
from agentbus.config import load_config
from agentbus.errors import ConfigError

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

    def chain(models: tuple[str, ...] | None, role: str | None, agent: str) -> tuple[str, ...]:
        found = resolve(cat, models=models, role=role, agent=agent, environ=None)
        return tuple(c.model for c in found.candidates)

    assert chain(None, None, "codex") == ("gpt-x", "sim/backup")
    assert chain(None, "coder", "ron") == ("gpt-x", "sim/backup")
    assert chain(("sim/z",), "coder", "ron") == ("sim/z",)
    with pytest.raises(ConfigError, match="unknown role 'writer'"):
        chain(None, "writer", "ron")
    with pytest.raises(ConfigError, match="no model chain for agent 'ghost'"):
        chain(None, None, "ghost")
    with pytest.raises(ConfigError, match="unknown model 'gpt-y'"):
        chain(("gpt-y",), None, "ron")


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
        ({"agents": {"a": {"models": ["sim/a"], "rate": -5}}}, "rate must be a whole number"),
        ({"providers": {"p": {"kind": "simulated", "rpm": 0}}}, "rpm must be a whole number"),
        ({"providers": {"p": {"kind": "simulated", "concurrency": -1}}}, "concurrency must"),
        ({"bulkheads": {"heavy": 0}}, r"\[bulkheads\] heavy must be a whole number"),
        (
            {
                "providers": {"p": {"kind": "simulated"}},
                "models": {"m": {"provider": "p", "bulkhead": "x"}},
            },
            "unknown bulkhead 'x'",
        ),
        (
            {"providers": {"p": {"kind": "openai", "base_url": "http://x", "accounts": {"a": {}}}}},
            "key_env must name",
        ),
        (
            {"providers": {"p": {"kind": "openai", "base_url": "http://x", "api_key_env": "a b"}}},
            "NAME of an environment variable",
        ),
        ({"providers": {"sim": {"kind": "command", "argv": ["x"]}}}, "simulated provider's"),
        ({"roles": {"r": {"models": ["sim/a"], "fallback": "s"}}}, "unknown fallback role 's'"),
        (
            {
                "roles": {
                    "r": {"models": ["sim/a"], "fallback": "s"},
                    "s": {"models": ["sim/b"], "fallback": "r"},
                }
            },
            r"fallback roles loop \(r -> s -> r\)",
        ),
        (
            {"roles": {"r": {"candidates": [{"model": "sim/a", "account": "zz"}]}}},
            "provider 'sim' has no account 'zz'",
        ),
        ({"routing": {"default_role": "nope"}}, "default_role 'nope' is not a configured role"),
    ],
)
def test_bad_catalogs(doc: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_catalog(doc)


def test_unknown_section_is_named(tmp_path: Path) -> None:
    path = tmp_path / "agentbus.toml"
    path.write_text("[budgets]\ndaily = 3\n")
    with pytest.raises(ConfigError, match=r"unknown section \[budgets\]"):
        load_config(path, environ={})


ROUTED = """
[providers.sim]
kind = "simulated"
[providers.sim.accounts.a]
key_env = "SIM_A"
[providers.sim.accounts.b]
key_env = "SIM_B"

[roles.primary]
candidates = [{ model = "sim/x", account = "b" }, "sim/y"]
fallback = "secondary"

[roles.secondary]
models = ["sim/z"]
fallback = "last"

[roles.last]
models = ["sim/y"]

[routing]
default_role = "secondary"
"""


def test_resolve_follows_fallbacks_accounts_and_credentials(tmp_path: Path) -> None:
    path = tmp_path / "agentbus.toml"
    path.write_text(ROUTED)
    catalog = load_config(path, environ={}).catalog

    def keys(role: str, environ: dict[str, str] | None) -> list[tuple[str, str | None, str | None]]:
        found = resolve(catalog, models=None, role=role, agent="x", environ=environ)
        return [(c.key, c.role, c.fallback_from) for c in found.candidates]

    both = {"SIM_A": "1", "SIM_B": "2"}
    assert keys("primary", both) == [
        ("sim/x@b", "primary", None),
        ("sim/y@a", "primary", None),
        ("sim/y@b", "primary", None),
        ("sim/z@a", "secondary", "primary"),
        ("sim/z@b", "secondary", "primary"),
    ]  # sim/y again under "last" is not listed twice
    assert keys("primary", {"SIM_A": "1"}) == [
        ("sim/y@a", "primary", None),
        ("sim/z@a", "secondary", "primary"),
    ]
    found = resolve(catalog, models=None, role="primary", agent="x", environ={"SIM_A": "1"})
    assert found.left_out[0] == "sim/x@b: no credentials ($SIM_B is not set)"
    # An unconfigured role runs as [routing] default_role, and says where it came from.
    assert keys("ghost", None)[0] == ("sim/z@a", "secondary", "ghost")
    assert len(keys("primary", None)) == 5  # None: credentials not checked (the sweeper)
