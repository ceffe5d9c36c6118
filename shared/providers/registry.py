"""Which provider serves a model: made on first use, kept for the life of the process.

Model providers behind one small protocol: a call in, an ``Outcome`` out.

``simulated`` serves every ``sim/…`` model with scripted behaviour; ``openai``
speaks to any OpenAI-compatible chat-completions endpoint; ``anthropic`` to
Anthropic's Messages API; ``command`` runs a CLI agent; ``python`` calls a
function of your own. A provider never raises
for a failed call — it returns an outcome — except ``InvalidTask`` when the
task itself cannot be run (a malformed simulation script or conversation),
which fails the task with that reason.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from agentbus.catalog import Catalog, ModelConfig
from agentbus.providers.base import Provider

if TYPE_CHECKING:
    from agentbus.config import LiveConfig


class Providers:
    """Finds (and keeps) the provider that serves each model.

    Given a ``LiveConfig``, a reloaded catalog makes the providers anew the next
    time a model is looked up. The old ones may still be in a call (a worker runs
    several at once): they are retired, and closed by ``close_retired`` once the
    worker has no call running, or by ``close``. Safe to share between threads.
    """

    def __init__(self, catalog: Catalog | LiveConfig, environ: Mapping[str, str]) -> None:
        self._source = catalog
        self.environ = environ
        self._made: dict[str, Provider] = {}
        self._retired: list[Provider] = []
        self._made_for = catalog if isinstance(catalog, Catalog) else catalog.catalog
        self._lock = threading.Lock()

    @property
    def catalog(self) -> Catalog:
        source = self._source
        catalog = source if isinstance(source, Catalog) else source.catalog
        if catalog is not self._made_for:
            with self._lock:  # made from a catalog that was replaced since
                self._retired.extend(self._made.values())
                self._made, self._made_for = {}, catalog
        return catalog

    def for_model(self, model: str) -> tuple[Provider, ModelConfig]:
        """The provider of ``model`` and the model's config (the name that provider
        knows it by, its default parameters)."""
        config = self.catalog.model(model)
        if self.catalog.provider(config.provider).kind == "simulated":
            return self._get("", self._simulated), config
        return self._get(config.provider, self._configured), config

    def check(self, payload: Mapping[str, Any], chain: tuple[str, ...]) -> None:
        """Raise InvalidTask if the payload cannot drive this chain (before any call)."""
        for model in chain:
            config = self.catalog.model(model)
            if self.catalog.provider(config.provider).kind == "simulated":
                from agentbus.providers.simulated import script_for

                script_for(payload, model)

    def _get(self, name: str, make: Any) -> Provider:
        made = self._made.get(name)
        if made is None:
            with self._lock:
                made = self._made.get(name)
                if made is None:
                    made = self._made[name] = make(name)
        return made

    def _simulated(self, _name: str) -> Provider:
        from agentbus.providers.simulated import SimulatedProvider

        return SimulatedProvider(journal=self.environ.get("AGENTBUS_SIM_JOURNAL") or None)

    def _configured(self, name: str) -> Provider:
        config = self._made_for.providers[name]
        if config.kind == "openai":
            from agentbus.providers.openai import OpenAIProvider

            return OpenAIProvider(config, self.environ)
        if config.kind == "anthropic":
            from agentbus.providers.anthropic import AnthropicProvider

            return AnthropicProvider(config, self.environ)
        if config.kind == "python":
            from agentbus.providers.python import PythonProvider

            return PythonProvider(config, self.environ)
        from agentbus.providers.command import CommandProvider

        return CommandProvider(config, self.environ)

    def close_retired(self) -> None:
        """Close the providers of a replaced catalog (call when none is in a call)."""
        with self._lock:
            retired, self._retired = self._retired, []
        _close(retired)

    def close(self) -> None:
        with self._lock:
            made, self._made = [*self._retired, *self._made.values()], {}
            self._retired = []
        _close(made)


def check_targets(catalog: Catalog) -> None:
    """Import every ``python`` provider's function now, and check that it can be called
    with the request: ConfigError, when the worker starts or a reloaded file is read,
    rather than at the first task."""
    from agentbus.providers.python import load

    for provider in catalog.providers.values():
        if provider.kind == "python" and provider.target is not None:
            load(provider.target, f"[providers.{provider.name}]")


def _close(providers: list[Provider]) -> None:
    for provider in providers:
        close = getattr(provider, "close", None)
        if close is not None:
            close()
