"""A CLI agent as a model: argv from config, the prompt on stdin, the answer on stdout.

The program runs with a minimal environment: ``PATH``, ``HOME``, ``LANG``, the
variables its config lists in ``env``, and its own accounts' key variables —
never the database URL or another provider's key. What it prints is masked.

A non-zero exit is mapped by ``exit_codes`` first, then by the first of
``stderr_patterns`` that matches; anything else is a retryable failure.
"""

from __future__ import annotations

import subprocess
from collections.abc import Mapping

from agentbus import masking
from agentbus.catalog import ProviderConfig
from agentbus.providers import CallRequest
from agentbus.providers.outcomes import (
    FAILURE_NAMES,
    Failed,
    Outcome,
    Succeeded,
    TimedOut,
    failure_named,
)

#: What a CLI agent gets of the worker's environment besides what its config lists.
BASE_ENV = ("PATH", "HOME", "LANG")
DETAIL_CHARS = 300


class CommandProvider:
    def __init__(self, config: ProviderConfig, environ: Mapping[str, str]) -> None:
        self.config = config
        # A minimal environment: never the database URL or other providers' keys.
        names = {*BASE_ENV, *config.env, *(a.key_env for a in config.accounts if a.key_env)}
        self._env = {name: environ[name] for name in sorted(names) if name in environ}
        masking.register(environ.get(a.key_env) for a in config.accounts if a.key_env)

    def call(self, request: CallRequest) -> Outcome:
        timeout = self.config.timeout_sec or request.timeout_sec
        argv = [
            arg.replace("{model}", request.upstream or request.model) for arg in self.config.argv
        ]
        try:
            done = subprocess.run(
                argv,
                input=request.prompt,
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
                check=False,
                env=self._env,
            )
        except subprocess.TimeoutExpired:
            return TimedOut(f"{self.config.name}: no answer within {timeout:g}s")
        except OSError as exc:
            return Failed(
                f"{self.config.name}: cannot run {argv[0]!r}: {exc.strerror}", retryable=False
            )
        if done.returncode == 0:
            return Succeeded(masking.mask(done.stdout.strip()))
        last = masking.mask((done.stderr.strip().splitlines() or [""])[-1])[:DETAIL_CHARS]
        detail = f"{self.config.name}: exit {done.returncode}: {last}".rstrip(": ")
        if done.returncode in self.config.exit_codes:
            return failure_named(self.config.exit_codes[done.returncode], detail)
        for name in FAILURE_NAMES:
            pattern = self.config.stderr_patterns.get(name)
            if pattern is not None and pattern.search(done.stderr):
                return failure_named(name, detail)
        return Failed(detail, retryable=True)
