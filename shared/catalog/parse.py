"""Reading the catalog from the config file's tables, one clear ConfigError per problem."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from agentbus.catalog.model import (
    ANTHROPIC_URL,
    ANTHROPIC_VERSION,
    GROUP_ORDERS,
    HTTP_KINDS,
    NAME_RE,
    PROVIDER_KINDS,
    SIM_PROVIDER,
    AccountConfig,
    AgentConfig,
    CandidateSpec,
    Catalog,
    McpConfig,
    ModelConfig,
    ProviderConfig,
    RoleConfig,
    ToolConfig,
)
from agentbus.errors import ConfigError
from agentbus.providers import chat
from agentbus.providers.outcomes import FAILURE_NAMES as OUTCOME_NAMES

#: Tables of the config file that are the catalog, not settings.
SECTIONS = ("providers", "models", "roles", "agents", "bulkheads", "routing", "mcp", "schedules")
#: The limits of one account's windows: calls, then tokens (all, input, output) per window.
WINDOW_LIMITS = ("rpm", "tpm", "itpm", "otpm")
#: A model's own token windows, per account of its provider (OpenAI limits per model).
TOKEN_LIMITS = ("tpm", "itpm", "otpm")
_LIMITS = {"accounts", "concurrency", "circuit", "timeout_sec", *WINDOW_LIMITS}
_KEYS = {
    "openai": _LIMITS | {"kind", "base_url", "api_key_env"},
    "anthropic": _LIMITS | {"kind", "base_url", "api_key_env", "anthropic_version"},
    "command": _LIMITS | {"kind", "argv", "exit_codes", "stderr_patterns", "env"},
    "simulated": _LIMITS | {"kind"},
    "python": _LIMITS | {"kind", "target"},
}


def parse_catalog(doc: Mapping[str, Any]) -> Catalog:
    bulkheads = {}
    for name, size in _section(doc, "bulkheads", tables=False):
        bulkheads[name] = _count(size, f"[bulkheads] {name}")
    routing = dict(_section(doc, "routing", tables=False))
    _only(routing, "[routing]", {"default_role"})
    providers = {name: _provider(name, body) for name, body in _section(doc, "providers")}
    if SIM_PROVIDER in providers and providers[SIM_PROVIDER].kind != "simulated":
        raise ConfigError(f"[providers.{SIM_PROVIDER}]: this name is the simulated provider's")
    models = {}
    for model_id, body in _section(doc, "models"):
        where = f"[models.{model_id!r}]"
        _only(
            body,
            where,
            {
                "provider",
                "name",
                "bulkhead",
                "input_cost_per_1k",
                "output_cost_per_1k",
                "params",
                *TOKEN_LIMITS,
            },
        )
        provider = _known(body.get("provider"), providers, f"{where}: unknown provider")
        bulkhead = body.get("bulkhead")
        if bulkhead is not None:
            _known(bulkhead, bulkheads, f"{where}: unknown bulkhead", " (not in [bulkheads])")
        models[model_id] = ModelConfig(
            model_id,
            provider,
            _str(body, "name", where, model_id),
            bulkhead,
            _price(body, "input_cost_per_1k", where),
            _price(body, "output_cost_per_1k", where),
            _params(body, where),
            {key: _count(body[key], f"{where} {key}") for key in TOKEN_LIMITS if key in body},
        )
    catalog = Catalog(providers, models, bulkheads=bulkheads)
    roles = {name: _role(catalog, name, body) for name, body in _section(doc, "roles")}
    default_role = routing.get("default_role")
    if default_role is not None and default_role not in roles:
        raise ConfigError(f"[routing]: default_role {default_role!r} is not a configured role")
    for name, role in roles.items():
        if role.fallback is not None and role.fallback not in roles:
            raise ConfigError(f"[roles.{name}]: unknown fallback role {role.fallback!r}")
    for name in roles:
        _no_loop(roles, name)
    agents = {name: _agent(catalog, roles, name, body) for name, body in _section(doc, "agents")}
    mcp = _mcp(doc.get("mcp", {}), bulkheads)
    catalog = Catalog(providers, models, roles, agents, bulkheads, default_role, mcp)
    timetable = _section(doc, "schedules")
    if not timetable:
        return catalog
    from agentbus.catalog.schedules import parse_schedules  # APScheduler: only when needed

    return replace(catalog, schedules=parse_schedules(timetable, catalog))


#: The numbers of ``[mcp]``: how each is checked (counts are whole, at least 1 unless 0
#: means none; times are positive).
_MCP_COUNTS = {"client_rate": 0, "default_concurrency": 1, "circuit_consecutive_failures": 1}
_MCP_TIMES = {"client_rate_window_sec": False, "slot_wait_ms": True, "circuit_open_sec": False}


def _mcp(body: Any, bulkheads: Mapping[str, int]) -> McpConfig:
    if not isinstance(body, dict):
        raise ConfigError("[mcp] must be a table")
    _only(body, "[mcp]", {*_MCP_COUNTS, *_MCP_TIMES, "client_header", "tools"})
    values: dict[str, Any] = {}
    for key, least in _MCP_COUNTS.items():
        if key in body:
            value = body[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigError(f"[mcp] {key} must be a whole number of at least {least}")
            values[key] = value
    for key, zero in _MCP_TIMES.items():
        if key in body:
            time = body[key]
            if (
                isinstance(time, bool)
                or not isinstance(time, (int, float))
                or not math.isfinite(time)
                or not (time >= 0 if zero else time > 0)
            ):
                bound = "0 or more" if zero else "positive"
                raise ConfigError(f"[mcp] {key} must be a number, {bound}")
            values[key] = float(time)
    if "client_header" in body:
        header = _str(body, "client_header", "[mcp]")
        if not re.fullmatch(r"[A-Za-z0-9-]+", header):
            raise ConfigError("[mcp] client_header must be an HTTP header name")
        values["client_header"] = header.lower()
    tools = {}
    for name, entry in _section(body, "tools", where="[mcp.tools]"):
        where = f"[mcp.tools.{name}]"
        _only(entry, where, {"concurrency", "bulkhead"})
        if ("concurrency" in entry) == ("bulkhead" in entry):
            raise ConfigError(f"{where}: give either concurrency or bulkhead")
        if "bulkhead" in entry:
            pool = _known(
                entry["bulkhead"], bulkheads, f"{where}: unknown bulkhead", " (not in [bulkheads])"
            )
            tools[name] = ToolConfig(name, bulkhead=pool)
        else:
            tools[name] = ToolConfig(name, _count(entry["concurrency"], f"{where} concurrency"))
    return McpConfig(**values, tools=tools)


def _no_loop(roles: Mapping[str, RoleConfig], start: str) -> None:
    path = [start]
    current = roles[start].fallback
    while current is not None:
        if current in path:
            loop = " -> ".join([*path[path.index(current) :], current])
            raise ConfigError(f"[roles.{start}]: fallback roles loop ({loop})")
        path.append(current)
        current = roles[current].fallback


def _role(catalog: Catalog, name: str, body: Mapping[str, Any]) -> RoleConfig:
    where = f"[roles.{name}]"
    _only(body, where, {"models", "candidates", "fallback"})
    if ("models" in body) == ("candidates" in body):
        raise ConfigError(f"{where}: give either candidates or models")
    raw = body.get("candidates", body.get("models"))
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{where}: candidates must be a non-empty list")
    specs = []
    for entry in raw:
        if isinstance(entry, str):
            spec = CandidateSpec(entry)
        elif isinstance(entry, dict) and "models" not in body:
            _only(entry, f"{where} candidate", {"model", "account"})
            spec = CandidateSpec(
                _str(entry, "model", f"{where} candidate"),
                _str(entry, "account", f"{where} candidate") if "account" in entry else None,
            )
        else:
            raise ConfigError(f"{where}: each candidate is a model id or {{ model, account }}")
        if not catalog.knows(spec.model):
            raise ConfigError(f"{where}: unknown model {spec.model!r}")
        if spec.account is not None:
            provider = catalog.provider(catalog.model(spec.model).provider)
            if provider.account(spec.account) is None:
                raise ConfigError(
                    f"{where}: provider {provider.name!r} has no account {spec.account!r}"
                )
        specs.append(spec)
    if len(set(specs)) != len(specs):
        raise ConfigError(f"{where}: a candidate is listed twice")
    fallback = body.get("fallback")
    if fallback is not None and (not isinstance(fallback, str) or not NAME_RE.match(fallback)):
        raise ConfigError(f"{where}: fallback must be a role name")
    return RoleConfig(name, tuple(specs), fallback)


def _agent(
    catalog: Catalog, roles: Mapping[str, RoleConfig], name: str, body: Mapping[str, Any]
) -> AgentConfig:
    where = f"[agents.{name}]"
    _only(
        body,
        where,
        {"role", "models", "rate", "rate_window_sec", "share", "group_concurrency", "group_order"},
    )
    if ("role" in body) == ("models" in body):
        raise ConfigError(f"{where}: give either role or models")
    rate = _count(body["rate"], f"{where} rate") if "rate" in body else None
    window = body.get("rate_window_sec", 1.0)
    if (
        isinstance(window, bool)
        or not isinstance(window, (int, float))
        or not 0 < window < math.inf
    ):
        raise ConfigError(f"{where}: rate_window_sec must be a positive number")
    share = body.get("share", 1.0)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1e6:
        raise ConfigError(
            f"{where}: share must be a positive number below 1,000,000, got {share!r}"
        )
    groups = body.get("group_concurrency")
    if groups is not None:
        groups = _count(groups, f"{where} group_concurrency")
    order = body.get("group_order", "enqueue")
    if order not in GROUP_ORDERS:
        raise ConfigError(f"{where}: group_order must be 'enqueue' or 'any', got {order!r}")
    agent = AgentConfig(
        name,
        rate=rate,
        rate_window_sec=float(window),
        share=float(share),
        group_concurrency=groups,
        group_order=order,
    )
    if "role" in body:
        return replace(agent, role=_known(body["role"], roles, f"{where}: unknown role"))
    chain = body.get("models")
    if not isinstance(chain, list) or not chain or not all(isinstance(m, str) for m in chain):
        raise ConfigError(f"{where}: models must be a non-empty list of model ids")
    for model in chain:
        if not catalog.knows(model):
            raise ConfigError(f"{where}: unknown model {model!r}")
    if len(set(chain)) != len(chain):
        raise ConfigError(f"{where}: a model is listed twice")
    return replace(agent, models=tuple(chain))


def _provider(name: str, body: Mapping[str, Any]) -> ProviderConfig:
    where = f"[providers.{name}]"
    kind = body.get("kind")
    if kind not in PROVIDER_KINDS:
        raise ConfigError(f"{where}: kind must be one of {', '.join(PROVIDER_KINDS)}")
    _only(body, where, _KEYS[kind])
    timeout = body.get("timeout_sec")
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0
    ):
        raise ConfigError(f"{where}: timeout_sec must be a positive number")
    windows = _windows(body, where, {})
    concurrency = (
        _count(body["concurrency"], f"{where} concurrency") if "concurrency" in body else None
    )
    circuit = body.get("circuit", True)
    if not isinstance(circuit, bool):
        raise ConfigError(f"{where}: circuit must be true or false")
    accounts = _accounts(body, where, windows, needs_key=kind in HTTP_KINDS)
    common: dict[str, Any] = {
        "timeout_sec": timeout,
        "accounts": accounts,
        "concurrency": concurrency,
        "circuit": circuit,
    }
    if kind == "simulated":
        return ProviderConfig(name, kind, **common)
    if kind == "python":
        target = _str(body, "target", where, None)
        module, _, function = target.partition(":")
        if not (module and function) or not all(
            part.isidentifier() for part in [*module.split("."), *function.split(".")]
        ):
            raise ConfigError(f"{where}: target must look like package.module:function")
        return ProviderConfig(name, kind, target=target, **common)
    if kind in HTTP_KINDS:
        anthropic = kind == "anthropic"
        base_url = _str(body, "base_url", where, ANTHROPIC_URL if anthropic else None)
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(f"{where}: base_url must start with http:// or https://")
        if anthropic:
            common["anthropic_version"] = _str(body, "anthropic_version", where, ANTHROPIC_VERSION)
        return ProviderConfig(name, kind, base_url=base_url.rstrip("/"), **common)
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
    env = body.get("env", [])
    if not isinstance(env, list) or not all(
        isinstance(n, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in env
    ):
        raise ConfigError(f"{where}: env must be a list of environment variable names")
    return ProviderConfig(
        name,
        kind,
        argv=tuple(argv),
        exit_codes=codes,
        stderr_patterns=patterns,
        env=tuple(env),
        **common,
    )


def _windows(body: Mapping[str, Any], where: str, inherited: Mapping[str, int]) -> dict[str, int]:
    """The window limits ``body`` sets (``WINDOW_LIMITS``) over those it ``inherited``."""
    own = {key: _count(body[key], f"{where} {key}") for key in WINDOW_LIMITS if key in body}
    return {**inherited, **own}


def _accounts(
    body: Mapping[str, Any], where: str, windows: Mapping[str, int], *, needs_key: bool
) -> tuple[AccountConfig, ...]:
    """``[providers.X.accounts.NAME]`` tables, or the single account of ``api_key_env``;
    each with the provider's ``windows`` but those it sets itself."""
    if "api_key_env" in body and "accounts" in body:
        raise ConfigError(f"{where}: give accounts or api_key_env, not both")
    if "api_key_env" in body:
        return (AccountConfig("default", _env_name(body, "api_key_env", where), **windows),)
    table = body.get("accounts")
    if table is None:
        if needs_key:
            raise ConfigError(
                f"{where}: name the variable holding the key (api_key_env or accounts)"
            )
        return (AccountConfig("", None, **windows),)
    if not isinstance(table, dict) or not table:
        raise ConfigError(f"{where}: accounts must be a table of named accounts")
    accounts = []
    for name, account in table.items():
        at = f"{where} account {name!r}"
        if not NAME_RE.match(name) or not isinstance(account, dict):
            raise ConfigError(f"{at}: must be a named table")
        _only(account, at, {"key_env", *WINDOW_LIMITS})
        if needs_key and "key_env" not in account:
            raise ConfigError(f"{at}: key_env must name the variable holding its key")
        key_env = _env_name(account, "key_env", at) if "key_env" in account else None
        accounts.append(AccountConfig(name, key_env, **_windows(account, at, windows)))
    return tuple(accounts)


