"""The tables of agentbus: the only place where tables and columns are named.

Times are REAL Unix epoch seconds everywhere (the older system's columns were
REAL and operators compare them with ``strftime('%s','now')``). The Alembic
migrations in ``migrations/`` create exactly this schema; a test compares them.
"""

from __future__ import annotations

import sqlalchemy as sa

from agentbus.column_types import BigInteger, Float, Integer, LenientJSON, Real, Text, not_null
from agentbus.queue.states import TaskStatus

metadata = sa.MetaData()


#: Integer primary keys: 64-bit on Postgres, the rowid alias on SQLite.
BigId = sa.BigInteger().with_variant(sa.Integer(), "sqlite")
Epoch = Real()

STATUS_CHECK = "status IN (" + ", ".join(f"'{s.value}'" for s in TaskStatus) + ")"  # 0018
#: The rows of the idempotency keys' unique index: the tasks that have one.
KEYED = sa.text("idempotency_key IS NOT NULL")

bus_commands = sa.Table(
    "bus_commands",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("agent", Text, nullable=False),
    sa.Column("command", Text),
    sa.Column("payload", LenientJSON),
    sa.Column("models", LenientJSON),
    sa.Column("role", Text),
    sa.Column("status", Text, nullable=False, server_default=TaskStatus.QUEUED.value),
    sa.Column("priority", Integer, nullable=False, server_default="0"),
    sa.Column("run_after", Epoch, nullable=False, server_default="0"),
    sa.Column("attempts", Integer, nullable=False, server_default="0"),
    sa.Column("max_attempts", Integer, nullable=False, server_default="3"),
    sa.Column("claim_token", BigInteger, nullable=False, server_default="0"),
    sa.Column("claimed_by", Text),
    sa.Column("claimed_at", Epoch),
    sa.Column("lease_until", Epoch),
    sa.Column("resume_after", Epoch),
    sa.Column("first_paused_at", Epoch),
    sa.Column("pause_reason", Text),
    sa.Column("pause_model", Text),
    sa.Column("pause_count", Integer, nullable=False, server_default="0"),
    sa.Column("resume_count", Integer, nullable=False, server_default="0"),
    sa.Column("reentry_count", Integer, nullable=False, server_default="0"),
    sa.Column("rescue_count", Integer, nullable=False, server_default="0"),
    sa.Column("idempotency_key", Text),
    sa.Column("result", Text),
    sa.Column("result_note", Text),
    sa.Column("last_error", Text),
    sa.Column("created_at", Epoch),
    sa.Column("updated_at", Epoch),
    sa.Column("paused_at", Epoch),
    sa.Column("result_detail", LenientJSON),  # model, finish_reason, tool_calls, usage
    sa.Column("expires_at", Epoch),  # the deadline: not started by then, never started
    sa.Column("group_key", Text),  # its group (a conversation): turns one at a time, in order
    sa.Column("after_policy", Text),  # set when it waits for tasks (agentbus.queue.dependencies)
    sa.Column("awaited", sa.Boolean, nullable=False, server_default=sa.false()),  # one waits for it
    sa.CheckConstraint(STATUS_CHECK, name="ck_bus_commands_status"),
    sqlite_autoincrement=True,
)

