"""``busctl serve``: the status snapshot over HTTP, Prometheus metrics, and a dashboard.

``GET /workspace/status`` (the ``busctl status --json`` document),
``GET /metrics`` (Prometheus text format, read from the database on each
scrape), ``GET /healthz`` (200 when the database answers and its schema is at
head, 503 and why otherwise), ``GET /tasks/ID`` (a task, its events and
routes) and ``GET /`` (a self-contained page that polls the status document;
no build step, no external assets); HEAD on each. With an operator token
(``busctl serve --admin-token-env VAR``) ``POST /tasks/ID/retry|cancel|resume``
carrying ``Authorization: Bearer <token>`` steers a task (401 without it);
without a token every write is 405.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import math
import re
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from agentbus import process_metrics
from agentbus.logging import get_logger

log = get_logger("agentbus.serve")
Snapshot = Callable[[bool], dict[str, Any]]  # the status document (with the KPIs?)
KPI_CACHE_SEC = 60.0
Act = Callable[[str, int], bool]  # (retry, cancel or resume, task id) -> whether it moved
ACTIONS = ("retry", "cancel", "resume")
CIRCUIT_STATES = {"closed": 0, "half_open": 1, "open": 2}


class SnapshotCollector(Collector):
    """Prometheus metrics from one status snapshot per scrape (without the KPIs, whose
    views read the whole history: ``busctl kpi`` and SQL have them). Counters come
    from ``bus_counters`` and never go backwards; every label set is bounded
    (status, agent, model, provider, code — no per-process label)."""

    def __init__(self, snapshot: Snapshot, kpis: Callable[[], list[dict[str, Any]]]) -> None:
        self.snapshot = snapshot
        self.kpis = kpis
        self._kpis: list[dict[str, Any]] = []
        self._kpis_at = -math.inf

    def _last_hour_kpis(self) -> list[dict[str, Any]]:
        """The KPIs over the last hour, computed at most once a minute."""
        if time.monotonic() - self._kpis_at >= KPI_CACHE_SEC:
            self._kpis, self._kpis_at = self.kpis(), time.monotonic()
        return self._kpis

    def collect(self) -> Iterator[Metric]:
        doc = self.snapshot(False)
        kpi = GaugeMetricFamily(
            "agentbus_kpi_last_hour",
            "The KPIs over the last hour (percent; backoff inversion: a count), "
            "computed at most once a minute; absent when nothing was measured.",
            labels=["kpi"],
        )
        for k in self._last_hour_kpis():
            if k["value"] is not None:
                kpi.add_metric([k["name"]], k["value"])
        yield kpi
        tasks = GaugeMetricFamily(
            "agentbus_tasks", "Tasks by status and agent.", labels=["status", "agent"]
        )
        for agent, statuses in doc["queue"].items():
            for status, n in statuses.items():
                tasks.add_metric([status, agent], n)
        yield tasks
        counted = doc["counters"]
        for name, key, what in (
            ("agentbus_pauses", "pauses", "Task pauses (every candidate refused or cooling)."),
            ("agentbus_resumes", "resumes", "Paused tasks put back on the queue."),
            ("agentbus_demotions", "demotions", "Tasks failed after pausing too long."),
            (
                "agentbus_deadline_expiries",
                "expiries",
                "Tasks their deadline ended before they started (cancelled, reason deadline).",
            ),
        ):
            yield CounterMetricFamily(name, what, value=sum(counted.get(key, {}).values()))
        yield CounterMetricFamily(
            "agentbus_budget_refused", "Client budget refusals.", value=doc["budget_refused"]
        )
        yield _labelled(
            CounterMetricFamily(
                "agentbus_task_ends",
                "Tasks that ended failed, in error or cancelled.",
                labels=["status"],
            ),
            counted.get("task_ends", {}),
        )
        yield _labelled(
            CounterMetricFamily(
                "agentbus_admission_refusals", "Admission refusals by code.", labels=["code"]
            ),
            counted.get("admission_refusals", {}),
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_queue_oldest_age_seconds",
                "How long the next queued task has been due, per agent (one priority: the "
                "longest wait).",
                labels=["agent"],
            ),
            doc["oldest_queued_age"],
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_workers", "Live workers (by heartbeat), per agent.", labels=["agent"]
            ),
            doc["live_workers"],
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_agent_on_hold",
                "1 per agent whose queue an operator put on hold (busctl agents pause).",
                labels=["agent"],
            ),
            {h["agent"]: 1 for h in doc["holds"]},
        )
        grouped = GaugeMetricFamily(
            "agentbus_group_tasks",
            "Unfinished tasks that have a group, per agent and state (queued ones wait for "
            "their group's turn when the agent sets group_concurrency).",
            labels=["agent", "status"],
        )
        for agent, g in doc["groups"].items():
            for state in ("queued", "claimed", "paused"):
                grouped.add_metric([agent, state], g[state])
        yield grouped
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_groups_active",
                "Groups with unfinished tasks, per agent.",
                labels=["agent"],
            ),
            {agent: g["groups"] for agent, g in doc["groups"].items()},
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_tasks_waiting_for_dependencies",
                "Queued tasks that wait for other tasks to end (enqueued with after), per agent.",
                labels=["agent"],
            ),
            doc["waiting"],
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_schedule_next_run_timestamp_seconds",
                "When each schedule's next occurrence comes (epoch seconds).",
                labels=["schedule"],
            ),
            {r["name"]: r["next_at"] for r in doc["schedules"]},
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_schedule_last_run_timestamp_seconds",
                "Each schedule's last occurrence enqueued or missed (epoch seconds).",
                labels=["schedule"],
            ),
            {r["name"]: r["last_at"] for r in doc["schedules"] if r["last_at"] is not None},
        )
        tokens = CounterMetricFamily("agentbus_tokens", "Tokens used, per model.", labels=["model"])
        cost = CounterMetricFamily(
            "agentbus_cost", "Cost of the calls, per model.", labels=["model"]
        )
        for used in doc["usage_totals"]:
            tokens.add_metric([used["model"]], used["tokens"])
            cost.add_metric([used["model"]], used["cost"])
        yield tokens
        yield cost
        cooling = GaugeMetricFamily(
            "agentbus_cooldown_seconds_left",
            "Active model cooldowns: seconds left.",
            labels=["model"],
        )
        for c in doc["cooldowns"]:
            cooling.add_metric([c["model"]], c["seconds_left"])
        yield cooling
        yield GaugeMetricFamily(
            "agentbus_cooldowns_active", "Models cooling down now.", value=len(doc["cooldowns"])
        )
        circuit = GaugeMetricFamily(
            "agentbus_circuit_state",
            "Circuit per provider: 0 closed, 1 half-open, 2 open.",
            labels=["provider"],
        )
        for c in doc["circuits"]:
            circuit.add_metric([c["provider"]], CIRCUIT_STATES.get(c["state"], 0))
        yield circuit
        yield from _windows(doc["windows"])
        budget = doc["budget"]
        yield GaugeMetricFamily(
            "agentbus_budget_reserved", "Client budget slots reserved.", value=budget["count"]
        )
        if budget["budget"]:
            yield GaugeMetricFamily(
                "agentbus_budget_limit", "The client budget.", value=budget["budget"]
            )
        backoff: dict[str, float] = {}
        failures: dict[str, float] = {}
        for w in doc["workers"]:
            backoff[w["agent"]] = max(backoff.get(w["agent"], 0.0), w["backoff_left"])
            failures[w["agent"]] = max(failures.get(w["agent"], 0), w["consecutive_failures"])
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_worker_backoff_seconds",
                "Longest backoff left among an agent's workers (0: working).",
                labels=["agent"],
            ),
            backoff,
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_worker_consecutive_failures",
                "Most consecutive genuine failures among an agent's workers.",
                labels=["agent"],
            ),
            failures,
        )
        yield _labelled(
            GaugeMetricFamily(
                "agentbus_malformed_rows",
                "Rows written by hand that agentbus cannot use, per table (tasks not yet "
                "ended, cooldowns, workers); the sweeper fails such a task and deletes the rest.",
                labels=["table"],
            ),
            doc["malformed"]["counts"],
        )
        yield from _observed(doc["observations"])


HISTOGRAMS = {
    "agentbus_call_seconds": (
        "Model call latency (retries in the call included).",
        "agent model outcome",
    ),
    "agentbus_task_run_seconds": ("A task's run in a worker, claim to decision.", "agent outcome"),
    "agentbus_sweep_seconds": ("A sweeper job's pass.", "job"),
}
COUNTED = {"agentbus_sweep_job_failures": ("Sweeper job passes that failed.", "job")}


def _observed(seen: dict[str, dict[str, dict[str, float]]]) -> Iterator[Metric]:
    """The histograms and counters processes added to ``bus_observations``."""
    for name, (what, names) in HISTOGRAMS.items():
        family = HistogramMetricFamily(name, what, labels=names.split())
        for labels, row in sorted(seen.get(name, {}).items()):
            given = process_metrics.labels_of(labels)
            cumulative, buckets = 0.0, []
            for le in process_metrics.LE:
                cumulative += row.get(le, 0.0)
                buckets.append((le, cumulative))
            values = [given.get(n, "") for n in names.split()]
            family.add_metric(values, buckets, sum_value=row.get("sum", 0.0))
        yield family
    for name, (what, names) in COUNTED.items():
        counter = CounterMetricFamily(name, what, labels=names.split())
        for labels, row in sorted(seen.get(name, {}).items()):
            given = process_metrics.labels_of(labels)
            counter.add_metric([given.get(n, "") for n in names.split()], row.get("count", 0.0))
        yield counter


def _windows(accounts: list[dict[str, Any]]) -> Iterator[Any]:
    """The provider accounts' rpm and token windows: used, limit, agents waiting, and
    what each agent used of them with its share."""
    keys = ["provider", "account", "window"]
    used = GaugeMetricFamily(
        "agentbus_window_used", "Calls or tokens in an account's window now.", labels=keys
    )
    limit = GaugeMetricFamily(
        "agentbus_window_limit", "An account's window limit (configured or learnt).", labels=keys
    )
    waiting = GaugeMetricFamily(
        "agentbus_window_waiting_agents",
        "Agents waiting for an account's windows.",
        labels=["provider", "account"],
    )
    by_agent = GaugeMetricFamily(
        "agentbus_agent_window_used",
        "What one agent used of an account's window now.",
        labels=["agent", *keys],
    )
    share = GaugeMetricFamily(
        "agentbus_agent_share",
        "An agent's share of the accounts' windows it uses or waits for.",
        labels=["agent", "provider", "account", "waiting"],
    )
    for a in accounts:
        account = [a["provider"], a["account"]]
        waiting.add_metric(account, sum(1 for g in a["agents"] if g["waiting"]))
        for gate, w in a["windows"].items():
            used.add_metric([*account, gate], w["used"])
            limit.add_metric([*account, gate], w["limit"])
        for g in a["agents"]:
            share.add_metric([g["agent"], *account, str(g["waiting"]).lower()], g["share"])
            for gate, n in g["used"].items():
                by_agent.add_metric([g["agent"], *account, gate], n)
    yield from (used, limit, waiting, by_agent, share)


def _labelled(family: Any, values: dict[str, Any]) -> Any:
    for label, value in sorted(values.items()):
        family.add_metric([label], value)
    return family


class BoundedServer(ThreadingHTTPServer):
    """A thread per connection, but never more than ``max_connections`` at once: a
    connection beyond that is closed at once (clients retry), so slow or idle
    clients cannot pile up threads; each connection's socket times out."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: Any, max_connections: int) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        threading.Thread(
            target=self._serve_one, args=(request, client_address), daemon=True
        ).start()

    def _serve_one(self, request: Any, client_address: Any) -> None:
        try:
            self.process_request_thread(request, client_address)
        finally:
            self._slots.release()


