"""One masking function for every text that leaves a provider or the database layer.

A process registers the secrets it knows at start — every provider key its
config names (the variables' values) and the database password — and
``mask`` replaces each occurrence with ``***``. Texts are masked whole, before
anything cuts them, and whatever looks like an API key or a bearer token is
masked too, so a key of another system, or the part of one a cut left
behind, does not leak either. Provider details, stored task text, events,
workspace events, account state and every log line go through ``mask``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, MutableMapping
from typing import Any

MASK = "***"
MIN_LENGTH = 6  # shorter "secrets" (an empty or toy value) would mask ordinary words

#: Key shapes worth masking wherever they appear, with the prefix kept for the reader.
_SHAPES = re.compile(
    r"\b(sk-ant-|sk-proj-|sk-|xox[abpr]-|gh[pousr]_|glpat-|AKIA|AIza)[A-Za-z0-9_\-]{6,}"
    r"|(?i:\b((?:bearer|x-api-key:?|api[_-]?key[=:])\s*))[A-Za-z0-9._~+/\-]{8,}=*"
)

#: Every key shape above contains one of these: a text without any skips the regex
#: (a 10 KB answer without one: 640 -> 68 µs).
_TRIGGERS = ("sk-", "xox", "gh", "glpat-", "akia", "aiza", "bearer", "api")

_known: set[str] = set()
_ordered: list[str] = []

#: Short texts already seen to need no masking (log fields, model ids, reasons repeat
#: for every task): answered by one set lookup. Emptied when a secret is registered.
_clean: set[str] = set()
_CLEAN_MAX_LENGTH = 200
_CLEAN_MAX_ENTRIES = 4096


def register(values: Iterable[str | None]) -> None:
    """Remember secret values (ignoring empty and very short ones)."""
    for value in values:
        if value and len(value) >= MIN_LENGTH and value not in _known:
            _known.add(value)
    _ordered[:] = sorted(_known, key=len, reverse=True)  # a key inside another: longest first
    _clean.clear()


def register_config(catalog: Any, environ: Mapping[str, str], database_url: str | None) -> None:
    """The values of every key variable the catalog names, and the database password."""
    values = [environ.get(name) for name in catalog.key_variables()]
    if database_url:
        values += _passwords(database_url)
    register(values)


def mask(text: str) -> str:
    """``text`` with every registered secret and every key-shaped string masked."""
    if not text or text in _clean:
        return text
    masked = text
    for secret in _ordered:
        if secret in masked:
            masked = masked.replace(secret, MASK)
    lowered = masked.lower()
    if any(trigger in lowered for trigger in _TRIGGERS):
        masked = _SHAPES.sub(_shape, masked)
    if masked == text and len(text) <= _CLEAN_MAX_LENGTH:
        if len(_clean) >= _CLEAN_MAX_ENTRIES:
            _clean.clear()
        _clean.add(text)
    return masked


#: Values with no text inside, answered without the checks below (a log line's ids,
#: counts and times: most of its values).
_SCALARS = frozenset((int, float, bool, type(None)))


def mask_value(value: Any) -> Any:
    """``mask`` applied to every string inside a JSON-like value."""
    if type(value) in _SCALARS:
        return value
    if isinstance(value, str):
        return mask(value)
    if isinstance(value, Mapping):
        return {k: mask_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [mask_value(v) for v in value]
    return value


def _shape(match: re.Match[str]) -> str:
    return f"{match.group(1) or match.group(2)}{MASK}"  # the prefix stays, for the reader


def _passwords(url: str) -> list[str | None]:
    """The URL's password as written (percent-encoded) and as decoded, through the
    URL parser every database connection uses."""
    from urllib.parse import quote_plus

    import sqlalchemy as sa

    try:
        password = sa.make_url(url).password
    except sa.exc.ArgumentError:
        return []
    return [str(password), quote_plus(str(password))] if password is not None else []


def log_processor(_logger: Any, _method: str, event: MutableMapping[str, Any]) -> dict[str, Any]:
    """structlog processor: every string of a log line masked."""
    return {key: mask_value(value) for key, value in event.items()}