# Partial indexes keep the claim's, the sweeper's and retention's reads range scans over
# the rows that matter. The migrations make them partial on PostgreSQL too; only SQLite's
# keyword is named here (naming PostgreSQL's loads that dialect, 2.2 MB, in every worker).
sa.Index(
    "ix_bus_commands_claim",
    bus_commands.c.agent,
    bus_commands.c.priority.desc(),
    bus_commands.c.run_after,
    bus_commands.c.id,
    sqlite_where=sa.text("status = 'queued'"),
)
sa.Index(
    "ix_bus_commands_paused_due",
    bus_commands.c.resume_after,
    sqlite_where=sa.text("status = 'paused'"),
)
sa.Index(
    "ix_bus_commands_lease", bus_commands.c.lease_until, sqlite_where=sa.text("status = 'claimed'")
)
# Finished tasks by when they finished: retention's cutoffs and the last failures.
sa.Index(
    "ix_bus_commands_done_at", bus_commands.c.updated_at, sqlite_where=sa.text("status = 'done'")
)
sa.Index(
    "ix_bus_commands_failed_at",
    bus_commands.c.updated_at,
    sqlite_where=sa.text("status IN ('failed', 'error')"),
)
sa.Index(
    "ix_bus_commands_cancelled_at",
    bus_commands.c.updated_at,
    sqlite_where=sa.text("status = 'cancelled'"),
)
_WAITING = "status = 'queued' OR status = 'paused'"
#: The waiting tasks with a deadline, which the sweeper watches (``agentbus.queue.deadlines``).
WITH_DEADLINE = f"expires_at IS NOT NULL AND ({_WAITING})"
sa.Index("ix_bus_commands_deadline", bus_commands.c.expires_at, sqlite_where=sa.text(WITH_DEADLINE))
#: The unfinished tasks of each group, which a claim counts (agentbus.queue.groups).
IN_GROUP = f"group_key IS NOT NULL AND ({_WAITING} OR status = 'claimed')"
_group = (bus_commands.c.agent, bus_commands.c.group_key, bus_commands.c.id)
sa.Index("ix_bus_commands_group", *_group, sqlite_where=sa.text(IN_GROUP))
#: The tasks waiting for others while they do (``run_after`` at 9999-12-31: never due).
WAITING_DUE = 253402214400.0
WAITING = f"after_policy IS NOT NULL AND status = 'queued' AND run_after = {WAITING_DUE}"
sa.Index(
    "ix_bus_commands_waiting",
    bus_commands.c.agent,
    bus_commands.c.id,
    sqlite_where=sa.text(WAITING),
)
sa.Index(  # an enqueue without a key writes no page of it
    "uq_bus_commands_idempotency_key",
    bus_commands.c.idempotency_key,
    unique=True,
    sqlite_where=KEYED,
)

#: Each task a task waits for, in the order given (agentbus.queue.dependencies).
task_dependencies = sa.Table(
    "task_dependencies",
    metadata,
    sa.Column("task_id", BigInteger, primary_key=True),
    sa.Column("position", Integer, primary_key=True),
    sa.Column("after_id", BigInteger, nullable=False),
)
sa.Index("ix_task_dependencies_after", task_dependencies.c.after_id, task_dependencies.c.task_id)

task_events = sa.Table(
    "task_events",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("task_id", BigInteger, nullable=False),
    sa.Column("from_status", Text),
    sa.Column("to_status", Text, nullable=False),
    sa.Column("reason", Text),
    sa.Column("worker", Text),
    sa.Column("claim_token", BigInteger),
    sa.Column("at", Epoch, nullable=False),
    sa.Column("detail", LenientJSON),
    sqlite_autoincrement=True,
)
sa.Index("ix_task_events_task", task_events.c.task_id, task_events.c.id)
sa.Index("ix_task_events_at", task_events.c.at)
#: The events a pause begins or ends, by time: the workspace's latest events.
PAUSE_EVENTS = sa.or_(
    task_events.c.to_status == sa.literal_column("'paused'"),
    task_events.c.from_status == sa.literal_column("'paused'"),
)
sa.Index(
    "ix_task_events_paused_at",
    task_events.c.at,
    sqlite_where=sa.text("to_status = 'paused' OR from_status = 'paused'"),
)

model_cooldown = sa.Table(
    "model_cooldown",
    metadata,
    sa.Column("model_id", Text, primary_key=True),
    sa.Column("cooldown_until", Epoch, nullable=False),
    sa.Column("updated_at", Epoch, nullable=False),
    sa.Column("reason", Text),
    sa.Column("source", Text),
)

ops_todos = sa.Table(
    "ops_todos",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("kind", Text, nullable=False),
    sa.Column("task_id", BigInteger),
    sa.Column("agent", Text),
    sa.Column("why", Text, nullable=False),
    sa.Column("created_at", Epoch, nullable=False),
    sa.Column("resolved_at", Epoch),
    sa.UniqueConstraint("kind", "task_id", name="uq_ops_todos_kind_task"),
    sqlite_autoincrement=True,
)

#: What ``busctl migrate`` found of the older system (agentbus.migrations.adoption): a table
#: kept aside as ``kept_as``, and the highest task id it held (retention leaves those).
adopted_tables = sa.Table(
    "adopted_tables",
    metadata,
    sa.Column("name", Text, primary_key=True),
    sa.Column("kept_as", Text),
    sa.Column("found_rows", BigInteger, nullable=False),
    sa.Column("max_id", BigInteger),
    sa.Column("columns_added", LenientJSON),
    sa.Column("adopted_at", Epoch, nullable=False),
)

#: Idempotency keys outlive the tasks they created (``key_retention_sec``): the same
#: key enqueued after its task was pruned still names that task, and runs nothing.
idempotency_keys = sa.Table(
    "idempotency_keys",
    metadata,
    sa.Column("key", Text, primary_key=True),
    sa.Column("task_id", BigInteger, nullable=False),
    sa.Column("created_at", Epoch, nullable=False),
)
sa.Index("ix_idempotency_keys_created", idempotency_keys.c.created_at)

