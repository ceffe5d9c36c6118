"""What a task is, as plain values: the spec a producer enqueues and the row a worker holds.

Validation lives here so that busctl, the Python client and the worker all
refuse the same bad input with the same message.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agentbus.catalog.model import NAME_RE
from agentbus.column_types import InvalidJSON
from agentbus.errors import InvalidTask
from agentbus.providers import chat
from agentbus.queue.states import TaskStatus

MAX_TEXT = 1_000_000
MAX_DELAY_SEC = 10 * 366 * 86400.0  # ten years: anything later is a mistake
MAX_CHAIN = 64  # candidate models of one task
MAX_KEY = 255  # characters of an idempotency key
HARD_MAX_DEPTH = 1000  # nesting beyond this is refused before anything recurses into it


@dataclass(frozen=True)
class PayloadLimits:
    """How large and how deeply nested a payload may be (settings max_payload_bytes and
    max_payload_depth); checked by the queue at enqueue."""

    max_bytes: int = 1_048_576
    max_depth: int = 32


@dataclass(frozen=True)
class TaskSpec:
    """A task to enqueue. ``models`` (an explicit chain) or else ``role`` say what runs it;
    with neither, the agent's configured chain (checked by the producer: see
    ``agentbus.admission.routing.check_task``)."""

    agent: str
    command: str
    models: tuple[str, ...] | None = None
    role: str | None = None
    payload: Mapping[str, Any] = field(default_factory=dict)
    priority: int = 0
    delay_sec: float = 0.0
    max_attempts: int | None = None
    key: str | None = None
    # A task not started by then is never started: an epoch (``deadline``) or seconds
    # from its enqueue (``expires_in_sec``), not both; the queue refuses one already past.
    deadline: float | None = None
    expires_in_sec: float | None = None
    # Its group (a conversation, a customer): with the agent's group_concurrency, at most
    # that many of a group's tasks run at once, in enqueue order.
    group: str | None = None
    # The ids of tasks it waits for, and whether they must all be done ("all_done") or
    # only ended ("any_end"): agentbus.queue.dependencies.
    after: tuple[int, ...] = ()
    after_policy: str = "all_done"
    # Measured once by validate(), for the limits the queue checks at enqueue.
    payload_depth: int = field(default=0, init=False, repr=False, compare=False)
    payload_bytes: int = field(default=0, init=False, repr=False, compare=False)
    # The payload's JSON as validate() encoded it, kept when it is printable ASCII (then it
    # is what ``json.dumps`` writes): the enqueue stores it without encoding it again.
    payload_ascii: str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate(self)

    def payload_json(self) -> str:
        """The payload as stored: JSON text, non-ASCII characters escaped."""
        return self.payload_ascii if self.payload_ascii is not None else json.dumps(self.payload)


#: A payload as measured and checked (made once: ``json.dumps`` with options makes an
#: encoder at every call).
_PAYLOAD_JSON = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


def validate(spec: TaskSpec) -> None:
    """Raise InvalidTask with one readable line when ``spec`` cannot be enqueued."""
    for label, text in (
        ("task text", spec.command),
        ("idempotency key", spec.key),
        ("group", spec.group),
        ("agent name", spec.agent),
        ("role name", spec.role),
    ):
        if isinstance(text, str) and "\x00" in text:
            raise InvalidTask(f"the {label} contains a NUL character")
        _unicode(label, text)
    if not isinstance(spec.agent, str) or not NAME_RE.match(spec.agent):
        raise InvalidTask(
            f"invalid agent name {spec.agent!r}: use letters, digits and _ . : / @ + -"
        )
    if not isinstance(spec.command, str):
        raise InvalidTask(f"the task text must be a string, not {type(spec.command).__name__}")
    if not spec.command.strip():
        raise InvalidTask("the task text is empty")
    if len(spec.command) > MAX_TEXT:
        raise InvalidTask(f"the task text is longer than {MAX_TEXT} characters")
    if spec.models is not None:
        if not spec.models:
            raise InvalidTask("the model chain is empty")
        if len(spec.models) > MAX_CHAIN:
            raise InvalidTask(
                f"the model chain has {len(spec.models)} models, more than {MAX_CHAIN}"
            )
        for model in spec.models:
            if not isinstance(model, str) or not NAME_RE.match(model):
                raise InvalidTask(f"invalid model name {model!r}")
        if len(set(spec.models)) != len(spec.models):
            raise InvalidTask("the model chain names a model twice")
    if spec.role is not None and (not isinstance(spec.role, str) or not NAME_RE.match(spec.role)):
        raise InvalidTask(f"invalid role name {spec.role!r}")
    if not isinstance(spec.payload, Mapping):
        raise InvalidTask(f"the payload must be a JSON object, not {type(spec.payload).__name__}")
    nesting = depth(spec.payload)
    if nesting > HARD_MAX_DEPTH:
        raise InvalidTask(f"the payload nests deeper than {HARD_MAX_DEPTH} levels")
    try:
        encoded = _PAYLOAD_JSON.encode(spec.payload)
    except (TypeError, ValueError) as exc:
        raise InvalidTask(f"the payload is not JSON: {exc}") from None
    _unicode("payload", encoded)
    try:
        chat.check_payload(spec.payload)
    except chat.ChatError as exc:
        raise InvalidTask(str(exc)) from None
    object.__setattr__(spec, "payload_depth", nesting)  # a frozen value: measured once here
    object.__setattr__(spec, "payload_bytes", len(encoded.encode("utf-8")))
    if encoded.isascii() and "\x7f" not in encoded:  # json.dumps escapes DEL too
        object.__setattr__(spec, "payload_ascii", encoded)
    if isinstance(spec.priority, bool) or not isinstance(spec.priority, int):
        raise InvalidTask("priority must be an integer")
    if not -1_000_000 <= spec.priority <= 1_000_000:
        raise InvalidTask("priority must be between -1000000 and 1000000")
    if (
        isinstance(spec.delay_sec, bool)
        or not isinstance(spec.delay_sec, (int, float))
        or (isinstance(spec.delay_sec, float) and not math.isfinite(spec.delay_sec))
    ):
        raise InvalidTask("run-after must be a finite number of seconds")
    if spec.delay_sec < 0:
        raise InvalidTask("run-after must not be negative")
    if spec.delay_sec > MAX_DELAY_SEC:
        raise InvalidTask(f"run-after must be at most {MAX_DELAY_SEC:.0f} seconds (ten years)")
    if spec.max_attempts is not None and (
        isinstance(spec.max_attempts, bool)
        or not isinstance(spec.max_attempts, int)
        or not 1 <= spec.max_attempts <= 1000
    ):
        raise InvalidTask("max-attempts must be an integer from 1 to 1000")
    if spec.key is not None and (not isinstance(spec.key, str) or not 0 < len(spec.key) <= MAX_KEY):
        raise InvalidTask(f"the idempotency key must be a string of 1 to {MAX_KEY} characters")
    if spec.group is not None and (
        not isinstance(spec.group, str) or not 0 < len(spec.group) <= MAX_KEY
    ):
        raise InvalidTask(f"the group must be a string of 1 to {MAX_KEY} characters")
    _check_deadline(spec)
    if spec.after or spec.after_policy != "all_done":
        from agentbus.queue.dependencies import check_after

        check_after(spec.after, spec.after_policy, spec.delay_sec)


def _shown(epoch: float) -> str:
    try:
        return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")
    except (OverflowError, ValueError, OSError):
        return f"{epoch:g}"


def _finite(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value)


def _check_deadline(spec: TaskSpec) -> None:
    if spec.deadline is not None and spec.expires_in_sec is not None:
        raise InvalidTask("give a deadline or expires-in, not both")
    if spec.deadline is not None and not _finite(spec.deadline):
        raise InvalidTask("the deadline must be a finite time (epoch seconds)")
    if spec.expires_in_sec is not None:
        if not _finite(spec.expires_in_sec):
            raise InvalidTask("expires-in must be a finite number of seconds")
        if not 0 < spec.expires_in_sec <= MAX_DELAY_SEC:
            raise InvalidTask(f"expires-in must be more than 0 and at most {MAX_DELAY_SEC:.0f} s")


def expires_at(spec: TaskSpec, now: float) -> float | None:
    """When a task enqueued ``now`` expires (None: never); InvalidTask when that is past,
    or not after the moment it may first run."""
    if spec.expires_in_sec is not None:
        at = now + spec.expires_in_sec
    elif spec.deadline is not None:
        at = float(spec.deadline)
    else:
        return None
    if at <= now:
        raise InvalidTask(f"the deadline {_shown(at)} is in the past")
    if at > now + MAX_DELAY_SEC:
        raise InvalidTask("the deadline is more than ten years away")
    if at <= now + spec.delay_sec:
        raise InvalidTask("the deadline comes before the task may run (run-after)")
    return at


def check_payload(spec: TaskSpec, limits: PayloadLimits) -> None:
    """Raise InvalidTask when a payload is larger or nests deeper than ``limits`` allow
    (from the measures validate() took)."""
    if spec.payload_depth > limits.max_depth:
        raise InvalidTask(
            f"the payload nests deeper than {limits.max_depth} levels (setting max_payload_depth)"
        )
    size = spec.payload_bytes
    if size > limits.max_bytes:
        raise InvalidTask(
            f"the payload is {size:,} bytes, more than {limits.max_bytes:,} "
            "(setting max_payload_bytes)"
        )


def depth(value: Any) -> int:
    """How deeply objects and arrays nest in a JSON-like value (without recursion)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        deepest = max(deepest, level)
        if deepest > HARD_MAX_DEPTH:
            return deepest
        stack.extend((child, level + 1) for child in children)
    return deepest


