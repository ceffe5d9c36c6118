"""Which provider serves a model: made on first use, kept for the life of the process.

Model providers behind one small protocol: a call in, an ``Outcome`` out.

``simulated`` serves every ``sim/…`` model with scripted behaviour; ``openai``
speaks to any OpenAI-compatible chat-completions endpoint; ``command`` runs a
CLI agent. A provider never raises for a failed call — it returns an outcome
— except ``InvalidTask`` when the task itself cannot be run (a malformed
simulation script), which fails the task with that reason.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentbus.catalog import Catalog
from agentbus.providers.base import Provider

if TYPE_CHECKING:
    from agentbus.config import LiveConfig


class Providers:
    """Finds (and keeps) the provider that serves each model.

    Given a ``LiveConfig``, a reloaded catalog makes the providers anew (the old
    ones are closed) the next time a model is looked up.
    """

    def __init__(self, catalog: Catalog | LiveConfig, environ: Mapping[str, str]) -> None:
        self._source = catalog
        self.environ = environ
        self._made: dict[str, Provider] = {}
        self._made_for = catalog if isinstance(catalog, Catalog) else catalog.catalog

    @property
    def catalog(self) -> Catalog:
        source = self._source
        catalog = source if isinstance(source, Catalog) else source.catalog
        if catalog is not self._made_for and self._made:
            self.close()  # made from a catalog that was replaced since
        self._made_for = catalog
        return catalog

    def for_model(self, model: str) -> tuple[Provider, str]:
        """The provider of ``model`` and the name that provider knows it by."""
        config = self.catalog.model(model)
        if self.catalog.provider(config.provider).kind == "simulated":
            return self._get("", self._simulated), config.upstream
        return self._get(config.provider, self._configured), config.upstream

    def check(self, payload: Mapping[str, Any], chain: tuple[str, ...]) -> None:
        """Raise InvalidTask if the payload cannot drive this chain (before any call)."""
        from agentbus.providers.simulated import script_for

        for model in chain:
            config = self.catalog.model(model)
            if self.catalog.provider(config.provider).kind == "simulated":
                script_for(payload, model)

    def _get(self, name: str, make: Any) -> Provider:
        if name not in self._made:
            self._made[name] = make(name)
        return self._made[name]

    def _simulated(self, _name: str) -> Provider:
        from agentbus.providers.simulated import SimulatedProvider

        return SimulatedProvider(journal=self.environ.get("AGENTBUS_SIM_JOURNAL") or None)

    def _configured(self, name: str) -> Provider:
        config = self._made_for.providers[name]
        if config.kind == "openai":
            from agentbus.providers.openai import OpenAIProvider

            return OpenAIProvider(config, self.environ)
        from agentbus.providers.command import CommandProvider

        return CommandProvider(config, self.environ)

    def close(self) -> None:
        made, self._made = self._made, {}
        for provider in made.values():
            close = getattr(provider, "close", None)
            if close is not None:
                close()
