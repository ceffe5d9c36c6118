"""The config of a process: its settings (``agentbus.settings``) and its model catalog
(``agentbus.catalog``), read from one TOML file; ``LiveConfig`` reloads it when the
file changes."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from agentbus import masking
from agentbus.catalog import Catalog, parse_catalog
from agentbus.errors import ConfigError
from agentbus.logging import get_logger
from agentbus.settings import (
    DEFAULT_CONFIG_FILE,
    ENV_PREFIX,
    POOLERS,
    Settings,
    check_budget_mode,
    convert,
)
from agentbus.tomlfile import DEFAULT_CONFIG_MAX_BYTES, read_toml

# What the modules of agentbus import from here, wherever it is defined.
__all__ = [
    "POOLERS",
    "Config",
    "Configured",
    "LiveConfig",
    "Settings",
    "check_budget_mode",
    "config_path",
    "load_config",
]

log = get_logger("agentbus.config")


@dataclass(frozen=True)
class Config:
    """Everything a process is configured with: settings and the model catalog, and how
    they were read (so that ``reload`` reads the file again with the same flags)."""

    settings: Settings
    catalog: Catalog
    path: Path | None
    overrides: Mapping[str, Any] | None = field(default=None, compare=False, repr=False)
    environ: Mapping[str, str] | None = field(default=None, compare=False, repr=False)

    def reload(self) -> Config:
        """The config file read again, with the flags and environment of the first read."""
        return load_config(self.path, self.overrides, self.environ)


class Configured(Protocol):
    """What a component reads its config from: a ``LiveConfig``, or a view derived from
    one (``agentbus.admission.tools.ToolView``)."""

    @property
    def settings(self) -> Settings: ...

    @property
    def catalog(self) -> Catalog: ...


class LiveConfig:
    """The config of a long-running process, reloaded when its file changes.

    Every component (admission, the runner, the providers, the sweeper) reads
    ``settings`` and ``catalog`` from here when it needs them, so ``refresh``
    swaps a reloaded config in at one place and everyone sees it whole. The
    file is looked at every ``config_check_sec`` (its time and size); one that
    no longer reads is reported and the running config kept.
    """

    def __init__(
        self, config: Config, *, watch: bool = True, check: Callable[[Config], None] | None = None
    ) -> None:
        """``check``: what a reloaded config must pass besides reading (a worker imports
        its python models' functions); one that raises ConfigError is not taken."""
        self.config = config
        self.check = check
        self.watch = watch and config.path is not None
        self._seen = _stamp(config.path)
        self._checked = time.monotonic()

    @classmethod
    def fixed(cls, settings: Settings | None = None, catalog: Catalog | None = None) -> LiveConfig:
        """A config that never reloads (tests, benchmarks, one-shot commands)."""
        return cls(Config(settings or Settings(), catalog or Catalog(), None), watch=False)

    @property
    def settings(self) -> Settings:
        return self.config.settings

    @property
    def catalog(self) -> Catalog:
        return self.config.catalog

    def refresh(self) -> bool:
        """Reload the file if it changed since the last look; True when a new config is in."""
        now = time.monotonic()
        if not self.watch or now - self._checked < self.settings.config_check_sec:
            return False
        self._checked = now
        stamp = _stamp(self.config.path)
        if stamp == self._seen:
            return False
        self._seen = stamp
        try:
            reloaded = self.config.reload()
            if self.check is not None:
                self.check(reloaded)
            self.config = reloaded
        except ConfigError as exc:
            log.error("config_reload_failed", path=str(self.config.path), error=exc.message)
            return False
        log.info("config_reloaded", path=str(self.config.path))
        return True


def _stamp(path: Path | None) -> tuple[int, int] | None:
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size)


def config_path(config_file: str | Path | None, env: Mapping[str, str]) -> Path | None:
    """The config file in use: the flag, else $AGENTBUS_CONFIG, else ./agentbus.toml if any."""
    path = config_file or env.get(ENV_PREFIX + "CONFIG") or None
    if path is None and Path(DEFAULT_CONFIG_FILE).is_file():
        path = DEFAULT_CONFIG_FILE
    return Path(path) if path is not None else None


def load_config(
    config_file: str | Path | None = None,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Config:
    """Read the config file once and build the settings and the catalog from it."""
    env = os.environ if environ is None else environ
    path = config_path(config_file, env)
    limit = convert("config_max_bytes", "int", env.get(ENV_PREFIX + "CONFIG_MAX_BYTES") or 0)
    doc = read_toml(path, limit or DEFAULT_CONFIG_MAX_BYTES) if path is not None else {}
    try:
        catalog = parse_catalog(doc)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc.message}") from None
    settings = Settings.from_doc(doc, path, overrides, env)
    masking.register_config(catalog, env, settings.database_url)
    if settings.listen_url:
        masking.register_config(catalog, env, settings.listen_url)
    return Config(settings, catalog, path, overrides, environ)
