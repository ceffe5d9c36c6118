"""The simulated provider: scripted outcomes per task, for the demo, tests and benchmarks.

A task's payload key ``simulate`` maps a model id to a behaviour, either a
name — ``ok``, ``rate_limited``, ``overloaded``, ``timeout``, ``retryable``
(also ``error``), ``permanent`` (also ``fatal``), ``auth``, or ``crash`` (the
provider raises, as a bug would: the worker errors the task) — or an object::

    {"behaviour": "rate_limited", "for_s": 15, "retry_after_s": 5, "latency_ms": 200}

``usage`` ({"prompt_tokens": N, "completion_tokens": M}) is what a success
reports it used (default: the prompt's words, and 8): tests and benchmarks of
the token windows set it.
``wait_for`` (a file path) holds the call until that file exists, announcing
the wait with ``<path>.waiting``: tests hold a call in flight with it.
``until_file`` (a path) limits the behaviour to calls made before that file
exists: a test ends a rate-limit episode by creating it.
``until`` (epoch seconds) or ``for_s`` (seconds after the task was created)
limit the behaviour in time; after that the model answers ok. ``accounts``
(a list of account names) limits it to calls through those accounts of the
provider. Models not named answer ok. With ``AGENTBUS_SIM_JOURNAL`` set,
every call appends one JSON line (started, time it ended, model, account,
task, worker, outcome) to that file, so tests can count and time the calls a
model really received.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from agentbus.errors import InvalidTask
from agentbus.providers import CallRequest, chat
from agentbus.providers.outcomes import (
    ALIASES,
    Outcome,
    OutcomeName,
    Succeeded,
    Usage,
    failure_named,
)

CRASH = "crash"
BEHAVIOURS = (*(n.value for n in OutcomeName), *ALIASES, CRASH)
MAX_LATENCY_MS = 600_000
_KEYS = {
    "behaviour",
    "until",
    "until_file",
    "for_s",
    "retry_after_s",
    "latency_ms",
    "accounts",
    "wait_for",
    "usage",
}


def script_for(payload: Mapping[str, Any], model: str) -> dict[str, Any]:
    """The behaviour object for ``model`` from a task payload (validated)."""
    if "simulate" not in payload:  # no script: the model answers ok
        return {"behaviour": "ok"}
    table = payload["simulate"]
    if not isinstance(table, dict):
        raise InvalidTask("payload.simulate must be an object mapping model ids to behaviours")
    raw = table.get(model, "ok")
    script = {"behaviour": raw} if isinstance(raw, str) else raw
    if not isinstance(script, dict) or set(script) - _KEYS:
        raise InvalidTask(
            f"payload.simulate[{model!r}] must be a behaviour name or an object "
            f"with keys {', '.join(sorted(_KEYS))}"
        )
    if script.get("behaviour", "ok") not in BEHAVIOURS:
        raise InvalidTask(
            f"payload.simulate[{model!r}]: unknown behaviour "
            f"{script.get('behaviour')!r} (one of {', '.join(BEHAVIOURS)})"
        )
    for key in ("until", "for_s", "retry_after_s", "latency_ms"):
        value = script.get(key)
        if value is not None and (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
            or value < 0
        ):
            raise InvalidTask(f"payload.simulate[{model!r}].{key} must be a non-negative number")
    accounts = script.get("accounts")
    if accounts is not None and (
        not isinstance(accounts, list) or not all(isinstance(a, str) for a in accounts)
    ):
        raise InvalidTask(f"payload.simulate[{model!r}].accounts must be a list of account names")
    for key in ("wait_for", "until_file"):
        path = script.get(key)
        if path is not None and (not isinstance(path, str) or not path):
            raise InvalidTask(f"payload.simulate[{model!r}].{key} must be a file path")
    usage = script.get("usage")
    if usage is not None and not (
        isinstance(usage, dict)
        and set(usage) <= {"prompt_tokens", "completion_tokens"}
        and all(
            isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= chat.MAX_COUNT
            for n in usage.values()
        )
    ):
        raise InvalidTask(
            f"payload.simulate[{model!r}].usage must map prompt_tokens and completion_tokens "
            "to whole numbers"
        )
    if (script.get("latency_ms") or 0) > MAX_LATENCY_MS:
        raise InvalidTask(
            f"payload.simulate[{model!r}].latency_ms must be at most {MAX_LATENCY_MS}"
        )
    return script


def _wait_for(path: str, limit_sec: float) -> None:
    """Hold the call until ``path`` exists (at most ``limit_sec``), announcing the wait
    with ``path.waiting``: a test holds a call in flight and releases it by a file."""
    Path(path + ".waiting").touch()
    deadline = time.monotonic() + limit_sec
    while not os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.01)


class SimulatedProvider:
    def __init__(self, *, journal: str | None = None, clock: Any = time.time) -> None:
        self.journal = journal
        self.clock = clock

    def call(self, request: CallRequest) -> Outcome:
        script = script_for(request.payload, request.model)
        started = self.clock()
        if script.get("latency_ms"):
            time.sleep(script["latency_ms"] / 1000)
        if script.get("wait_for"):
            _wait_for(script["wait_for"], min(request.timeout_sec, MAX_LATENCY_MS / 1000))
        behaviour = script.get("behaviour", "ok")
        now = self.clock()
        if script.get("accounts") is not None and request.account not in script["accounts"]:
            behaviour = "ok"
        until = script.get("until")
        if script.get("for_s") is not None:
            until = (request.created_at or now) + script["for_s"]
        if until is not None and now >= until:
            behaviour = "ok"
        if script.get("until_file") and os.path.exists(script["until_file"]):
            behaviour = "ok"
        outcome = self._outcome(behaviour, request, script)
        self._log(request, behaviour, started, now)
        return outcome

    @staticmethod
    def _outcome(behaviour: str, request: CallRequest, script: Mapping[str, Any]) -> Outcome:
        what = f"simulated {behaviour} from {request.model}"
        if behaviour == CRASH:
            raise RuntimeError(what)
        match behaviour:
            case "ok":
                used = {"prompt_tokens": len(request.prompt.split()), "completion_tokens": 8}
                given = request.payload.get("inputs")  # a task that waited for others
                more = f" [{len(given)} inputs]" if isinstance(given, list) and given else ""
                return Succeeded(
                    f"[{request.model}] done: {request.prompt[:60]}{more}",
                    Usage(**{**used, **script.get("usage", {})}),
                )
            case _:
                return failure_named(behaviour, what, retry_after_sec=script.get("retry_after_s"))

    def _log(self, request: CallRequest, behaviour: str, started: float, now: float) -> None:
        if not self.journal:
            return
        line = (
            json.dumps(
                {
                    "started": started,
                    "time": now,
                    "model": request.model,
                    "account": request.account,
                    "task_id": request.task_id,
                    "worker": request.worker,
                    "outcome": behaviour,
                }
            )
            + "\n"
        )
        fd = os.open(self.journal, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line.encode())  # one O_APPEND write: lines never interleave
        finally:
            os.close(fd)