def _unicode(label: str, text: str | None) -> None:
    """Refuse text that cannot be stored as UTF-8 (lone surrogates, undecodable bytes)."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidTask(f"the {label} is not valid Unicode text") from None


def parse_payload(text: str | None) -> dict[str, Any]:
    """Parse a payload given as JSON text (it must be an object)."""
    if text is None or text == "":
        return {}
    _unicode("payload", text)
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidTask(
            f"the payload is not valid JSON: {exc.msg} at position {exc.pos}"
        ) from None
    except RecursionError:
        raise InvalidTask("the payload nests too deeply") from None
    except ValueError as exc:  # e.g. an integer of thousands of digits
        raise InvalidTask(f"the payload is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise InvalidTask(f"the payload must be a JSON object, not {type(value).__name__}")
    return value


def deadline_epoch(value: object) -> float:
    """A deadline as given to a producer (an aware datetime, or ISO 8601 text with a
    zone such as ``2026-12-08T09:00:00Z``) as an epoch; InvalidTask for anything else."""
    when = value
    if isinstance(value, str):
        try:
            when = datetime.fromisoformat(value.strip())
        except ValueError:
            raise InvalidTask(f"the deadline {value!r} is not an ISO 8601 time") from None
    if not isinstance(when, datetime):
        raise InvalidTask(f"the deadline must be an aware datetime, not {type(value).__name__}")
    if when.tzinfo is None or when.utcoffset() is None:
        raise InvalidTask("the deadline needs a time zone (e.g. 2026-12-08T09:00:00Z)")
    try:
        return when.timestamp()
    except (OverflowError, ValueError, OSError):
        raise InvalidTask(f"the deadline is out of range: {value!r}") from None


def parse_models(text: str) -> tuple[str, ...]:
    """Parse a comma-separated model chain."""
    return tuple(part.strip() for part in text.split(","))


@dataclass(frozen=True)
class Task:
    """A task as stored (a snapshot of its row)."""

    id: int
    agent: str
    command: str | None
    status: TaskStatus
    payload: dict[str, Any]
    models: tuple[str, ...] | None
    role: str | None
    priority: int
    run_after: float
    attempts: int
    max_attempts: int
    claim_token: int
    claimed_by: str | None
    lease_until: float | None
    resume_after: float | None
    first_paused_at: float | None
    paused_at: float | None
    pause_reason: str | None
    pause_model: str | None
    pause_count: int
    resume_count: int
    reentry_count: int
    rescue_count: int
    idempotency_key: str | None
    result: str | None
    result_note: str | None
    result_detail: dict[str, Any] | None  # model, finish_reason, tool_calls, usage
    last_error: str | None
    created_at: float | None
    updated_at: float | None
    expires_at: float | None  # the deadline: not started by then, never started
    group_key: str | None  # its group: turns one at a time (the agent's group_concurrency)
    after_policy: str | None  # set when it waits for tasks (agentbus.queue.dependencies)
    awaited: bool  # a task waits for it

    problem: str | None = None  # why this row cannot be run (set by from_row)

    @classmethod
    def from_row(cls, row: Mapping[Any, Any], *, malformed: str | None = None) -> Task:
        """The task a row holds; ``malformed``: what ``agentbus.queue.malformed`` found
        wrong with the row as stored (else its problem is judged from the values read)."""
        models = row["models"]
        payload = row["payload"]
        detail = row["result_detail"]
        values = {name: row[name] for name in _STORED_AS_IS}
        status = TaskStatus(row["status"])
        token = row["claim_token"]
        numbers = _numbers_problem(values, status, token)  # and leaves no bad number in
        values.update(
            problem=(f"malformed: {malformed}" if malformed else None)
            or _row_problem(payload, models)
            or numbers,
            id=int(row["id"]),
            status=status,
            payload=payload if isinstance(payload, dict) else {},
            models=tuple(models) if isinstance(models, list) else None,
            claim_token=token if type(token) is int else 0,
            result_detail=detail if isinstance(detail, dict) else None,
            awaited=bool(row.get("awaited")),
        )
        # Every field set at once: a frozen dataclass's __init__ sets each of its 32
        # through object.__setattr__, which cost most of reading a claimed task (a worker
        # reads one per task). The tests hold the two ways to the same Task.
        task = object.__new__(cls)
        task.__dict__.update(values)
        return task

    # The times a producer reads most, as aware UTC datetimes (the fields are epochs).
    @property
    def created(self) -> datetime | None:
        return _utc(self.created_at)

    @property
    def updated(self) -> datetime | None:
        return _utc(self.updated_at)

    @property
    def runs_after(self) -> datetime | None:
        return _utc(self.run_after)

    @property
    def resumes_after(self) -> datetime | None:
        return _utc(self.resume_after)

    @property
    def deadline(self) -> datetime | None:
        return _utc(self.expires_at)

    def as_dict(self) -> dict[str, Any]:
        out = {name: getattr(self, name) for name in self.__dataclass_fields__}
        out["status"] = self.status.value
        out["models"] = list(self.models) if self.models is not None else None
        return out


#: The fields ``from_row`` takes from the row as they are (the others it reads).
_STORED_AS_IS = tuple(
    name
    for name in Task.__dataclass_fields__
    if name
    not in {
        "problem",
        "id",
        "status",
        "payload",
        "models",
        "claim_token",
        "result_detail",
        "awaited",
    }
)


def _utc(epoch: float | None) -> datetime | None:
    return None if epoch is None else datetime.fromtimestamp(epoch, UTC)


#: A task's whole-number columns (never NULL) and its times (NULL where unset; ``run_after``,
#: never NULL, aside).
_COUNTS = (
    "priority",
    "attempts",
    "max_attempts",
    "pause_count",
    "resume_count",
    "reentry_count",
    "rescue_count",
)
TIMES = (
    "lease_until",
    "resume_after",
    "first_paused_at",
    "paused_at",
    "created_at",
    "updated_at",
    "expires_at",
)
#: The time a task in a state cannot do without.
NEEDED = {
    TaskStatus.QUEUED: "run_after",
    TaskStatus.PAUSED: "resume_after",
    TaskStatus.CLAIMED: "lease_until",
}


def _numbers_problem(values: dict[str, Any], status: TaskStatus, token: Any) -> str | None:
    """What makes a row's numbers unusable (a row written by hand: SQLite keeps text in
    a number's column). The schema's types read such a value as a marked 0 (``UnreadInt``,
    ``UnreadFloat``: not of type ``int`` or ``float``) or, where NULL is allowed, None;
    the driver's own rows hold it as stored. It becomes a plain 0 or None in ``values``,
    and the first problem is returned, as ``malformed: …``."""
    problems = []
    if type(token) is not int:
        problems.append(_not_a_number("claim_token", token, whole=True))
    for name in _COUNTS:
        value = values[name]
        if type(value) is not int:
            problems.append(_not_a_number(name, value, whole=True))
            values[name] = 0
    run_after = values["run_after"]
    if type(run_after) is not float or not math.isfinite(run_after):
        if type(run_after) is int:
            values["run_after"] = float(run_after)
        else:
            problems.append(_not_a_number("run_after", run_after))
            values["run_after"] = 0.0
    for name in TIMES:
        value = values[name]
        if value is not None and (type(value) is not float or not math.isfinite(value)):
            if type(value) is int:
                values[name] = float(value)
            else:
                problems.append(_not_a_number(name, value))
                values[name] = None
    needed = NEEDED.get(status)
    if needed is not None and values[needed] is None and not problems:
        problems.append(f"{needed} is missing or not a finite number")
    return f"malformed: {problems[0]}" if problems else None


def _not_a_number(name: str, value: Any, *, whole: bool = False) -> str:
    kind = "a whole number" if whole else "a finite number"
    if value is None:  # NULL, or read as None by the schema's types
        return f"{name} is missing or not {kind}"
    shown = repr(getattr(value, "stored", value))  # the schema's types keep what was stored
    return f"{name} is not {kind} ({shown[:40]}{'…' if len(shown) > 40 else ''})"


def _row_problem(payload: Any, models: Any) -> str | None:
    """What makes a stored row unrunnable (rows written by hand or by other tools)."""
    if isinstance(payload, InvalidJSON):
        return "the payload is not valid JSON"
    if payload is not None and not isinstance(payload, dict):
        return f"the payload is a JSON {type(payload).__name__}, not a JSON object"
    if models is not None and (
        not isinstance(models, list) or not all(isinstance(m, str) for m in models)
    ):
        return "the model chain is not a JSON list of model ids"
    return None