def _env_name(body: Mapping[str, Any], key: str, where: str) -> str:
    value = _str(body, key, where)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
        raise ConfigError(f"{where}: {key} must be the NAME of an environment variable")
    return value


def _section(
    doc: Mapping[str, Any], key: str, *, tables: bool = True, where: str | None = None
) -> list[tuple[str, Any]]:
    where = where or f"[{key}]"
    section = doc.get(key, {})
    if not isinstance(section, dict):
        raise ConfigError(f"{where} must be a table")
    for name, body in section.items():
        if not NAME_RE.match(name):
            raise ConfigError(f"{where}: invalid name {name!r}")
        if tables and not isinstance(body, dict):
            raise ConfigError(f"{where[:-1]}.{name}] must be a table")
    return list(section.items())


def _only(body: Mapping[str, Any], where: str, allowed: set[str]) -> None:
    extra = sorted(set(body) - allowed)
    if extra:
        raise ConfigError(f"{where}: unknown key {extra[0]!r}")


def _known(name: Any, known: Mapping[str, Any], unknown: str, hint: str = "") -> str:
    """``name`` when it names one of ``known`` (``unknown`` and ``hint`` say it does not)."""
    if not isinstance(name, str) or name not in known:
        raise ConfigError(f"{unknown} {name!r}{hint}")
    return name


def _str(body: Mapping[str, Any], key: str, where: str, default: str | None = None) -> str:
    value = body.get(key, default)
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: {key} must be a non-empty string")
    return value


def _count(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{where} must be a whole number of at least 1, got {value!r}")
    return value


def _params(body: Mapping[str, Any], where: str) -> dict[str, Any]:
    params = body.get("params", {})
    try:
        chat.check_params(params, f"{where} params")
    except chat.ChatError as exc:
        raise ConfigError(str(exc)) from None
    return dict(params)


def _price(body: Mapping[str, Any], key: str, where: str) -> float:
    value = body.get(key, 0.0)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ConfigError(f"{where}: {key} must be a non-negative number")
    return float(value)
