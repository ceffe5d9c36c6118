"""What a model call came to, as data. Providers map their errors to these.

``RateLimited`` (HTTP 429, 529, 503 overloaded) and ``TimedOut`` put the model
in cooldown; ``AuthFailed`` makes the credential unusable (no cooldown);
``Failed`` is retryable or permanent.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Succeeded:
    text: str
    usage: Usage = field(default_factory=Usage)
    finish_reason: str | None = None  # the endpoint's word: stop, length, tool_calls, end_turn …
    # Tools the model asks to run, each {"id", "name", "arguments"} (arguments decoded
    # from JSON when they are JSON).
    tool_calls: tuple[dict[str, Any], ...] = ()
    # The answer's rate-limit headers say the account has no request (or token) left
    # for this many seconds: its model is cooled that long without waiting for a 429.
    limit_reset_sec: float | None = None
    # The token windows its headers announce: (window, limit, remaining or None), for an
    # account with none configured (``ratelimits.announced``).
    announced: tuple[tuple[str, int, int | None], ...] = ()

    def detail(self, model: str) -> dict[str, Any]:
        """What the task's ``result_detail`` keeps besides the text."""
        out: dict[str, Any] = {"model": model}
        if self.finish_reason is not None:
            out["finish_reason"] = self.finish_reason
        if self.tool_calls:
            out["tool_calls"] = list(self.tool_calls)
        out["usage"] = {
            "prompt_tokens": self.usage.prompt_tokens,
            "completion_tokens": self.usage.completion_tokens,
        }
        return out


@dataclass(frozen=True)
class RateLimited:
    """Rate-limited or overloaded: try another model; this one cools down."""

    detail: str
    retry_after_sec: float | None = None  # the provider's Retry-After, when it gave one
    overloaded: bool = False
    # The token windows the refusal's headers announce, as ``Succeeded.announced``: a
    # 429 teaches the window's size (and that it is spent) as well as an answer does.
    announced: tuple[tuple[str, int, int | None], ...] = ()


@dataclass(frozen=True)
class TimedOut:
    detail: str


@dataclass(frozen=True)
class AuthFailed:
    """The credential was refused (401/403): not a cooldown."""

    detail: str


@dataclass(frozen=True)
class Failed:
    detail: str
    retryable: bool


Outcome = Succeeded | RateLimited | TimedOut | AuthFailed | Failed


class OutcomeName(enum.StrEnum):
    """The one spelling of every outcome: the command provider's ``exit_codes`` and
    ``stderr_patterns``, the simulated provider's behaviours and ``route_log.outcome``."""

    OK = "ok"
    RATE_LIMITED = "rate_limited"
    OVERLOADED = "overloaded"
    TIMEOUT = "timeout"
    AUTH = "auth"
    RETRYABLE = "retryable"
    PERMANENT = "permanent"


#: Older words the simulated provider keeps accepting in task payloads.
ALIASES = {"error": OutcomeName.RETRYABLE, "fatal": OutcomeName.PERMANENT}
#: The failures a config may map exit codes and stderr patterns to (not "ok").
FAILURE_NAMES = tuple(n.value for n in OutcomeName if n is not OutcomeName.OK)


def name_of(outcome: Outcome) -> OutcomeName:
    """What an outcome is called (in ``route_log``, logs and configs)."""
    match outcome:
        case Succeeded():
            return OutcomeName.OK
        case RateLimited(overloaded=True):
            return OutcomeName.OVERLOADED
        case RateLimited():
            return OutcomeName.RATE_LIMITED
        case TimedOut():
            return OutcomeName.TIMEOUT
        case AuthFailed():
            return OutcomeName.AUTH
        case Failed(retryable=True):
            return OutcomeName.RETRYABLE
        case _:
            return OutcomeName.PERMANENT


def failure_named(name: str, detail: str, *, retry_after_sec: float | None = None) -> Outcome:
    """The failed outcome a name stands for (``ok`` is not one: it carries an answer)."""
    match ALIASES.get(name, name):
        case OutcomeName.RATE_LIMITED:
            return RateLimited(detail, retry_after_sec=retry_after_sec)
        case OutcomeName.OVERLOADED:
            return RateLimited(detail, retry_after_sec=retry_after_sec, overloaded=True)
        case OutcomeName.TIMEOUT:
            return TimedOut(detail)
        case OutcomeName.AUTH:
            return AuthFailed(detail)
        case OutcomeName.RETRYABLE:
            return Failed(detail, retryable=True)
        case _:
            return Failed(detail, retryable=False)
