"""The README and the example config stay true to the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from agentbus.admission.routing import resolve
from agentbus.config import Settings, load_config

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_and_env_var_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    for field in dataclasses.fields(Settings):
        assert f"| `{field.name}` | `AGENTBUS_{field.name.upper()}` |" in readme, field.name


def test_the_example_config_loads() -> None:
    config = load_config(ROOT / "shared/admin/agentbus.example.toml", environ={})
    found = resolve(config.catalog, models=None, role=None, agent="codex", environ=None)
    assert found.candidates[0].model == "claude-opus"


def test_the_example_config_shows_every_catalog_key() -> None:
    from agentbus.catalog import parse as catalog_toml

    text = (ROOT / "shared/admin/agentbus.example.toml").read_text()
    keys = set().union(*catalog_toml._KEYS.values()) | {"key_env", "rpm", "models", "candidates"}
    keys |= {"fallback", "role", "rate", "rate_window_sec", "bulkhead", "default_role"}
    keys |= {"input_cost_per_1k", "output_cost_per_1k", "provider", "name", "account"}
    for key in sorted(keys):
        shown = (f"{key} =", f".{key}.", f"{{ {key} =")  # a key, a table, an inline key
        assert any(form in text for form in shown), key
    for setting in Settings.fields_doc():
        if setting.startswith(("circuit_", "admission_", "daily_", "rpm_", "global_")):
            assert f"\n{setting} =" in text, setting
