"""Settings: defaults < TOML file < environment < flags, every problem one error."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbus.config import LiveConfig, Settings, load_config
from agentbus.errors import ConfigError
from agentbus.providers import Providers


def test_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "agentbus.toml"
    cfg.write_text('lease_sec = 90\nmax_attempts = 5\ndatabase_url = "sqlite:///a.db"\n')
    env = {"AGENTBUS_MAX_ATTEMPTS": "7", "AGENTBUS_DATABASE_URL": "sqlite:///b.db"}
    s = load_settings(cfg, {"database_url": "sqlite:///c.db", "lease_sec": None}, environ=env)
    assert (s.lease_sec, s.max_attempts, s.database_url) == (90.0, 7, "sqlite:///c.db")
    assert load_settings(environ={}).database_url == "sqlite:///ops_multiagent.db"


def test_config_file_from_env(tmp_path: Path) -> None:
    cfg = tmp_path / "x.toml"
    cfg.write_text("lease_sec = 12\n")
    assert load_settings(environ={"AGENTBUS_CONFIG": str(cfg)}).lease_sec == 12.0


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AGENTBUS_LEASE_SEC": "soon"}, "lease_sec must be float"),
        ({"AGENTBUS_LEASE_SEC": "0"}, "lease_sec must be positive"),
        ({"AGENTBUS_LEASE_SEC": "nan"}, "lease_sec must be positive"),
        ({"AGENTBUS_MAX_ATTEMPTS": "0"}, "max_attempts must be at least 1"),
        ({"AGENTBUS_SQLITE_SYNCHRONOUS": "maybe"}, "sqlite_synchronous must be"),
        ({"AGENTBUS_CONFIG": "/no/such.toml"}, "does not exist"),
    ],
)
def test_bad_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_settings(environ=env)


@pytest.mark.parametrize(
    ("line", "env", "origin"),
    [
        ('lease_sec = "soon"', {}, "FILE: setting lease_sec must be float"),
        ("lease_sec = -5", {}, "FILE: setting lease_sec must be positive"),
        ("lease_sec = 5", {"AGENTBUS_LEASE_SEC": "0"}, "$AGENTBUS_LEASE_SEC: setting lease_sec"),
    ],
)
def test_a_bad_value_names_where_it_was_given(
    tmp_path: Path, line: str, env: dict[str, str], origin: str
) -> None:
    cfg = tmp_path / "agentbus.toml"
    cfg.write_text(line + "\n")
    with pytest.raises(ConfigError) as refused:
        load_settings(cfg, environ=env)
    assert refused.value.message.startswith(origin.replace("FILE", str(cfg)))


def test_every_setting_is_documented() -> None:
    docs = Settings.fields_doc()
    assert docs and all(text.strip() for text in docs.values())


def test_a_live_config_swaps_a_changed_file_in_whole_and_keeps_it_when_broken(
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "agentbus.toml"
    first = "config_check_sec = 0.000001\nlease_sec = 10\n[agents.a]\nmodels = ['sim/a']\n"
    cfg.write_text(first)
    live = LiveConfig(load_config(cfg, {"max_attempts": 9}, environ={}))
    providers = Providers(live, {})
    before, _ = providers.for_model("sim/a")
    assert not live.refresh()  # unchanged
    cfg.write_text(first.replace("lease_sec = 10", "lease_sec = 200").replace("sim/a", "sim/b"))
    assert live.refresh()
    assert (live.settings.lease_sec, live.settings.max_attempts) == (200.0, 9)  # same flags
    assert live.catalog.agents["a"].models == ("sim/b",)
    after, _ = providers.for_model("sim/b")
    assert after is not before  # providers are made anew from the new catalog
    cfg.write_text("lease_sec = [")  # broken: reported, the running config stays
    assert not live.refresh()
    assert live.settings.lease_sec == 200.0


def load_settings(*args: object, **kw: object) -> Settings:
    return load_config(*args, **kw).settings  # type: ignore[arg-type]
