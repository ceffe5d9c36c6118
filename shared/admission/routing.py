"""Which candidates a task may run on, in order: ``resolve`` takes no slot and writes nothing.

A candidate is a model through one account of its provider. A role's entry
without a pinned account expands to every account of the provider, in the
order configured: the first is preferred, the next takes over when the first
is limited, cooling or refused. Fallback roles follow their role. Accounts
whose key variable is unset, or whose credential was refused under the
current config, are left out with the reason (they do not come back by
waiting, so they never pause a task).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from agentbus.catalog import AccountConfig, CandidateSpec, Catalog, ProviderConfig
from agentbus.errors import ConfigError


@dataclass(frozen=True)
class Candidate:
    model: str
    provider: str
    account: str  # "" when the provider has no named accounts
    upstream: str
    role: str | None = None
    fallback_from: str | None = None
    bulkhead: str | None = None

    @property
    def key(self) -> str:
        """The candidate's name in cooldowns and pauses: ``model`` or ``model@account``."""
        return f"{self.model}@{self.account}" if self.account else self.model


@dataclass(frozen=True)
class Route:
    """One routing decision, a row of ``route_log``: a candidate a worker considered for a
    task under one claim, and what came of it (recorded with the settle it led to)."""

    task_id: int
    claim_token: int
    agent: str
    model: str
    decision: str  # call | skip (cooling) | refuse (a gate)
    at: float
    worker: str | None = None
    outcome: str | None = None  # a call's outcome name (agentbus.providers.outcomes)
    cooldown_until: float | None = None  # seen (skip) or set (call)
    role: str | None = None
    fallback_from: str | None = None
    provider: str | None = None
    account: str | None = None
    code: str | None = None  # a refusal's code
    retry_after: float | None = None  # when the refusing gate admits again
    gates: Mapping[str, Any] | None = None
    refusal: Mapping[str, Any] | None = None  # the refusal as clients see it (Refusal.as_dict)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost: float | None = None

    def row(self) -> dict[str, Any]:
        # A shallow copy of the fields, which are all the instance holds: dataclasses.asdict
        # deep-copies every value (a tenth of a worker's CPU per task, measured), and
        # reading each field by name costs 2 µs a row more than copying them at once.
        out = self.__dict__.copy()
        out["gates"] = dict(self.gates) if self.gates is not None else None
        out["refusal"] = dict(self.refusal) if self.refusal is not None else None
        return out


@dataclass(frozen=True)
class Resolution:
    candidates: tuple[Candidate, ...]
    left_out: tuple[str, ...] = field(default=())  # "model@account: why", for a failure's reason


def resolve(
    catalog: Catalog,
    *,
    models: tuple[str, ...] | None,
    role: str | None,
    agent: str,
    environ: Mapping[str, str] | None,
    unusable: Collection[tuple[str, str, str]] = (),
) -> Resolution:
    """The candidates of a task: its own models, else its role's, else its agent's.

    ``environ`` None skips the credential check (the sweeper need not hold
    keys). ``unusable`` holds (provider, account, fingerprint) of refused
    credentials. Raises ConfigError for an unknown role or model.
    """
    entries: list[tuple[CandidateSpec, str | None, str | None]] = []
    if models:
        entries = [(CandidateSpec(m), None, None) for m in models]
    else:
        if role is None and agent in catalog.agents and catalog.agents[agent].models:
            entries = [(CandidateSpec(m), None, None) for m in catalog.agents[agent].models]
        else:
            name = (
                role
                if role is not None
                else catalog.agents[agent].role
                if agent in catalog.agents
                else None
            )
            if name is None:
                raise ConfigError(
                    f"no model chain for agent {agent!r}: give the task --models "
                    f"or --role, or configure [agents.{agent}]"
                )
            for config, origin in catalog.role_chain(name):
                entries += [(spec, config.name, origin) for spec in config.candidates]
    out: dict[str, Candidate] = {}
    left_out: list[str] = []
    for spec, role_name, origin in entries:
        model = catalog.model(spec.model)
        provider = catalog.provider(model.provider)
        accounts = provider.accounts
        if spec.account is not None:
            accounts = tuple(a for a in accounts if a.name == spec.account)
        for account in accounts:
            candidate = Candidate(
                model.id,
                provider.name,
                account.name,
                model.upstream,
                role_name,
                origin,
                model.bulkhead,
            )
            if candidate.key in out:
                continue
            why = _unusable_because(provider, account, environ, unusable)
            if why is not None:
                left_out.append(f"{candidate.key}: {why}")
                continue
            out[candidate.key] = candidate
    return Resolution(tuple(out.values()), tuple(dict.fromkeys(left_out)))


