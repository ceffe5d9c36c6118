"""A CLI agent as a model: argv from config, the prompt on stdin, the answer on stdout.

The whole request is also there for a program that wants more than the prompt:
``AGENTBUS_REQUEST_FILE`` names a JSON file (readable by the worker's user
only, removed when the call ends) holding ``task_id``, ``model`` (the name the
program knows it by), ``text`` (the task text), ``system``, ``messages`` (the
conversation, the task text its last user turn), ``params`` (the model's
defaults with the task's over them) and ``payload`` (the task's, whole).

The program runs with a minimal environment: ``PATH``, ``HOME``, ``LANG``, the
variables its config lists in ``env``, and its own accounts' key variables —
never the database URL or another provider's key. What it prints is masked.

A non-zero exit is mapped by ``exit_codes`` first, then by the first of
``stderr_patterns`` that matches; anything else is a retryable failure.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from agentbus import masking
from agentbus.catalog import ProviderConfig
from agentbus.errors import InvalidTask
from agentbus.providers import CallRequest, chat
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
#: The variable naming the file that holds the request as JSON.
REQUEST_FILE = "AGENTBUS_REQUEST_FILE"
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
            with request_file(request) as path:
                done = subprocess.run(
                    argv,
                    input=request.prompt,
                    capture_output=True,
                    text=True,
                    errors="replace",
                    timeout=timeout,
                    check=False,
                    env={**self._env, REQUEST_FILE: path},
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


@contextmanager
def request_file(request: CallRequest) -> Iterator[str]:
    """The request as a JSON file only this user can read, removed afterwards."""
    try:
        document = {
            "task_id": request.task_id,
            "model": request.upstream or request.model,
            "text": request.prompt,
            "system": chat.system_of(request.payload),
            "messages": chat.conversation(request.prompt, request.payload),
            "params": dict(request.params),
            "payload": dict(request.payload),
        }
    except chat.ChatError as exc:  # a row written by hand: enqueue would have refused it
        raise InvalidTask(str(exc)) from None
    fd, path = tempfile.mkstemp(prefix="agentbus-request-", suffix=".json")  # mode 0600
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump(document, out, ensure_ascii=False)
        yield path
    finally:
        os.unlink(path)
