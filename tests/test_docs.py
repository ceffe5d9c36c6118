"""The README and the example config stay true to the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from shared.config import Settings, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_and_env_var_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    for field in dataclasses.fields(Settings):
        assert f"| `{field.name}` | `AGENTBUS_{field.name.upper()}` |" in readme, field.name


def test_the_example_config_loads() -> None:
    config = load_config(ROOT / "agentbus.example.toml", environ={})
    assert config.catalog.chain_for(models=None, role=None, agent="codex")[0] == "claude-opus"
