"""Settings: defaults, then the TOML file, then environment, then CLI flags.

Every setting is a field of ``Settings``. Its environment variable is
``AGENTBUS_`` + the field name in capitals (``lease_sec`` ->
``AGENTBUS_LEASE_SEC``), and its key in the TOML file is the field name at
the top level of the file. The object is immutable and passed down
explicitly; nothing reads the environment behind its back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.errors import ConfigError

ENV_PREFIX = "AGENTBUS_"
DEFAULT_DATABASE_URL = "sqlite:///ops_multiagent.db"
DEFAULT_CONFIG_FILE = "agentbus.toml"


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class Settings:
    """The settings of every agentbus process (see the module docstring)."""

    database_url: str = _doc(
        "SQLAlchemy URL of the queue database (sqlite:///FILE or postgresql+psycopg://…).",
        DEFAULT_DATABASE_URL,
    )
    lease_sec: float = _doc(
        "How long a claim is held without a heartbeat before the sweeper may rescue it.", 60.0
    )
    max_attempts: int = _doc("Default attempts a task gets before it is failed.", 3)
    db_retry_sec: float = _doc(
        "How long a transient database error (locked, connection lost) is retried.", 30.0
    )
    sqlite_busy_timeout_ms: int = _doc(
        "SQLite: how long a writer waits for the lock before retrying.", 5000
    )
    sqlite_synchronous: str = _doc(
        "SQLite: PRAGMA synchronous (FULL: every commit survives power loss; NORMAL: faster).",
        "FULL",
    )

    @classmethod
    def fields_doc(cls) -> dict[str, str]:
        """Field name -> its one-line description (for --help and the README)."""
        return {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}

    @classmethod
    def load(
        cls,
        config_file: str | Path | None = None,
        overrides: Mapping[str, Any] | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> Settings:
        """Build settings from defaults < TOML file < environment < ``overrides``.

        ``config_file`` None means ``$AGENTBUS_CONFIG`` or ``./agentbus.toml``
        when it exists. ``overrides`` with value None are ignored (unset flags).
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        path = config_file or env.get(ENV_PREFIX + "CONFIG")
        if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
            path = DEFAULT_CONFIG_FILE
        if path is not None:
            values.update(_scalars(read_toml(Path(path))))
        known = {f.name: f for f in dataclasses.fields(cls)}
        for name in known:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                values[name] = raw
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name] = value
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r} in {path}")
        converted = {name: _convert(name, known[name].type, v) for name, v in values.items()}
        settings = cls(**converted)
        settings.validate()
        return settings

    def validate(self) -> None:
        for name in ("lease_sec", "db_retry_sec"):
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ConfigError(f"setting {name} must be positive, got {getattr(self, name)}")
        if self.max_attempts < 1:
            raise ConfigError(f"setting max_attempts must be at least 1, got {self.max_attempts}")
        if self.sqlite_busy_timeout_ms < 0:
            raise ConfigError("setting sqlite_busy_timeout_ms must not be negative")
        if self.sqlite_synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ConfigError(
                f"setting sqlite_synchronous must be OFF, NORMAL, FULL or EXTRA, "
                f"got {self.sqlite_synchronous!r}"
            )

    def replace(self, **changes: Any) -> Settings:
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new


def read_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML config file, turning every problem into one ConfigError line."""
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None


def _scalars(doc: dict[str, Any]) -> dict[str, Any]:
    """The top-level non-table keys of a config file (tables are other sections)."""
    return {k: v for k, v in doc.items() if not isinstance(v, dict)}


def _convert(name: str, type_name: Any, value: Any) -> Any:
    kind = {"str": str, "float": float, "int": int, "bool": bool}[str(type_name)]
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is bool and isinstance(value, str):
        low = value.strip().lower()
        if low in {"1", "true", "yes", "on"}:
            return True
        if low in {"0", "false", "no", "off"}:
            return False
    elif kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    elif kind is int and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    elif kind is str and isinstance(value, str):
        return value
    raise ConfigError(f"setting {name} must be {kind.__name__}, got {value!r}")
