"""The model catalog: providers, the models they serve, and the chains of roles and agents.

Read from the tables of the config file::

    [providers.openai-main]          # kind = "openai" | "command"
    kind = "openai"
    base_url = "https://api.openai.com/v1"
    api_key_env = "OPENAI_API_KEY"   # the NAME of the variable holding the key

    [models."gpt-4o"]
    provider = "openai-main"

    [roles.coder]
    models = ["gpt-4o", "sim/backup"]

    [agents.codex]
    role = "coder"                   # or: models = [...]

Model ids that start with ``sim/`` are the simulated provider's and need no
entry. Every problem is one ConfigError naming where it is.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.errors import ConfigError
from shared.tasks import NAME_RE

SIMULATED_PREFIX = "sim/"
PROVIDER_KINDS = ("openai", "command")
OUTCOME_NAMES = ("rate_limited", "overloaded", "timeout", "auth", "retryable", "permanent")


@dataclass(frozen=True)
class ProviderConfig:
    name: str
    kind: str
    base_url: str | None = None
    api_key_env: str | None = None
    argv: tuple[str, ...] = ()
    timeout_sec: float | None = None
    exit_codes: Mapping[int, str] = field(default_factory=dict)
    stderr_patterns: Mapping[str, re.Pattern[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class ModelConfig:
    id: str
    provider: str
    upstream: str  # the name the provider knows the model by


@dataclass(frozen=True)
class Catalog:
    providers: Mapping[str, ProviderConfig] = field(default_factory=dict)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    roles: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    agents: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def knows(self, model: str) -> bool:
        return model.startswith(SIMULATED_PREFIX) or model in self.models

    def chain_for(
        self, *, models: tuple[str, ...] | None, role: str | None, agent: str
    ) -> tuple[str, ...]:
        """The model chain of a task: its own list, else its role's, else its agent's.

        Raises ConfigError (which fails the task with that reason) when there
        is none or a model is unknown.
        """
        if models:
            chain = models
        elif role is not None:
            if role not in self.roles:
                raise ConfigError(f"unknown role {role!r}")
            chain = self.roles[role]
        elif agent in self.agents:
            chain = self.agents[agent]
        else:
            raise ConfigError(
                f"no model chain for agent {agent!r}: give the task --models "
                f"or --role, or configure [agents.{agent}]"
            )
        unknown = [m for m in chain if not self.knows(m)]
        if unknown:
            raise ConfigError(f"unknown model {unknown[0]!r} (not sim/… and not in [models])")
        return chain

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> Catalog:
        providers = {name: _provider(name, body) for name, body in _table(doc, "providers")}
        models = {}
        for model_id, body in _table(doc, "models"):
            where = f"[models.{model_id!r}]"
            _only(body, where, {"provider", "name"})
            provider = body.get("provider")
            if provider not in providers:
                raise ConfigError(f"{where}: unknown provider {provider!r}")
            models[model_id] = ModelConfig(model_id, provider, _str(body, "name", where, model_id))
        catalog = cls(providers, models)
        roles = {
            name: _chain(catalog, body, f"[roles.{name}]") for name, body in _table(doc, "roles")
        }
        agents = {}
        for name, body in _table(doc, "agents"):
            where = f"[agents.{name}]"
            if ("role" in body) == ("models" in body):
                raise ConfigError(f"{where}: give either role or models")
            if "role" in body:
                _only(body, where, {"role"})
                if body["role"] not in roles:
                    raise ConfigError(f"{where}: unknown role {body['role']!r}")
                agents[name] = roles[body["role"]]
            else:
                agents[name] = _chain(catalog, body, where)
        return cls(providers, models, roles, agents)


def _table(doc: Mapping[str, Any], key: str) -> list[tuple[str, Mapping[str, Any]]]:
    section = doc.get(key, {})
    if not isinstance(section, dict):
        raise ConfigError(f"[{key}] must be a table")
    for name, body in section.items():
        if not NAME_RE.match(name):
            raise ConfigError(f"[{key}]: invalid name {name!r}")
        if not isinstance(body, dict):
            raise ConfigError(f"[{key}.{name}] must be a table")
    return list(section.items())


def _only(body: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r}")


def _str(body: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {key} must be a non-empty string")
    return value


def _chain(catalog: Catalog, body: Mapping[str, Any], where: str) -> tuple[str, ...]:
    _only(body, where, {"models"})
    chain = body.get("models")
    if not isinstance(chain, list) or not chain or not all(isinstance(m, str) for m in chain):
        raise ConfigError(f"{where}: models must be a non-empty list of model ids")
    for model in chain:
        if not catalog.knows(model):
            raise ConfigError(f"{where}: unknown model {model!r}")
    if len(set(chain)) != len(chain):
        raise ConfigError(f"{where}: a model is listed twice")
    return tuple(chain)


def _provider(name: str, body: Mapping[str, Any]) -> ProviderConfig:
    where = f"[providers.{name}]"
    kind = body.get("kind")
    if kind not in PROVIDER_KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(PROVIDER_KINDS)}")
    timeout = body.get("timeout_sec")
    if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
        raise ConfigError(f"{where}: timeout_sec must be a positive number")
    if kind == "openai":
        _only(body, where, {"kind", "base_url", "api_key_env", "timeout_sec"})
        base_url = _str(body, "base_url", where)
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}: base_url must start with http:// or https://")
        return ProviderConfig(
            name,
            kind,
            base_url=base_url.rstrip("/"),
            api_key_env=_str(body, "api_key_env", where),
            timeout_sec=timeout,
        )
    _only(body, where, {"kind", "argv", "timeout_sec", "exit_codes", "stderr_patterns"})
    argv = body.get("argv")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ConfigError(f"{where}: argv must be a non-empty list of strings")
    codes: dict[int, str] = {}
    for code, outcome in dict(body.get("exit_codes", {})).items():
        if not str(code).lstrip("-").isdigit() or outcome not in OUTCOME_NAMES:
            raise ConfigError(
                f"{where}: exit_codes maps an exit code to one of {', '.join(OUTCOME_NAMES)}"
            )
        codes[int(code)] = outcome
    patterns: dict[str, re.Pattern[str]] = {}
    for outcome, pattern in dict(body.get("stderr_patterns", {})).items():
        if outcome not in OUTCOME_NAMES or not isinstance(pattern, str):
            raise ConfigError(
                f"{where}: stderr_patterns maps one of {', '.join(OUTCOME_NAMES)} "
                "to a regular expression"
            )
        try:
            patterns[outcome] = re.compile(pattern, re.IGNORECASE)
        except re.error as exc:
            raise ConfigError(f"{where}: stderr_patterns.{outcome} is not a regex: {exc}") from None
    return ProviderConfig(
        name,
        kind,
        argv=tuple(argv),
        timeout_sec=timeout,
        exit_codes=codes,
        stderr_patterns=patterns,
    )