def make_server(
    host: str,
    port: int,
    snapshot: Snapshot,
    *,
    health: Callable[[], str | None] = lambda: None,
    task: Callable[[int], dict[str, Any] | None] = lambda _id: None,
    kpis: Callable[[], list[dict[str, Any]]] = list,
    act: Act | None = None,
    token: str | None = None,
    allowed_hosts: Iterable[str] = (),
    timeout: float = 10.0,
    max_connections: int = 32,
) -> ThreadingHTTPServer:
    """The server; requests naming a ``Host`` other than the bound address, loopback
    names or ``allowed_hosts`` are refused (a page on another site that resolves its
    name to this machine — DNS rebinding — reads nothing)."""
    hosts = {host.lower(), "localhost", "127.0.0.1", "::1", *(h.lower() for h in allowed_hosts)}
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot, kpis))
    page = resources.files("agentbus.admin").joinpath("dashboard.html").read_bytes()
    if token is not None and act is not None:  # the page offers the write actions
        page = page.replace(b'data-writable="no"', b'data-writable="yes"')

    class Handler(BaseHTTPRequestHandler):
        server_version = "agentbus"

        def do_HEAD(self) -> None:
            self._get(head=True)

        def do_GET(self) -> None:
            self._get(head=False)

        def _get(self, *, head: bool) -> None:
            self.head = head
            path = self.path.split("?", 1)[0]
            if not _host_allowed(self.headers.get("Host"), hosts):
                self._send(403, "text/plain", b"host not allowed (busctl serve --allow-host)\n")
                return
            try:
                if path == "/healthz":
                    why = health()
                    if why is None:
                        self._send(200, "text/plain", b"ok\n")
                    else:
                        self._send(503, "text/plain", f"unavailable: {why}\n".encode())
                elif _TASK.fullmatch(path):
                    found = task(int(path[7:]))
                    if found is None:
                        self._send(404, "text/plain", b"no such task\n")
                    else:
                        self._send(200, "application/json", json.dumps(found, default=str).encode())
                elif path == "/workspace/status":
                    body = json.dumps(snapshot(True), default=str).encode()
                    self._send(200, "application/json", body)
                elif path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                elif path in ("/", "/index.html"):
                    self._send(200, "text/html; charset=utf-8", page)
                else:
                    self._send(404, "text/plain", b"not found\n")
            except Exception as exc:  # the database went away, say: answer, keep serving
                log.error("request_failed", path=path, error=repr(exc))
                self._send(503, "text/plain", f"unavailable: {type(exc).__name__}\n".encode())

        def do_POST(self) -> None:
            self.head = False
            path = self.path.split("?", 1)[0]
            parts = path.strip("/").split("/")
            if token is None or act is None:
                self._send(405, "text/plain", b"read-only (busctl serve --admin-token-env)\n")
                return
            if not _host_allowed(self.headers.get("Host"), hosts):
                self._send(403, "text/plain", b"host not allowed (busctl serve --allow-host)\n")
                return
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._send(401, "text/plain", b"an operator token is needed\n")
                return
            if len(parts) != 3 or parts[0] != "tasks" or not _ID.fullmatch(parts[1]):
                self._send(404, "text/plain", b"not found\n")
                return
            if parts[2] not in ACTIONS:
                self._send(404, "text/plain", b"no such action\n")
                return
            try:
                moved = act(parts[2], int(parts[1]))
            except Exception as exc:  # the task in another state, or the database away
                message = getattr(exc, "message", None) or type(exc).__name__
                self._send(409, "text/plain", f"{message}\n".encode())
                return
            self._send(200, "application/json", json.dumps({"moved": moved}).encode())

        def send_error(
            self, code: int, message: str | None = None, explain: str | None = None
        ) -> None:
            # http.server answers a method it has no do_ for with 501, an HTTP/2 request
            # line with 505: the client's doing, so a 4xx (a monitor reads 5xx as ours).
            super().send_error(_CLIENT_ERRORS.get(code, code), message, explain)

        def do_PUT(self) -> None:
            self.head = False
            self._send(405, "text/plain", b"read-only\n")

        do_DELETE = do_PATCH = do_PUT

        def _send(self, code: int, kind: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if not getattr(self, "head", False):
                self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("http", request=self.requestline, status=args[1] if len(args) > 1 else None)

    Handler.timeout = timeout  # the socket's: a silent client is dropped
    return BoundedServer((host, port), Handler, max_connections)


#: Task ids in a path: ASCII digits, no more than a 64-bit id holds.
_ID = re.compile(r"[0-9]{1,18}")
_TASK = re.compile(r"/tasks/[0-9]{1,18}")
#: What http.server says with a 5xx that is the client's doing, and the 4xx it means.
_CLIENT_ERRORS = {501: 405, 505: 400}


def _host_allowed(header: str | None, hosts: set[str]) -> bool:
    """A request without Host (HTTP/1.0) is not a browser's; otherwise its name must be ours."""
    if header is None:
        return True
    name = header.strip().lower()
    if name.startswith("["):  # [::1]:8765
        name = name[1 : name.find("]")] if "]" in name else name
    else:
        name = name.rsplit(":", 1)[0]
    return name in hosts


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the server on this machine."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host.lower() == "localhost"
