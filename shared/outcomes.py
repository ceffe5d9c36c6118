"""What a model call came to, as data. Providers map their errors to these.

``RateLimited`` (HTTP 429, 529, 503 overloaded) and ``TimedOut`` put the model
in cooldown; ``AuthFailed`` makes the credential unusable (no cooldown);
``Failed`` is retryable or permanent.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Succeeded:
    text: str
    usage: Usage = field(default_factory=Usage)


@dataclass(frozen=True)
class RateLimited:
    """Rate-limited or overloaded: try another model; this one cools down."""

    detail: str
    retry_after_sec: float | None = None  # the provider's Retry-After, when it gave one
    overloaded: bool = False


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
