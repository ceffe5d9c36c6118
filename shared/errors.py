"""The exceptions of agentbus.

``BusError`` and its subclasses are meant for people: the command-line tools
print their message as one line on stderr and exit with the class's
``exit_code``: 1 the command ran and found a problem, 2 usage or bad input
(nothing changed), 3 the database is unavailable or not migrated (retry
later), 4 not found. Any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations


class BusError(Exception):
    """agentbus could not do what was asked."""

    exit_code = 2  # usage or bad input: nothing changed

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or self.__doc__ or self.__class__.__name__)

    @property
    def message(self) -> str:
        return str(self.args[0])


class ConfigError(BusError):
    """The configuration is invalid."""


class InvalidTask(BusError):
    """The task is invalid."""


class UnknownAgent(BusError):
    """No agent by that name: neither the config, nor a task, nor a worker names it."""


class WaitTimeout(BusError, TimeoutError):
    """The task did not finish in time (it is still on the queue)."""

    exit_code = 1


class DatabaseUnavailable(BusError):
    """The database cannot be reached."""

    exit_code = 3


class NotMigrated(BusError):
    """The database schema is not at the current version: run `busctl migrate`."""

    exit_code = 3


class TaskNotFound(BusError):
    """No such task."""

    exit_code = 4


class NotFound(BusError):
    """Nothing by that name (a cooldown, a task among several)."""

    exit_code = 4


class Problem(BusError):
    """The command ran and found a problem (a KPI below its target, a task that could
    not be moved)."""

    exit_code = 1


class TransitionRejected(BusError):
    """A guarded status change matched no row.

    The task was not in the expected state, or the caller's claim token was
    superseded (its lease expired and the task was rescued). The caller must
    treat its work on the task as void: another claim owns it now.
    """

    exit_code = 1

    def __init__(
        self, task_id: int, action: str, expected: str, actual: str | None, token: int | None = None
    ) -> None:
        self.task_id = task_id
        self.action = action
        self.expected = expected
        self.actual = actual
        self.token = token
        where = "no such task" if actual is None else f"it is {actual}"
        fence = f" with claim token {token}" if token is not None else ""
        super().__init__(f"cannot {action} task {task_id}{fence}: expected {expected}, but {where}")


class CallError(BusError):
    """What a model call came to, said by your own code (a ``kind = "python"`` model, or
    the block of a permit): raise one of the four below."""

    def __init__(self, message: str | None = None, *, retry_after: float | None = None) -> None:
        super().__init__(message)
        #: Seconds to wait before the model is asked again (None: the setting's cooldown).
        self.retry_after = retry_after


class RateLimited(CallError):
    """The model is rate-limited: it cools down (for ``retry_after`` when given) and the
    task tries the next candidate, or pauses without spending an attempt."""


class Overloaded(CallError):
    """The model is overloaded (as an HTTP 503 or 529): it cools down like a 429."""


class Retryable(CallError):
    """The call failed and may succeed later: the attempt is spent and retried."""


class Permanent(CallError):
    """The call cannot succeed: the task fails."""


class Refused(BusError):
    """Admission refused the call now (``AgentBus.permit``). ``code`` is the JSON-RPC
    number of the refusal contract (-32000 rate limited, -32001 circuit open, -32002
    bulkhead full) or the gate's name (cooldown, concurrency_full, budget_exhausted …);
    ``retry_after_ms`` says when it admits again."""

    exit_code = 1

    def __init__(
        self,
        message: str | None = None,
        *,
        code: int | str = "refused",
        name: str = "refused",
        reason: str = "",
        retry_after_ms: int = 0,
        suggested_action: str = "DO_NOT_RETRY_IMMEDIATELY",
    ) -> None:
        super().__init__(message)
        self.code = code
        self.name = name  # the refusal's name: rate_limited, circuit_open, cooldown …
        self.reason = reason
        self.retry_after_ms = retry_after_ms
        self.suggested_action = suggested_action