workers = sa.Table(
    "workers",
    metadata,
    sa.Column("id", Text, primary_key=True),
    sa.Column("agent", Text, nullable=False),
    sa.Column("host", Text, nullable=False),
    sa.Column("pid", Integer, nullable=False),
    sa.Column("started_at", Epoch, nullable=False),
    sa.Column("heartbeat_at", Epoch, nullable=False),
    sa.Column("consecutive_failures", Integer, nullable=False, server_default="0"),
    sa.Column("backoff_until", Epoch),
    sa.Column("current_task", BigInteger),  # the earliest claimed of ``running``
    sa.Column("concurrency", Integer, nullable=False, server_default="1"),
    sa.Column("running", LenientJSON),  # the ids of the tasks it is running
    sa.Column("clock_offset", Float()),  # the database's clock minus this host's, seconds
)

#: Agents whose queue an operator holds (``busctl agents pause``): no worker claims their
#: tasks while their row is here. Not the task state ``paused``.
agent_holds = sa.Table(
    "agent_holds",
    metadata,
    sa.Column("agent", Text, primary_key=True),
    sa.Column("reason", Text),
    sa.Column("held_by", Text, nullable=False),
    sa.Column("held_at", Epoch, nullable=False),
)

#: When a sweeper first saw each schedule, and its last occurrence (agentbus.sweeper.schedules).
schedule_runs = sa.Table(
    "schedule_runs",
    metadata,
    sa.Column("name", Text, primary_key=True),
    sa.Column("first_seen", Epoch, nullable=False),
    sa.Column("last_at", Epoch),
    sa.Column("last_task_id", BigInteger),
)

#: Each model a worker considered for a task, skipped, refused or called: KPIs 1, 3, 4 read it.
route_log = sa.Table(
    "route_log",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("task_id", BigInteger, nullable=False),
    sa.Column("claim_token", BigInteger, nullable=False),
    sa.Column("agent", Text, nullable=False),
    sa.Column("worker", Text),
    sa.Column("model", Text, nullable=False),
    sa.Column("decision", Text, nullable=False),  # skip (cooling) | refuse (a gate) | call
    sa.Column("outcome", Text),  # ok, rate_limited, overloaded, timeout, auth, error, fatal
    sa.Column("cooldown_until", Epoch),  # seen (skip) or set (call)
    sa.Column("at", Epoch, nullable=False),
    sa.Column("role", Text),  # admission (0005): who the call went to, why not, its cost
    sa.Column("fallback_from", Text),  # the role whose fallback led to this candidate
    sa.Column("provider", Text),
    sa.Column("account", Text),
    sa.Column("code", Text),  # a refusal's code (decision refuse or skip)
    sa.Column("retry_after", Epoch),  # when the refusing gate admits again
    sa.Column("gates", LenientJSON),  # gate -> "ok" or its refusal
    sa.Column("refusal", LenientJSON(none_as_null=True)),  # 0009: Refusal.as_dict
    sa.Column("prompt_tokens", Integer),
    sa.Column("completion_tokens", Integer),
    sa.Column("cost", sa.Float),
    sqlite_autoincrement=True,
)
sa.Index("ix_route_log_task", route_log.c.task_id, route_log.c.claim_token)
sa.Index("ix_route_log_at", route_log.c.at)

#: Every cooldown written (its end after the never-shorten upsert), for KPI 3.
cooldown_history = sa.Table(
    "cooldown_history",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("model_id", Text, nullable=False),
    sa.Column("cooldown_until", Epoch, nullable=False),
    sa.Column("set_at", Epoch, nullable=False),
    sa.Column("reason", Text),
    sa.Column("source", Text),
    sqlite_autoincrement=True,
)
sa.Index("ix_cooldown_history_model", cooldown_history.c.model_id, cooldown_history.c.set_at)

# -- admission: every table below is written by agentbus.admission only ----

