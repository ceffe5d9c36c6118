"""The model catalog: providers and their accounts, models, roles and agents.

Read from the tables of the config file (``agentbus.example.toml`` documents
every key)::

    [providers.openai-main]          # kind = "openai" | "anthropic" | "command" | "python"
                                     #        | "simulated"
    kind = "openai"
    base_url = "https://api.openai.com/v1"
    concurrency = 20                 # calls in flight, shared by its accounts
    rpm = 500                        # per account, on a sliding 60 s window
    tpm = 200000                     # tokens per minute per account (itpm, otpm: input,
                                     # output tokens alone), on the same window
    [providers.openai-main.accounts.team-a]
    key_env = "OPENAI_KEY_A"         # the NAME of the variable holding the key

    [models."gpt-4o"]
    provider = "openai-main"
    bulkhead = "heavy"
    tpm = 30000000                   # its own window per account (OpenAI limits per model)
    params = { temperature = 0.2 }   # sent with every call; a task's params win

    [bulkheads]
    heavy = 10

    [roles.coder]
    candidates = ["gpt-4o", { model = "sim/backup" }]
    fallback = "general"

    [agents.codex]
    role = "coder"                   # or: models = [...]
    rate = 50                        # calls per rate_window_sec (1 s)
    share = 2                        # its part of a contended account's windows (default 1)

    [routing]
    default_role = "general"         # for tasks that name a role not configured

    [mcp]                            # the tools/call of MCP servers under agentbus.mcp.govern
    client_rate = 50                 # calls per client per client_rate_window_sec (0: none)
    [mcp.tools.export_report]
    concurrency = 2                  # or: bulkhead = "heavy", a pool of [bulkheads]

Model ids that start with ``sim/`` and are not listed belong to the simulated
provider ``sim`` (unlimited unless ``[providers.sim]`` sets limits). Every
problem is one ConfigError naming where it is (``agentbus.catalog.parse``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from agentbus.errors import ConfigError

#: What a name of an agent, model, role or account may look like.
NAME_RE = re.compile(r"\A[A-Za-z0-9][A-Za-z0-9_.:/@+-]{0,127}\Z")
SIMULATED_PREFIX = "sim/"
SIM_PROVIDER = "sim"
PROVIDER_KINDS = ("openai", "anthropic", "command", "python", "simulated")
#: The kinds that speak HTTP to an endpoint with a key.
HTTP_KINDS = ("openai", "anthropic")
#: Where an Anthropic provider without ``base_url`` sends its calls.
ANTHROPIC_URL = "https://api.anthropic.com"
ANTHROPIC_VERSION = "2023-06-01"  # the anthropic-version header unless the config says


@dataclass(frozen=True)
class AccountConfig:
    name: str  # "" for a provider without named accounts
    key_env: str | None = None  # None: the account needs no key
    rpm: int | None = None
    # Tokens per rpm window (60 s): input and output together, input alone, output alone.
    tpm: int | None = None
    itpm: int | None = None
    otpm: int | None = None

    @property
    def token_limits(self) -> dict[str, int]:
        """The account's token windows that are configured: gate -> tokens per window."""
        limits = {"tpm": self.tpm, "itpm": self.itpm, "otpm": self.otpm}
        return {gate: limit for gate, limit in limits.items() if limit}


@dataclass(frozen=True)
class ProviderConfig:
    name: str
    kind: str
    base_url: str | None = None
    argv: tuple[str, ...] = ()
    timeout_sec: float | None = None
    exit_codes: Mapping[int, str] = field(default_factory=dict)
    stderr_patterns: Mapping[str, re.Pattern[str]] = field(default_factory=dict)
    accounts: tuple[AccountConfig, ...] = (AccountConfig(""),)
    concurrency: int | None = None
    circuit: bool = True
    env: tuple[str, ...] = ()  # variables a command provider's program also gets
    anthropic_version: str = ANTHROPIC_VERSION  # the anthropic-version header (kind anthropic)
    target: str | None = None  # package.module:function (kind python)

    @property
    def endpoint(self) -> str:
        """What the circuit breaker is keyed by besides the name: an edited one starts fresh."""
        return self.base_url or " ".join(self.argv) or self.target or self.kind

    def account(self, name: str) -> AccountConfig | None:
        return next((a for a in self.accounts if a.name == name), None)


#: The provider of unlisted ``sim/`` models when the config does not set one up.
IMPLICIT_SIM = ProviderConfig(SIM_PROVIDER, "simulated", circuit=False)


@dataclass(frozen=True)
class ModelConfig:
    id: str
    provider: str
    upstream: str  # the name the provider knows the model by
    bulkhead: str | None = None
    input_cost_per_1k: float = 0.0
    output_cost_per_1k: float = 0.0
    # Defaults a task's params override (not part of the hash: a dict).
    params: Mapping[str, Any] = field(default_factory=dict, hash=False)
    # Its own token windows through each account of its provider (tpm, itpm, otpm).
    token_limits: Mapping[str, int] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class CandidateSpec:
    """One entry of a role: a model, optionally pinned to one account of its provider."""

    model: str
    account: str | None = None


