"""A CLI agent as a model: argv from config, the prompt on stdin, the answer on stdout.

A non-zero exit is mapped by ``exit_codes`` first, then by the first of
``stderr_patterns`` that matches; anything else is a retryable failure.
"""

from __future__ import annotations

import subprocess

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


class CommandProvider:
    def __init__(self, config: ProviderConfig) -> None:
        self.config = config

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
                timeout=timeout,
                check=False,
            )
        except subprocess.TimeoutExpired:
            return TimedOut(f"{self.config.name}: no answer within {timeout:g}s")
        except OSError as exc:
            return Failed(
                f"{self.config.name}: cannot run {argv[0]!r}: {exc.strerror}", retryable=False
            )
        if done.returncode == 0:
            return Succeeded(done.stdout.strip())
        last = (done.stderr.strip().splitlines() or [""])[-1][:200]
        detail = f"{self.config.name}: exit {done.returncode}: {last}".rstrip(": ")
        if done.returncode in self.config.exit_codes:
            return failure_named(self.config.exit_codes[done.returncode], detail)
        for name in FAILURE_NAMES:
            pattern = self.config.stderr_patterns.get(name)
            if pattern is not None and pattern.search(done.stderr):
                return failure_named(name, detail)
        return Failed(detail, retryable=True)