#: One row per admitted call through a limited gate: a leased slot while
#: ``released_at`` is NULL (concurrency, bulkheads), and an entry of the
#: sliding windows (rpm per provider account, rate per agent), numbered in each.
call_slots = sa.Table(
    "call_slots",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("provider", Text, nullable=False),
    sa.Column("account", Text, nullable=False, server_default=""),
    sa.Column("model", Text, nullable=False),
    sa.Column("agent", Text, nullable=False),
    sa.Column("bulkhead", Text),
    sa.Column("task_id", BigInteger),
    sa.Column("worker", Text),
    sa.Column("admitted_at", Epoch, nullable=False),
    sa.Column("lease_until", Epoch, nullable=False),
    sa.Column("released_at", Epoch),
    # The call's number in its account's and its agent's rate window (1, 2, 3 … in
    # admission order; NULL where that window was not configured): the limit-th newest
    # call is then found by number, not by reading the window's calls.
    sa.Column("account_seq", BigInteger),
    sa.Column("agent_seq", BigInteger),
    # What the call spends of its account's token windows (tpm, itpm, otpm): the
    # estimate until the answer reports the real figures; NULL where none counts it.
    sa.Column("tokens_in", BigInteger),
    sa.Column("tokens_out", BigInteger),
    sqlite_autoincrement=True,
)
sa.Index(
    "ix_call_slots_account_seq",
    call_slots.c.provider,
    call_slots.c.account,
    call_slots.c.account_seq,
)
sa.Index("ix_call_slots_agent_seq", call_slots.c.agent, call_slots.c.agent_seq)
# A token window's calls by time (the rate windows read theirs by number).
sa.Index(
    "ix_call_slots_tokens",
    call_slots.c.provider,
    call_slots.c.account,
    call_slots.c.admitted_at,
    sqlite_where=sa.text("tokens_in IS NOT NULL"),
)
sa.Index(
    "ix_call_slots_open", call_slots.c.lease_until, sqlite_where=sa.text("released_at IS NULL")
)

#: The circuit of each provider (by its stable name); ``endpoint`` changing
#: starts it afresh. ``probe_owner`` is the one half-open probe in flight.
circuits = sa.Table(
    "circuits",
    metadata,
    sa.Column("provider", Text, primary_key=True),
    sa.Column("endpoint", Text, nullable=False),
    sa.Column("state", Text, nullable=False, server_default="closed"),
    sa.Column("consecutive_failures", Integer, nullable=False, server_default="0"),
    sa.Column("opened_at", Epoch),
    sa.Column("open_until", Epoch),
    sa.Column("probe_owner", Text),
    sa.Column("probe_until", Epoch),
    sa.Column("updated_at", Epoch, nullable=False),
    sa.CheckConstraint("state IN ('closed', 'open', 'half_open')", name="ck_circuits_state"),
)

#: The circuit's sliding window: one row per finished call of a provider.
circuit_calls = sa.Table(
    "circuit_calls",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("provider", Text, nullable=False),
    sa.Column("at", Epoch, nullable=False),
    sa.Column("failed", sa.Boolean, nullable=False),
    sqlite_autoincrement=True,
)
sa.Index("ix_circuit_calls_provider", circuit_calls.c.provider, circuit_calls.c.at)

#: The usage ledger: settled calls' tokens and cost per UTC day and model/account.
usage_daily = sa.Table(
    "usage_daily",
    metadata,
    sa.Column("day", Epoch, primary_key=True),  # the epoch second the UTC day starts
    sa.Column("model", Text, primary_key=True),
    sa.Column("account", Text, primary_key=True),
    sa.Column("worker", Text, primary_key=True),  # per writer: no row every settle waits on
    sa.Column("provider", Text, nullable=False),
    sa.Column("calls", BigInteger, nullable=False, server_default="0"),
    sa.Column("prompt_tokens", BigInteger, nullable=False, server_default="0"),
    sa.Column("completion_tokens", BigInteger, nullable=False, server_default="0"),
    sa.Column("cost", sa.Float, nullable=False, server_default="0"),
)

#: Accounts whose credential was refused: unusable until their config changes
#: (``fingerprint`` of endpoint, key variable and key).
account_state = sa.Table(
    "account_state",
    metadata,
    sa.Column("provider", Text, primary_key=True),
    sa.Column("account", Text, primary_key=True),
    sa.Column("fingerprint", Text, nullable=False),
    sa.Column("reason", Text),
    sa.Column("unusable_since", Epoch, nullable=False),
)

#: The token windows a model's answers through an account announce (``x-ratelimit-…``
#: headers): its window's size where the config sets none (``accounts.learn``).
account_limits = sa.Table(
    "account_limits",
    metadata,
    sa.Column("provider", Text, primary_key=True),
    sa.Column("account", Text, primary_key=True),
    sa.Column("model", Text, primary_key=True),
    sa.Column("gate", Text, primary_key=True),  # tpm, itpm, otpm
    sa.Column("size", BigInteger, nullable=False),  # tokens per window
    sa.Column("observed_at", Epoch, nullable=False),
)

