"""What an answer's headers say about the account's limits: when to come back.

``retry_after`` reads the wait a refusal asks for (``retry-after-ms``, else
``Retry-After`` in seconds or as an HTTP date). ``exhausted_for`` reads the
rate-limit headers vendors send with every answer — OpenAI's
``x-ratelimit-remaining-requests`` / ``x-ratelimit-reset-requests`` (and
``-tokens``), Anthropic's ``anthropic-ratelimit-requests-remaining`` /
``-requests-reset`` (and ``-tokens``, ``-input-tokens``, ``-output-tokens``) —
and says for how long nothing is left. Resets come as durations (``6m0s``,
``1.5s``, ``20ms``, plain seconds) or RFC 3339 times. ``announced`` reads the
token limits an answer (or a 429) announces (``x-ratelimit-limit-tokens``, Anthropic's
``-input-tokens-limit`` and ``-output-tokens-limit``) and what remains of them:
the token windows of an account with none configured. A malformed value is
ignored with a debug line: a header must never fail a call.
"""

from __future__ import annotations

import email.utils
import re
import time
from collections.abc import Mapping
from datetime import datetime

from agentbus.logging import get_logger

log = get_logger("agentbus.providers")

#: (remaining, reset) header pairs, OpenAI's then Anthropic's.
FAMILIES = (
    ("x-ratelimit-remaining-requests", "x-ratelimit-reset-requests"),
    ("x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens"),
    ("anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-requests-reset"),
    ("anthropic-ratelimit-tokens-remaining", "anthropic-ratelimit-tokens-reset"),
    ("anthropic-ratelimit-input-tokens-remaining", "anthropic-ratelimit-input-tokens-reset"),
    ("anthropic-ratelimit-output-tokens-remaining", "anthropic-ratelimit-output-tokens-reset"),
)
#: The token windows an answer announces: (window, its limit's header, what remains).
#: Anthropic's ``anthropic-ratelimit-tokens-*`` is the tighter of its two, not a third.
ANNOUNCED = (
    ("tpm", "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens"),
    (
        "itpm",
        "anthropic-ratelimit-input-tokens-limit",
        "anthropic-ratelimit-input-tokens-remaining",
    ),
    (
        "otpm",
        "anthropic-ratelimit-output-tokens-limit",
        "anthropic-ratelimit-output-tokens-remaining",
    ),
)
#: A token limit above this is taken for a malformed value.
MAX_LIMIT = 10**12
#: A reset further away than this is taken for a malformed value.
MAX_RESET_SEC = 2 * 86_400.0
_DURATION = re.compile(
    r"\A(?:(?P<h>\d+(?:\.\d+)?)h)?(?:(?P<m>\d+(?:\.\d+)?)m(?!s))?"
    r"(?:(?P<s>\d+(?:\.\d+)?)s)?(?:(?P<ms>\d+(?:\.\d+)?)ms)?\Z"
)


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the provider asks us to wait (``retry-after-ms``, else ``Retry-After``);
    None when neither says, or says what is no wait: a value that does not parse, or
    one further than ``MAX_RESET_SEC``."""
    if "retry-after-ms" in headers:
        raw_ms = headers["retry-after-ms"]
        try:
            wait = _wait(float(raw_ms) / 1000)
        except ValueError:
            wait = None
        if wait is not None:
            return wait
        _ignored("retry-after-ms", raw_ms)
    raw = headers.get("retry-after")
    if raw is None:
        return None
    wait = None
    try:
        wait = _wait(float(raw))
    except ValueError:
        try:
            parsed = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError, OverflowError):
            parsed = None
        if parsed is not None and parsed.tzinfo is not None:
            wait = _wait(parsed.timestamp() - (time.time() if now is None else now))
    if wait is None:
        _ignored("retry-after", raw)
    return wait


def _wait(seconds: float) -> float | None:
    """A wait asked for: 0 or more seconds, and no further than ``MAX_RESET_SEC`` (a wait
    beyond it, NaN or an infinity is taken for a malformed value)."""
    if not seconds <= MAX_RESET_SEC:
        return None
    return max(0.0, seconds)


def exhausted_for(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds until the account has requests (and tokens) again, when a header says
    none is left now; None when every limit has room or nothing is said."""
    now = time.time() if now is None else now
    longest: float | None = None
    for remaining_name, reset_name in FAMILIES:
        raw = headers.get(remaining_name)
        if raw is None:
            continue
        try:
            remaining = float(raw.strip())
        except ValueError:
            _ignored(remaining_name, raw)
            continue
        if remaining > 0:
            continue
        reset = headers.get(reset_name)
        seconds = reset_in(reset, now) if reset is not None else None
        if seconds is None:
            _ignored(reset_name, reset)
            continue
        if seconds > 0:
            longest = max(longest or 0.0, seconds)
    return longest


def announced(headers: Mapping[str, str]) -> dict[str, tuple[int, int | None]]:
    """The token windows an answer's headers announce: window -> (its limit, the tokens
    that remain of it; None: not said). A limit that is not a whole number from 1 to
    ``MAX_LIMIT`` is ignored, a remaining count outside 0..limit taken as unsaid."""
    found: dict[str, tuple[int, int | None]] = {}
    for gate, limit_name, remaining_name in ANNOUNCED:
        raw = headers.get(limit_name)
        if raw is None:
            continue
        limit = _count(raw)
        if limit is None or not 1 <= limit <= MAX_LIMIT:
            _ignored(limit_name, raw)
            continue
        left = headers.get(remaining_name)
        remaining = _count(left) if left is not None else None
        if remaining is not None and not 0 <= remaining <= limit:
            _ignored(remaining_name, left)
            remaining = None
        found[gate] = (limit, remaining)
    return found


def _count(value: str) -> int | None:
    text = value.strip()
    return int(text) if text.isascii() and text.isdigit() and len(text) <= 15 else None


def reset_in(value: str, now: float) -> float | None:
    """Seconds from ``now`` to a reset given as a duration or an RFC 3339 time."""
    text = value.strip()
    seconds: float | None = None
    match = _DURATION.match(text)
    if text and match is not None:
        parts = match.groupdict()
        seconds = (
            float(parts["h"] or 0) * 3600
            + float(parts["m"] or 0) * 60
            + float(parts["s"] or 0)
            + float(parts["ms"] or 0) / 1000
        )
    else:
        try:
            seconds = float(text)
        except ValueError:
            try:
                moment = datetime.fromisoformat(text)
            except ValueError:
                return None
            if moment.tzinfo is None:
                return None  # a time without its zone cannot be placed
            seconds = max(0.0, moment.timestamp() - now)
    if seconds is None or not 0 <= seconds <= MAX_RESET_SEC:
        return None
    return seconds


def _ignored(header: str, value: str | None) -> None:
    log.debug("ratelimit_header_ignored", header=header, value=(value or "")[:64])
