"""Settings: defaults < TOML file < environment < flags, every problem one error."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentbus.config import Settings
from agentbus.errors import ConfigError


def test_precedence(tmp_path: Path) -> None:
    cfg = tmp_path / "agentbus.toml"
    cfg.write_text('lease_sec = 90\nmax_attempts = 5\ndatabase_url = "sqlite:///a.db"\n')
    env = {"AGENTBUS_MAX_ATTEMPTS": "7", "AGENTBUS_DATABASE_URL": "sqlite:///b.db"}
    s = Settings.load(cfg, {"database_url": "sqlite:///c.db", "lease_sec": None}, environ=env)
    assert (s.lease_sec, s.max_attempts, s.database_url) == (90.0, 7, "sqlite:///c.db")
    assert Settings.load(environ={}).database_url == "sqlite:///ops_multiagent.db"


def test_config_file_from_env(tmp_path: Path) -> None:
    cfg = tmp_path / "x.toml"
    cfg.write_text("lease_sec = 12\n")
    assert Settings.load(environ={"AGENTBUS_CONFIG": str(cfg)}).lease_sec == 12.0


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
        Settings.load(environ=env)


def test_every_setting_is_documented() -> None:
    docs = Settings.fields_doc()
    assert docs and all(text.strip() for text in docs.values())