#: The agents waiting for a provider account's windows (refused by them), each with
#: its share, until a little after their refusal said: while others wait, an agent
#: gets its share at least (``admission.shares``).
account_demand = sa.Table(
    "account_demand",
    metadata,
    sa.Column("provider", Text, primary_key=True),
    sa.Column("account", Text, primary_key=True),
    sa.Column("agent", Text, primary_key=True),
    sa.Column("share", sa.Float, nullable=False),
    sa.Column("until", Epoch, nullable=False),
)

# -- the workspace client budget and the event log -------------------

#: Named client slots held now: one row per (name, holder); a name counts once
#: however many processes hold it. ``lease_until`` returns a dead holder's slot.
budget_slots = sa.Table(
    "budget_slots",
    metadata,
    sa.Column("name", Text, primary_key=True),
    sa.Column("holder", Text, primary_key=True),
    sa.Column("reserved_at", Epoch, nullable=False),
    sa.Column("lease_until", Epoch, nullable=False),
)

#: The workspace budget's shared state (one row): the hysteresis flag, which
#: flips atomically, and the names refused by the latest pass.
budget_state = sa.Table(
    "budget_state",
    metadata,
    sa.Column("id", Integer, primary_key=True),
    sa.Column("armed", sa.Boolean, nullable=False),
    sa.Column("last_refused", LenientJSON, nullable=False),
    sa.Column("updated_at", Epoch, nullable=False),
)

#: Workspace events (budget warnings, refused batches, circuit changes, cooldowns
#: set and expired); task transitions stay in task_events.
bus_events = sa.Table(
    "bus_events",
    metadata,
    sa.Column("id", BigId, primary_key=True),
    sa.Column("at", Epoch, nullable=False),
    sa.Column("kind", Text, nullable=False),
    sa.Column("scope", Text, nullable=False),
    sa.Column("source", Text),
    sa.Column("detail", LenientJSON),
    sqlite_autoincrement=True,
)
sa.Index("ix_bus_events_kind", bus_events.c.kind, bus_events.c.id)
sa.Index("ix_bus_events_at", bus_events.c.at)

#: Settings of the whole workspace (every process reads them; ``busctl`` writes them):
#: ``budget_mode`` and ``client_budget`` of the client budget.
workspace_settings = sa.Table(
    "workspace_settings",
    metadata,
    sa.Column("name", Text, primary_key=True),
    sa.Column("value", LenientJSON, nullable=False),
    sa.Column("updated_at", Epoch, nullable=False),
    sa.Column("updated_by", Text),
)

#: Counters that never go backwards, kept by triggers in each change's transaction
#: (0012, 0027): ``name`` the metric (pauses, resumes, demotions, task_ends, expiries,
#: admission_refusals), ``label`` its one label's value ('' when it has none).
bus_counters = sa.Table(
    "bus_counters",
    metadata,
    sa.Column("name", Text, primary_key=True),
    sa.Column("label", Text, primary_key=True, server_default=""),
    sa.Column("value", BigInteger, nullable=False, server_default="0"),
)

#: The tasks of each agent in each state (the sum of ``n`` over the shards), kept by triggers
#: on ``bus_commands`` (0021); on PostgreSQL a shard per server process, which the sweeper
#: adds into shard 0 (``agentbus.queue.counts``).
task_counts = sa.Table(
    "task_counts",
    metadata,
    sa.Column("agent", Text, primary_key=True),
    sa.Column("status", Text, primary_key=True),
    sa.Column("shard", BigInteger, primary_key=True, server_default="0"),
    sa.Column("n", BigInteger, nullable=False, server_default="0"),
)

#: Histograms and counters processes observe in memory and add here every few seconds
#: (``agentbus.process_metrics``): ``labels`` as ``k=v,k=v``; ``le`` a bucket's upper
#: bound, or ``sum`` / ``count``. Rows are only ever added to.
bus_observations = sa.Table(
    "bus_observations",
    metadata,
    sa.Column("name", Text, primary_key=True),
    sa.Column("labels", Text, primary_key=True),
    sa.Column("le", Text, primary_key=True),
    sa.Column("value", sa.Float, nullable=False, server_default="0"),
)

#: Producers listening for settled tasks (``AgentBus.wait`` on PostgreSQL), each row kept
#: current while its connection listens: a settle notifies only then, as a notifying commit
#: waits on every other one of the cluster (``agentbus.queue.wakeups``).
settle_listeners = sa.Table(
    "settle_listeners",
    metadata,
    sa.Column("listener", Text, primary_key=True),
    sa.Column("until", Epoch, nullable=False),
)


for _table in metadata.tables.values():
    not_null(_table)
