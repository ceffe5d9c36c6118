"""The model catalog: providers and their accounts, models, bulkheads, roles and agents.

``model`` holds the plain values; ``parse`` builds them from the config file's
tables, one ``ConfigError`` line per problem. ``parse`` imports ``model``, never
the other way round.
"""

from agentbus.catalog.model import (
    NAME_RE,
    AccountConfig,
    CandidateSpec,
    Catalog,
    ModelConfig,
    ProviderConfig,
)
from agentbus.catalog.parse import SECTIONS, parse_catalog

__all__ = [
    "NAME_RE",
    "SECTIONS",
    "AccountConfig",
    "CandidateSpec",
    "Catalog",
    "ModelConfig",
    "ProviderConfig",
    "parse_catalog",
]
