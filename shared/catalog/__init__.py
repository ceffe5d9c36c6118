"""The model catalog: providers and their accounts, models, bulkheads, roles and agents.

``model`` holds the plain values; ``parse`` builds them from the config file's
tables, one ``ConfigError`` line per problem. ``parse`` imports ``model``, never
the other way round.
"""

from agentbus.catalog.model import (
    IMPLICIT_SIM,
    NAME_RE,
    PROVIDER_KINDS,
    SIM_PROVIDER,
    SIMULATED_PREFIX,
    AccountConfig,
    AgentConfig,
    CandidateSpec,
    Catalog,
    ModelConfig,
    ProviderConfig,
    RoleConfig,
)
from agentbus.catalog.parse import SECTIONS, parse_catalog

__all__ = [
    "IMPLICIT_SIM",
    "NAME_RE",
    "PROVIDER_KINDS",
    "SECTIONS",
    "SIMULATED_PREFIX",
    "SIM_PROVIDER",
    "AccountConfig",
    "AgentConfig",
    "CandidateSpec",
    "Catalog",
    "ModelConfig",
    "ProviderConfig",
    "RoleConfig",
    "parse_catalog",
]