class KeptResolutions:
    """``resolve`` with its answers kept: a worker resolves the same few chains for every
    task. An answer holds while the catalog and the set of refused credentials are the
    same objects (whoever changes either replaces it) and the key variables the catalog
    names have the same values."""

    MAX = 256  # chains kept for one catalog (a worker runs a few)

    def __init__(self) -> None:
        self._for: tuple[Catalog | None, Collection[Any] | None] = (None, None)
        self._variables: tuple[str, ...] = ()
        self._answers: dict[tuple[Any, ...], Resolution] = {}

    def resolve(
        self,
        catalog: Catalog,
        *,
        models: tuple[str, ...] | None,
        role: str | None,
        agent: str,
        environ: Mapping[str, str] | None,
        unusable: Collection[tuple[str, str, str]],
    ) -> Resolution:
        if self._for[0] is not catalog or self._for[1] is not unusable:
            self._for, self._variables, self._answers = (
                (catalog, unusable),
                catalog.key_variables(),
                {},
            )
        keys = None if environ is None else tuple(environ.get(v) for v in self._variables)
        asked = (models, role, agent, keys)
        found = self._answers.get(asked)
        if found is None:
            found = resolve(
                catalog, models=models, role=role, agent=agent, environ=environ, unusable=unusable
            )
            if len(self._answers) < self.MAX:
                self._answers[asked] = found
        return found


def check_task(
    catalog: Catalog | None, *, agent: str, models: tuple[str, ...] | None, role: str | None
) -> None:
    """Refuse at enqueue, with one line, a task its config says cannot run: an unknown
    agent (when the config names agents), role or model, or no chain at all.

    ``catalog`` None means no config file was loaded: then only an explicit chain
    or role is accepted, as nothing says what the agent's chain is.
    """
    if catalog is None:
        if models is None and role is None:
            raise ConfigError(
                "a task needs a model chain (--models) or a role (--role); with a config "
                "file (--config, AGENTBUS_CONFIG or ./agentbus.toml) its agent's chain applies"
            )
        return
    if catalog.agents and agent not in catalog.agents:
        raise ConfigError(
            f"unknown agent {agent!r}: the config names {', '.join(sorted(catalog.agents))}"
        )
    resolve(catalog, models=models, role=role, agent=agent, environ=None)


def fingerprint(
    provider: ProviderConfig, account: AccountConfig, environ: Mapping[str, str]
) -> str:
    """What an account's credential is under the current config (changes when it does).

    A short hash of endpoint, key variable and key: stored, it tells a refused
    credential from its replacement without storing the key.
    """
    key = environ.get(account.key_env, "") if account.key_env else ""
    text = "\0".join((provider.endpoint, account.key_env or "", key))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _unusable_because(
    provider: ProviderConfig,
    account: AccountConfig,
    environ: Mapping[str, str] | None,
    unusable: Collection[tuple[str, str, str]],
) -> str | None:
    if environ is None:
        return None
    if account.key_env and not environ.get(account.key_env):
        return f"no credentials (${account.key_env} is not set)"
    refused = any(p == provider.name and a == account.name for p, a, _ in unusable)
    if (
        refused
        and (provider.name, account.name, fingerprint(provider, account, environ)) in unusable
    ):
        return "credential refused (unusable until the account's config changes)"
    return None