@dataclass(frozen=True)
class RoleConfig:
    name: str
    candidates: tuple[CandidateSpec, ...]
    fallback: str | None = None


@dataclass(frozen=True)
class AgentConfig:
    name: str
    role: str | None = None
    models: tuple[str, ...] = ()
    rate: int | None = None  # calls per rate_window_sec, across every worker of the agent
    rate_window_sec: float = 1.0
    # Its part of a provider account's windows when agents contend for them: at least
    # share / the shares of every agent waiting for the account (work-conserving).
    share: float = 1.0
    # Tasks of one group (a conversation) that may run at once (None: any number), and
    # whether a paused or retrying one keeps its group's turn ("enqueue") or not ("any").
    group_concurrency: int | None = None
    group_order: str = "enqueue"


#: The orders of a group's turns (``[agents.X] group_order``).
GROUP_ORDERS = ("enqueue", "any")


@dataclass(frozen=True)
class ToolConfig:
    """One entry of ``[mcp.tools]``: its own concurrency, or a pool of ``[bulkheads]``."""

    name: str
    concurrency: int | None = None
    bulkhead: str | None = None


@dataclass(frozen=True)
class McpConfig:
    """``[mcp]``: how governed MCP servers admit ``tools/call`` (``agentbus.mcp``)."""

    client_rate: int = 50  # calls per client per window (0: no window)
    client_rate_window_sec: float = 1.0
    default_concurrency: int = 20  # a tool without an entry in ``tools``
    slot_wait_ms: float = 100.0  # wait this long for a slot, then refuse
    circuit_consecutive_failures: int = 5
    circuit_open_sec: float = 30.0
    client_header: str | None = None  # streamable HTTP: the header naming the client
    tools: Mapping[str, ToolConfig] = field(default_factory=dict)


@dataclass(frozen=True)
class Catalog:
    providers: Mapping[str, ProviderConfig] = field(default_factory=dict)
    models: Mapping[str, ModelConfig] = field(default_factory=dict)
    roles: Mapping[str, RoleConfig] = field(default_factory=dict)
    agents: Mapping[str, AgentConfig] = field(default_factory=dict)
    bulkheads: Mapping[str, int] = field(default_factory=dict)
    default_role: str | None = None  # what a task naming an unconfigured role runs as
    mcp: McpConfig = field(default_factory=McpConfig)
    # name -> agentbus.catalog.schedules.ScheduleConfig: tasks the sweeper enqueues on time
    schedules: Mapping[str, Any] = field(default_factory=dict)

    def knows(self, model: str) -> bool:
        return model.startswith(SIMULATED_PREFIX) or model in self.models

    def key_variables(self) -> tuple[str, ...]:
        """The environment variables the accounts take their keys from, sorted."""
        return tuple(
            sorted(
                {
                    account.key_env
                    for provider in self.providers.values()
                    for account in provider.accounts
                    if account.key_env
                }
            )
        )

    def model(self, model_id: str) -> ModelConfig:
        """The model's config; an unlisted ``sim/`` model belongs to the ``sim`` provider."""
        found = self.models.get(model_id)
        if found is not None:
            return found
        if model_id.startswith(SIMULATED_PREFIX):
            return _simulated_model(model_id)
        raise ConfigError(f"unknown model {model_id!r} (not sim/… and not in [models])")

    def model_token_limits(self, model_id: str) -> Mapping[str, int]:
        """A model's own token windows (none for a model not in [models]: a ``sim/`` one,
        an MCP tool's)."""
        found = self.models.get(model_id)
        return found.token_limits if found is not None else {}

    def provider(self, name: str) -> ProviderConfig:
        if name == SIM_PROVIDER and name not in self.providers:
            return IMPLICIT_SIM
        return self.providers[name]

    def role_chain(self, role: str) -> list[tuple[RoleConfig, str | None]]:
        """A role and the roles its fallbacks lead to, each with the role it fell back from."""
        origin: str | None = None
        if role not in self.roles:
            if self.default_role is None:
                raise ConfigError(f"unknown role {role!r}")
            origin, role = role, self.default_role  # [routing] default_role
        chain: list[tuple[RoleConfig, str | None]] = []
        current: str | None = role
        while current is not None and all(r.name != current for r, _ in chain):
            config = self.roles[current]
            chain.append((config, origin))
            origin, current = current, config.fallback
        return chain


@functools.lru_cache(maxsize=256)
def _simulated_model(model_id: str) -> ModelConfig:
    """An unlisted ``sim/`` model's config (a frozen value: made once per name)."""
    return ModelConfig(model_id, SIM_PROVIDER, model_id)
