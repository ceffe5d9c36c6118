"""structlog set-up: readable lines for people, JSON lines with --log-json.

Logs go to stderr so that a command's stdout stays its answer. structlog is
imported when a process configures logging or first logs, not when a module
asks for its logger: a short command that never logs does not pay for it.
"""

from __future__ import annotations

import sys
from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import structlog


def configure(*, json: bool = False, level: str = "INFO") -> None:
    """Set up logging for one of agentbus's own processes (a command, a worker, the
    sweeper): the process is ours, so structlog is imported lean."""
    import logging

    from agentbus.lean_imports import import_structlog

    import_structlog()  # the process is ours: without pretty-printers it never uses
    import structlog

    from agentbus.masking import log_processor

    # No secret in any log line: every value is masked as it comes, a traceback once
    # it is text (the level and the time, added after, are ours). A line's context is
    # what its logger was bound to (no context variables: nothing binds any).
    processors: list[structlog.typing.Processor] = [
        structlog.processors.format_exc_info,
        log_processor,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: structlog.typing.Processor
    if json:
        renderer = structlog.processors.JSONRenderer()
    elif sys.stderr.isatty():
        renderer = console(colors=True)
    else:
        renderer = PlainLines(console(colors=False))
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level)),
        # A line and its newline in one write: print() makes two system calls of them
        # where stderr writes through (PYTHONUNBUFFERED, as many container images set).
        logger_factory=structlog.WriteLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def console(*, colors: bool) -> structlog.dev.ConsoleRenderer:
    """structlog's readable lines, with plain tracebacks: a line looks the same whichever
    printers are installed."""
    import structlog

    return structlog.dev.ConsoleRenderer(
        colors=colors, exception_formatter=structlog.dev.plain_traceback
    )


#: ConsoleRenderer's layout: the level padded to its longest name ("exception"), the
#: event to 30 characters, then the other keys sorted.
_LEVEL_WIDTH = 9
_EVENT_WIDTH = 30
_QUOTED = frozenset(" \t=\r\n\"'")


class PlainLines:
    """The uncoloured ConsoleRenderer's line (a log file, a journal), made directly: a
    worker writes a line per task, and the renderer's general machinery made it
    cost ~160k instructions, ~100k of them rendering (measured; now ~95k in all),
    about a tenth of a no-op task. A line with a stack or an unformatted exception
    goes to ``fallback``, the ConsoleRenderer itself; the tests hold the two to
    the same output."""

    def __init__(self, fallback: structlog.typing.Processor) -> None:
        self.fallback = fallback

    def __call__(self, logger: Any, name: str, event_dict: MutableMapping[str, Any]) -> Any:
        if "stack" in event_dict or "exc_info" in event_dict:
            return self.fallback(logger, name, event_dict)
        exception = event_dict.pop("exception", None)
        pop, parts = event_dict.pop, []
        if (stamp := pop("timestamp", _MISSING)) is not _MISSING:
            parts.append(str(stamp))
        if (level := pop("level", _MISSING)) is not _MISSING:
            parts.append("[" + level.ljust(_LEVEL_WIDTH) + "]")
        if (event := pop("event", _MISSING)) is not _MISSING:
            parts.append(str(event).ljust(_EVENT_WIDTH))
        for key in ("logger", "logger_name"):
            if (value := pop(key, _MISSING)) is not _MISSING:
                parts.append("[" + str(value) + "]")
        parts += [key + "=" + _value(event_dict[key]) for key in sorted(event_dict)]
        line = " ".join(part for part in parts if part).rstrip(" ")
        return line if exception is None else line + "\n" + exception


_MISSING = object()


def _value(value: Any) -> str:
    """A value as ConsoleRenderer shows it: text as it is unless it holds a space, a
    quote or an ``=`` (then quoted), anything else by its ``repr``."""
    if isinstance(value, str):
        return repr(value) if _QUOTED.intersection(value) else value
    return repr(value)


class _LazyLogger:
    """Stands for ``structlog.get_logger(name)`` until it is first used."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._proxy: Any = None

    def __getattr__(self, attr: str) -> Any:
        proxy = self._proxy
        if proxy is None:
            import structlog

            # structlog's proxy reads the configuration at each call: made once, it
            # still follows a later ``configure``.
            proxy = self._proxy = structlog.get_logger(self._name)
        return getattr(proxy, attr)


def when(epoch: float) -> str:
    """An epoch as a log line shows it: ISO-8601, local zone, to the millisecond."""
    from datetime import UTC, datetime

    try:
        return datetime.fromtimestamp(epoch, UTC).astimezone().isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        return repr(epoch)


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return cast("structlog.typing.FilteringBoundLogger", _LazyLogger(name))
