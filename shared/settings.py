"""Settings: defaults, then the TOML file, then environment, then CLI flags.

Every setting is a field of ``Settings``. Its environment variable is
``AGENTBUS_`` + the field name in capitals (``lease_sec`` ->
``AGENTBUS_LEASE_SEC``), and its key in the TOML file is the field name at
the top level of the file. The object is immutable and passed down
explicitly; nothing reads the environment behind its back. Reading the file
(the catalog beside the settings) and reloading it: ``agentbus.config``.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentbus.catalog.parse import SECTIONS
from agentbus.errors import ConfigError
from agentbus.providers.chat import MAX_COUNT
from agentbus.tomlfile import DEFAULT_CONFIG_MAX_BYTES

ENV_PREFIX = "AGENTBUS_"
DEFAULT_DATABASE_URL = "sqlite:///ops_multiagent.db"
DEFAULT_CONFIG_FILE = "agentbus.toml"
BUDGET_MODES = ("off", "warn", "enforce")
#: What stands between the processes and PostgreSQL: nothing, or a pooler that hands each
#: transaction to any of its server connections (PgBouncer's pool_mode = transaction, RDS
#: Proxy, Supabase's pooler), so that no process may keep state in a session.
POOLERS = ("none", "transaction")


def _doc(text: str, default: Any) -> Any:
    return field(default=default, metadata={"doc": text})


@dataclass(frozen=True)
class Settings:
    """The settings of every agentbus process (see the module docstring)."""

    database_url: str = _doc(
        "SQLAlchemy URL of the queue database (sqlite:///FILE or postgresql+psycopg://…).",
        DEFAULT_DATABASE_URL,
    )
    pooler: str = _doc(
        "PostgreSQL: none, or transaction when a transaction pooler (PgBouncer's pool_mode "
        "= transaction, RDS Proxy) stands in front of the server: nothing is kept in a "
        "session (no prepared statements, no LISTEN). The URL may say ?pooler=transaction.",
        "none",
    )
    listen_url: str = _doc(
        "PostgreSQL with a pooler: a direct URL to the server where idle workers and "
        "waiting producers LISTEN (one connection each); without it they poll.",
        "",
    )
    db_connections: str = _doc(
        "PostgreSQL connections a process opens at most, its LISTEN connection aside: "
        "auto (a worker 2 + concurrency, at most 4; the sweeper 1; serve, busctl and the "
        "API 2) or a number from 1 to what the process can use (a worker 2 + "
        "concurrency, the sweeper 2, the others 3).",
        "auto",
    )
    lease_sec: float = _doc(
        "How long a claim is held without a heartbeat before the sweeper may rescue it.", 60.0
    )
    max_attempts: int = _doc("Default attempts a task gets before it is failed.", 3)
    db_retry_sec: float = _doc(
        "How long a transient database error (locked, connection lost) is retried.", 30.0
    )
    db_connect_timeout_sec: float = _doc(
        "How long one attempt to connect to PostgreSQL waits for an answer (a host that "
        "never answers would hold a process until TCP gives up). A connect_timeout in "
        "the URL wins.",
        10.0,
    )
    db_full_wait_sec: float = _doc(
        "How long busctl and the producer API wait while PostgreSQL or its pooler refuses "
        "a connection because all are taken (too many clients); then exit 3 or BusError. "
        "Workers, the sweeper and serve wait as long as it takes.",
        30.0,
    )
    log_level: str = _doc("DEBUG shows every claim and call; INFO, WARNING or ERROR less.", "INFO")
    sqlite_busy_timeout_ms: int = _doc(
        "SQLite: how long a writer waits for the lock before retrying.", 5000
    )
    sqlite_synchronous: str = _doc(
        "SQLite: PRAGMA synchronous (FULL: every commit survives power loss; NORMAL: faster).",
        "FULL",
    )
    model_cooldown_sec: float = _doc(
        "Cooldown after a rate-limited/overloaded answer (a longer Retry-After wins).", 180.0
    )
    model_timeout_cooldown_sec: float = _doc("Cooldown after a model call timed out.", 1800.0)
    cooldown_cache_sec: float = _doc(
        "How long a worker may reuse its last read of model_cooldown.", 1.0
    )
    cooldown_slow_read_ms: float = _doc(
        "A model_cooldown read slower than this switches the process to the slow cache TTL.", 100.0
    )
    cooldown_slow_cache_sec: float = _doc("The cache TTL after a slow model_cooldown read.", 10.0)
    backoff_thresholds: str = _doc(
        "Worker backoff after consecutive genuine failures, as FAILURES:SECONDS pairs.",
        "3:30,5:60,10:300",
    )
    retry_backoff_sec: float = _doc(
        "A retryable failure re-queues the task after this many seconds, doubled per attempt.", 10.0
    )
    retry_backoff_max_sec: float = _doc("The longest re-queue delay of a retryable failure.", 600.0)
    call_retries: int = _doc(
        "In-call retries of a retryable model error before the attempt is spent.", 2
    )
    call_retry_wait_sec: float = _doc(
        "Wait before the first in-call retry (doubles each time).", 0.5
    )
    call_timeout_sec: float = _doc("Default timeout of one model call.", 120.0)
    grace_sec: float = _doc(
        "On SIGTERM, how long a running call may finish before its task is released.", 30.0
    )
    poll_sec: float = _doc(
        "An idle worker tries a claim at least this often (PostgreSQL wakes it at once on an "
        "enqueue; on SQLite it looks every 50 ms with a cheap read).",
        1.0,
    )
    claim_batch: int = _doc(
        "Tasks a worker claims at once and runs in turn, acknowledging their completions "
        "together (1: one at a time; more is faster for short tasks).",
        1,
    )
    concurrency: int = _doc(
        "Tasks a worker runs at once, each in a thread of its own (a model call mostly "
        "waits on the network: 16 calls in flight need one process, not 16).",
        1,
    )
    sweep_interval_sec: float = _doc("How often the sweeper runs all of its jobs.", 60.0)
    sweep_peek_sec: float = _doc(
        "How often the sweeper looks for the earliest pending resume_after (cheap).", 2.0
    )
    sweep_batch: int = _doc("Rows the sweeper changes per transaction.", 500)
    demote_after_sec: float = _doc(
        "A task paused this long (from the first pause of its episode) is failed.", 172800.0
    )
    reentry_limit: int = _doc(
        "Re-entries into the same model's cooldown after which resumes are held apart.", 3
    )
    reentry_hold_sec: float = _doc("The least time between such a task's pause and resume.", 300.0)
    rescue_limit: int = _doc("Rescues of an expired lease after which a task fails (poison).", 3)
    worker_stale_sec: float = _doc(
        "A worker row without a heartbeat this long is pruned (after its tasks are rescued).", 600.0
    )
    global_concurrency: int = _doc(
        "Model calls in flight at once across every process (0: no limit).", 0
    )
    daily_token_budget: int = _doc(
        "Tokens per UTC day across every model; at the threshold new calls wait for the next "
        "day (0: no budget).",
        0,
    )
    daily_cost_budget: float = _doc(
        "Cost per UTC day (in the unit of the models' prices); like daily_token_budget.", 0.0
    )
    rpm_window_sec: float = _doc(
        "The sliding window of the providers' rpm limits (60: requests per minute) and "
        "of their token limits (tpm, itpm, otpm).",
        60.0,
    )
    output_token_estimate: int = _doc(
        "The output tokens a token window (tpm, otpm) reserves for a call whose params set "
        "no max_tokens; the tokens the answer reports replace the reservation.",
        1024,
    )
    admission_wait_ms: float = _doc(
        "How long a call waits for a concurrency or bulkhead slot before it is refused.", 200.0
    )
    admission_recheck_sec: float = _doc(
        "When a refusal cannot know when it ends (slots in use, a probe in flight), "
        "the task is paused this long.",
        2.0,
    )
    circuit_window_sec: float = _doc("The circuit breaker's sliding window of calls.", 10.0)
    circuit_failure_rate: float = _doc(
        "Failure share in the window (with circuit_min_calls) that opens the circuit.", 0.5
    )
    circuit_min_calls: int = _doc("Calls in the window before the failure share counts.", 5)
    circuit_consecutive_failures: int = _doc(
        "Consecutive failures of a provider endpoint that open its circuit.", 5
    )
    circuit_open_sec: float = _doc(
        "How long an open circuit refuses calls before one probe may go through.", 30.0
    )
    config_check_sec: float = _doc(
        "How often a worker looks whether its config file changed (then reloads it).", 1.0
    )
    route_retention_sec: float = _doc(
        "Routing history rows and workspace events are deleted after this long (0 keeps them).",
        604800.0,
    )
    client_budget: int = _doc(
        "With no_workspace_budget: this process's named client slots (one per provider in "
        "use) at once (0: no budget; enforce needs one). Otherwise the workspace's size "
        "applies (busctl budget set).",
        0,
    )
    budget_mode: str = _doc(
        "With no_workspace_budget: this process's client budget, off (nothing tracked), warn "
        "(tracked, warns at 75 %, never refuses) or enforce (refuses above client_budget). "
        "Otherwise the workspace's mode applies (busctl budget set).",
        "off",
    )
    no_workspace_budget: bool = _doc(
        "Kill switch: each process keeps its own client budget from budget_mode and "
        "client_budget (events say scope session).",
        False,
    )
    key_retention_sec: float = _doc(
        "Idempotency keys are remembered this long after their enqueue, even when their task "
        "was pruned (0 keeps them forever); longer than done_retention_sec.",
        2592000.0,
    )
    config_max_bytes: int = _doc(
        "The largest config file read (bytes); set it in the environment, not in the file.",
        DEFAULT_CONFIG_MAX_BYTES,
    )
    max_payload_bytes: int = _doc(
        "The largest task payload accepted at enqueue (bytes of its JSON).", 1_048_576
    )
    max_payload_depth: int = _doc("How deeply a task payload's objects and arrays may nest.", 32)
    done_retention_sec: float = _doc(
        "Done tasks and their events are deleted after this long (0 keeps them).", 604800.0
    )
    failed_retention_sec: float = _doc(
        "Failed and errored tasks and their events are deleted after this long (0 keeps them).",
        2592000.0,
    )
    prune_adopted_tasks: bool = _doc(
        "Retention also deletes the tasks that were in bus_commands when agentbus adopted "
        "the older system's database (off: they are kept, and stay retryable).",
        False,
    )

    @classmethod
    def fields_doc(cls) -> dict[str, str]:
        """Field name -> its one-line description (for --help and the README)."""
        return {f.name: f.metadata["doc"] for f in dataclasses.fields(cls)}

    @classmethod
    def from_doc(
        cls,
        doc: Mapping[str, Any],
        path: Path | None,
        overrides: Mapping[str, Any] | None,
        env: Mapping[str, str],
    ) -> Settings:
        values: dict[str, Any] = {}
        origins: dict[str, str] = {}  # where each value was given: said with its error
        if path is not None:
            tables = sorted(k for k, v in doc.items() if isinstance(v, dict) and k not in SECTIONS)
            if tables:
                raise ConfigError(f"unknown section [{tables[0]}] in {path}")
            values.update(_scalars(doc))
            origins.update((name, str(path)) for name in values)
        known = {f.name: f for f in dataclasses.fields(cls)}
        for name in known:
            raw = env.get(ENV_PREFIX + name.upper())
            if raw is not None and raw != "":
                values[name], origins[name] = raw, f"${ENV_PREFIX}{name.upper()}"
        for name, value in (overrides or {}).items():
            if value is not None:
                values[name], origins[name] = value, "the command line"
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ConfigError(f"unknown setting {unknown[0]!r} in {path}")
        converted = {}
        for name, value in values.items():
            try:
                converted[name] = convert(name, known[name].type, value)
            except ConfigError as exc:
                raise ConfigError(f"{origins[name]}: {exc.message}") from None
        settings = cls(**converted)
        try:
            settings.validate()
        except ConfigError as exc:  # said with where the first setting it names was given
            named = [n for n in origins if re.search(rf"\b{n}\b", exc.message)]
            if not named:
                raise
            raise ConfigError(f"{origins[named[0]]}: {exc.message}") from None
        return settings

    def validate(self) -> None:
        for name in POSITIVE:
            if not getattr(self, name) > 0 or not math.isfinite(getattr(self, name)):
                raise ConfigError(f"setting {name} must be positive, got {getattr(self, name)}")
        if self.call_retries < 0:
            raise ConfigError("setting call_retries must not be negative")
        for name in ("config_max_bytes", "max_payload_bytes", "max_payload_depth"):
            if getattr(self, name) < 1:
                raise ConfigError(f"setting {name} must be at least 1")
        for name in ("sweep_batch", "reentry_limit", "rescue_limit", "claim_batch", "concurrency"):
            if getattr(self, name) < 1:
                raise ConfigError(f"setting {name} must be at least 1")
        if self.concurrency > MAX_CONCURRENCY:
            raise ConfigError(f"setting concurrency must be at most {MAX_CONCURRENCY}")
        if self.concurrency > 1 and self.claim_batch > 1:
            raise ConfigError(
                f"settings claim_batch ({self.claim_batch}) and concurrency "
                f"({self.concurrency}) cannot both be above 1: a worker running several "
                "tasks at once claims for its free slots"
            )
        for name in ("global_concurrency", "daily_token_budget", "daily_cost_budget"):
            if not getattr(self, name) >= 0 or not math.isfinite(getattr(self, name)):
                raise ConfigError(f"setting {name} must be 0 (no limit) or a positive number")
        if not 0 < self.circuit_failure_rate <= 1:
            raise ConfigError("setting circuit_failure_rate must be above 0 and at most 1")
        if not self.admission_wait_ms >= 0 or not math.isfinite(self.admission_wait_ms):
            raise ConfigError("setting admission_wait_ms must not be negative")
        for name in ("circuit_min_calls", "circuit_consecutive_failures"):
            if getattr(self, name) < 1:
                raise ConfigError(f"setting {name} must be at least 1")
        for name in (
            "done_retention_sec",
            "failed_retention_sec",
            "route_retention_sec",
            "key_retention_sec",
        ):
            if not getattr(self, name) >= 0 or not math.isfinite(getattr(self, name)):
                raise ConfigError(f"setting {name} must be 0 (keep) or a positive number")
        if self.db_connections != "auto" and not _whole(self.db_connections, at_least=1):
            raise ConfigError(
                "setting db_connections must be auto or a whole number of 1 or more, "
                f"got {self.db_connections!r}"
            )
        if self.pooler not in POOLERS:
            raise ConfigError(
                f"setting pooler {self.pooler!r} is not known: use {' or '.join(POOLERS)}"
            )
        self.backoff_steps()  # parses, or raises ConfigError
        if self.client_budget < 0:
            raise ConfigError("setting client_budget must not be negative")
        check_budget_mode(self.budget_mode, self.client_budget)
        if not 1 <= self.output_token_estimate <= MAX_COUNT:
            raise ConfigError(
                f"setting output_token_estimate must be a whole number from 1 to {MAX_COUNT:,}"
            )
        if self.max_attempts < 1:
            raise ConfigError(f"setting max_attempts must be at least 1, got {self.max_attempts}")
        if self.sqlite_busy_timeout_ms < 0:
            raise ConfigError("setting sqlite_busy_timeout_ms must not be negative")
        if self.log_level.upper() not in {"DEBUG", "INFO", "WARNING", "ERROR"}:
            raise ConfigError(
                f"setting log_level must be DEBUG, INFO, WARNING or ERROR, got {self.log_level!r}"
            )
        if self.sqlite_synchronous.upper() not in {"OFF", "NORMAL", "FULL", "EXTRA"}:
            raise ConfigError(
                f"setting sqlite_synchronous must be OFF, NORMAL, FULL or EXTRA, "
                f"got {self.sqlite_synchronous!r}"
            )

    def connections(self, auto: int, most: int, who: str) -> int:
        """The PostgreSQL connections this process opens at most: ``auto``, or the
        setting db_connections, which may not be above ``most`` (what ``who`` can use)."""
        if self.db_connections == "auto":
            return auto
        wanted = int(self.db_connections)
        if wanted > most:
            raise ConfigError(
                f"setting db_connections ({wanted}) is more than {who} can use ({most})"
            )
        return wanted

    def backoff_steps(self) -> tuple[tuple[int, float], ...]:
        """``backoff_thresholds`` parsed: ((failures, seconds), …), failures ascending."""
        steps = []
        try:
            for part in self.backoff_thresholds.split(","):
                failures, seconds = part.split(":")
                steps.append((int(failures), float(seconds)))
        except ValueError:
            raise ConfigError(
                f"setting backoff_thresholds must look like 3:30,5:60,10:300, "
                f"got {self.backoff_thresholds!r}"
            ) from None
        if any(f < 1 or s < 0 for f, s in steps) or steps != sorted(steps):
            raise ConfigError("setting backoff_thresholds needs ascending positive failure counts")
        return tuple(steps)

    def queue_options(self) -> dict[str, Any]:
        """The keyword arguments of a TaskQueue that producers configure with settings."""
        from agentbus.queue.tasks import PayloadLimits

        limits = PayloadLimits(self.max_payload_bytes, self.max_payload_depth)
        return {"max_attempts": self.max_attempts, "payload_limits": limits}

    def replace(self, **changes: Any) -> Settings:
        new = dataclasses.replace(self, **changes)
        new.validate()
        return new


def check_budget_mode(mode: str, budget: int) -> None:
    """``enforce`` without a positive budget would refuse everything: stop at start-up."""
    if mode not in BUDGET_MODES:
        raise ConfigError(f"budget mode must be one of {', '.join(BUDGET_MODES)}, got {mode!r}")
    if mode == "enforce" and budget <= 0:
        raise ConfigError(
            "budget mode enforce needs a positive client budget "
            "(--client-budget N or AGENTBUS_CLIENT_BUDGET)"
        )


MAX_CONCURRENCY = 1000

POSITIVE = (
    "lease_sec",
    "db_retry_sec",
    "db_connect_timeout_sec",
    "db_full_wait_sec",
    "model_cooldown_sec",
    "model_timeout_cooldown_sec",
    "cooldown_cache_sec",
    "cooldown_slow_read_ms",
    "cooldown_slow_cache_sec",
    "retry_backoff_sec",
    "retry_backoff_max_sec",
    "call_retry_wait_sec",
    "call_timeout_sec",
    "grace_sec",
    "poll_sec",
    "sweep_interval_sec",
    "sweep_peek_sec",
    "demote_after_sec",
    "reentry_hold_sec",
    "worker_stale_sec",
    "rpm_window_sec",
    "admission_recheck_sec",
    "circuit_window_sec",
    "circuit_open_sec",
    "config_check_sec",
)


def _scalars(doc: Mapping[str, Any]) -> dict[str, Any]:
    """The top-level non-table keys of a config file (tables are other sections)."""
    return {k: v for k, v in doc.items() if not isinstance(v, dict)}


def _whole(text: str, *, at_least: int) -> bool:
    return text.strip().isdigit() and int(text) >= at_least


def convert(name: str, type_name: Any, value: Any) -> Any:
    kind = {"str": str, "float": float, "int": int, "bool": bool}[str(type_name)]
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    if kind is bool and isinstance(value, str):
        low = value.strip().lower()
        if low in {"1", "true", "yes", "on"}:
            return True
        if low in {"0", "false", "no", "off"}:
            return False
    elif kind is float and isinstance(value, (int, str)) and not isinstance(value, bool):
        try:
            return float(value)
        except ValueError:
            pass
    elif kind is int and isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    elif kind is str and isinstance(value, str):
        return value
    elif kind is str and isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # db_connections = 4 in TOML
    raise ConfigError(f"setting {name} must be {kind.__name__}, got {value!r}")
