"""busctl serve through a real server and client: the status document, Prometheus
metrics, and the dashboard rendered by headless Chromium."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from agentbus.admission.budget_setting import write_setting
from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.gates import Code, Refusal
from agentbus.admission.routing import Route
from agentbus.db import Database
from agentbus.queue import TaskQueue, retention
from agentbus.queue.decisions import Complete, Pause, Settlement
from agentbus.queue.tasks import TaskSpec
from agentbus.queue.workers import WorkerRegistry
from agentbus.schema import circuits
from tests.conftest import IN_CI
from tests.support import Proc, free_port, wait_until
from tests.test_worker_outages import database_away

pytestmark = pytest.mark.process


def seed(url: str) -> dict[str, Any]:
    """A workspace with something in every section, on the wall clock."""
    db = Database(url)
    queue = TaskQueue(db)
    now = time.time()
    for i in range(3):
        queue.enqueue(TaskSpec(agent="codex", command=f"q{i}", models=("sim/opus",)))
    paused = queue.enqueue(TaskSpec(agent="ron", command="p", models=("sim/opus",))).id
    (task,) = queue.claim("ron", "w", 30)
    # Paused as a worker pauses it: the refused candidate's route row and the event.
    refusal = Refusal(Code.CIRCUIT_OPEN, now + 120, "the circuit is open", "circuit")
    route = Route(
        task.id,
        task.claim_token,
        "ron",
        "sim/opus",
        "refuse",
        now,
        code=refusal.code.value,
        refusal=refusal.as_dict(now),
    )
    pause = Pause(now + 120, "sim/opus", "all candidate models are refused (circuit_open)")
    detail = {"refusals": {"sim/opus": refusal.as_dict(now)}}
    assert queue.settle([Settlement(task.id, task.claim_token, pause, [route], detail)]) == []
    CooldownStore(db).set("sim/opus", now + 300, reason="RateLimited", source="w")
    db.write(
        lambda conn: conn.execute(
            circuits.insert().values(
                provider="flaky",
                endpoint="simulated",
                state="open",
                consecutive_failures=5,
                opened_at=now,
                open_until=now + 30,
                updated_at=now,
            )
        )
    )
    WorkerRegistry(db, "codex@test:1", "codex").register()
    # A task done with a call's tokens, one failed with its error, one queued for an agent
    # nobody serves.
    done = queue.enqueue(TaskSpec(agent="writer", command="d", models=("sim/opus",))).id
    (claim,) = queue.claim("writer", "w", 30)
    call = Route(
        done,
        claim.claim_token,
        "writer",
        "sim/opus",
        "call",
        now,
        provider="sim",
        prompt_tokens=30,
        completion_tokens=12,
        cost=0.5,
    )
    ack = Settlement(done, claim.claim_token, Complete("ok", "sim/opus", detail=ANSWER), [call])
    assert queue.settle([ack]) == []
    failed = queue.enqueue(TaskSpec(agent="writer", command="f", models=("sim/opus",))).id
    (claim,) = queue.claim("writer", "w", 30)
    queue.fail(failed, claim.claim_token, "HTTP 400: the prompt is too long")
    queue.enqueue(TaskSpec(agent="orphan", command="o", models=("sim/opus",)))
    write_setting(db, mode="warn", size=None, by="ops")  # the workspace's budget, not a flag's
    db.dispose()
    return {"paused": paused, "failed": failed, "done": done, "resume_after": now + 120}


#: What the done task's answer said besides its text.
ANSWER = {
    "model": "sim/opus",
    "finish_reason": "tool_calls",
    "tool_calls": [{"id": "c1", "name": "search", "arguments": {"q": "tides"}}],
    "usage": {"prompt_tokens": 30, "completion_tokens": 12},
}


@pytest.fixture
def served(db_url: str, spawn: Callable[..., Proc]) -> tuple[str, dict[str, Any]]:
    facts = seed(db_url)
    port = free_port()
    spawn("busctl", "--db", db_url, "serve", "--port", str(port))
    base = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(base + "/workspace/status", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_until(up, timeout=30)
    return base, facts


def test_status_and_metrics_over_http(
    served: tuple[str, dict[str, Any]], db_url: str, run_busctl: Callable[..., Any]
) -> None:
    base, facts = served
    doc = httpx.get(base + "/workspace/status").json()
    assert doc["queue"] == {
        "codex": {"queued": 3},
        "ron": {"paused": 1},
        "writer": {"done": 1, "failed": 1},
        "orphan": {"queued": 1},
    }
    assert doc["unserved"] == ["orphan"] and doc["live_workers"] == {"codex": 1}
    assert [(f["id"], f["last_error"]) for f in doc["recent_failures"]] == [
        (facts["failed"], "HTTP 400: the prompt is too long")
    ]
    assert sum(doc["last_hour"]["done"]) == 1 and sum(doc["last_hour"]["failed"]) == 1
    assert [p["id"] for p in doc["paused_due_soon"]] == [facts["paused"]]
    assert 100 < doc["paused_due_soon"][0]["seconds_left"] <= 120
    circuit_open = {
        "code": -32001,
        "name": "circuit_open",
        "retry_after_ms": 120_000,
        "suggested_action": "WAIT_FOR_CIRCUIT_PROBE",
        "gate": "circuit",
        "detail": "the circuit is open",
    }
    assert doc["paused_due_soon"][0]["refusals"] == {"sim/opus": circuit_open}
    (recent,) = doc["recent_refusals"]
    assert recent == {
        "agent": "ron",
        "task_id": facts["paused"],
        "candidate": "sim/opus",
        **circuit_open,
    } | {"at": recent["at"]}
    assert [c["model"] for c in doc["cooldowns"]] == ["sim/opus"]
    assert [(c["provider"], c["state"]) for c in doc["circuits"]] == [("flaky", "open")]
    assert [w["id"] for w in doc["workers"]] == ["codex@test:1"]
    assert doc["budget"] == {
        "mode": "warn",
        "budget": None,
        "scope": "workspace",
        "reserved": [],
        "count": 0,
        "last_refused": [],
        "set_at": doc["budget"]["set_at"],
        "set_by": "ops",
    }
    assert [k["name"] for k in doc["kpis"]][:2] == ["preservation", "resume success"]
    cli_doc = json.loads(run_busctl("--db", db_url, "status", "--json").stdout)
    assert set(cli_doc) == set(doc)  # the same document as busctl status --json
    assert cli_doc["queue"] == doc["queue"] and cli_doc["cooldowns"][0]["model"] == "sim/opus"

    metrics = httpx.get(base + "/metrics")
    assert metrics.headers["content-type"].startswith("text/plain")
    text = metrics.text
    for line in (
        'agentbus_tasks{agent="codex",status="queued"} 3.0',
        'agentbus_tasks{agent="ron",status="paused"} 1.0',
        "agentbus_pauses_total 1.0",
        "agentbus_cooldowns_active 1.0",
        'agentbus_circuit_state{provider="flaky"} 2.0',
        "agentbus_budget_reserved 0.0",
        'agentbus_worker_backoff_seconds{agent="codex"} 0.0',
        'agentbus_task_ends_total{status="failed"} 1.0',
        'agentbus_admission_refusals_total{code="circuit_open"} 1.0',
        'agentbus_workers{agent="codex"} 1.0',
        'agentbus_tokens_total{model="sim/opus"} 42.0',
        'agentbus_cost_total{model="sim/opus"} 0.5',
    ):
        assert line in text, line
    families = {f.name: f for f in text_string_to_metric_families(text)}
    kpis = {s.labels["kpi"]: s.value for s in families["agentbus_kpi_last_hour"].samples}
    assert kpis["preservation"] == 100.0  # the paused task, within the hour
    oldest = families["agentbus_queue_oldest_age_seconds"].samples
    assert {s.labels["agent"] for s in oldest} == {"codex", "orphan"}
    assert all(0 <= s.value < 600 for s in oldest)
    # Retention deletes the history the counters counted: they stay where they were.
    before = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        if f.type == "counter"
        for s in f.samples
    }
    db = Database(db_url)
    assert (
        retention.prune(db, time.time() + 10**6, done_sec=1, failed_sec=1, batch=100, routes_sec=1)
        == 2
    )
    db.dispose()
    after_text = httpx.get(base + "/metrics").text
    after = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(after_text)
        if f.type == "counter"
        for s in f.samples
    }
    assert after == before and len(before) >= 8
    assert httpx.get(base + "/healthz").text == "ok\n"
    head = httpx.head(base + "/")
    assert (
        head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    )
    assert httpx.post(base + "/workspace/status").status_code == 405  # read-only
    assert httpx.get(base + "/nothing").status_code == 404


def test_the_dashboard_shows_live_numbers_in_a_browser(
    served: tuple[str, dict[str, Any]], tmp_path: Any
) -> None:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        if IN_CI:
            pytest.fail(
                "CI needs Debian's chromium for the dashboard test (.ci/run installs it)",
                pytrace=False,
            )
        pytest.skip("no chromium here: apt-get install chromium to run the dashboard test")
    base, facts = served
    page = httpx.get(base + "/")
    assert page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # no external assets
    started = time.time()
    dom = subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--virtual-time-budget=4000",
            "--dump-dom",
            base + "/",
        ],
        capture_output=True,
        text=True,
        timeout=90,
        check=True,
    ).stdout
    ended = time.time()
    assert "updated " in dom  # the script ran and fetched the status document
    assert "<td>codex</td>" in dom and '<td class="n">3</td>' in dom  # queued by agent
    assert f'<a href="#task-{facts["paused"]}">{facts["paused"]}</a>' in dom  # the paused task…
    # …and its countdown, from the page's clock: the server's at the fetch (after
    # ``started``) moved on by at most the browser's virtual time budget (4 s).
    ((value, unit),) = re.findall(r'class="countdown">([\d.]+) (min|s)<', dom)
    left, error = (float(value) * 60, 3.0) if unit == "min" else (float(value), 0.5)
    assert (
        facts["resume_after"] - ended - 4 - error <= left <= facts["resume_after"] - started + error
    )
    assert "<td>sim/opus</td>" in dom  # the cooling model
    assert '<span class="bad">open</span>' in dom  # the open circuit
    assert "codex@test:1" in dom  # the worker
    assert "preservation" in dom  # the KPIs
    assert "<b>-32001</b> circuit_open (circuit) · WAIT_FOR_CIRCUIT_PROBE" in dom  # why paused
    assert "<td><b>-32001</b></td>" in dom  # the recent refusals
    # What an operator acts on first: the agent nobody serves, the failures and why.
    assert "queued for agent <b>orphan</b>, and no live worker serves it" in dom
    assert f'<a href="#task-{facts["failed"]}">{facts["failed"]}</a>' in dom
    assert f'<button id="retry-{facts["failed"]}"' not in dom  # read-only: no write offered
    assert "<td>HTTP 400: the prompt is too long</td>" in dom
    assert "<b>3</b>queued" in dom or "<b>4</b>queued" in dom  # the headline
    assert "<polyline" in dom  # the last hour
    for width in (1024, 1400):  # no table wider than its section (the page measures them)
        shown = subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                f"--user-data-dir={tmp_path / f'profile{width}'}",
                f"--window-size={width},1200",
                "--virtual-time-budget=4000",
                "--dump-dom",
                base + "/?layout",
            ],
            capture_output=True,
            text=True,
            timeout=90,
            check=True,
        ).stdout
        assert "overflowing: none" in shown, (width, shown[shown.find("overflowing") :][:200])


def test_serve_answers_only_its_own_names_and_bounds_its_connections(
    db_url: str, spawn: Callable[..., Proc]
) -> None:
    port = free_port()
    proc = spawn(
        "busctl",
        "--db",
        db_url,
        "serve",
        "--port",
        str(port),
        "--allow-host",
        "dash.example",
        "--max-connections",
        "4",
        "--timeout",
        "1",
    )
    base = f"http://127.0.0.1:{port}"

    def status(host: str | None = None) -> int | None:
        headers = {"Host": host} if host else {}
        try:
            return httpx.get(base + "/workspace/status", headers=headers, timeout=5).status_code
        except httpx.TransportError:
            return None

    wait_until(lambda: status() == 200, timeout=30)
    assert status(f"localhost:{port}") == 200
    assert status("dash.example") == 200
    assert status(f"rebound.attacker.example:{port}") == 403  # DNS rebinding reads nothing
    # Many silent connections: the server keeps at most 4 threads for them, drops the
    # rest at once, and closes the silent ones after the timeout; then it answers again.
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(60)]
    try:
        proc_status = Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines()
        threads = int(next(line.split()[1] for line in proc_status if line.startswith("Threads:")))
        assert threads <= 4 + 4  # the connection slots, the main thread and a few of its own
        wait_until(lambda: status() == 200, timeout=30)
    finally:
        for sock in idle:
            sock.close()
    warned = spawn("busctl", "--db", db_url, "serve", "--host", "0.0.0.0", "--port", "0")
    wait_until(lambda: "serving http://0.0.0.0" in warned.text(), timeout=30)
    assert "without authentication" in warned.text()


def test_healthz_says_when_the_database_is_away_and_when_it_is_back(
    served: tuple[str, dict[str, Any]], db_url: str
) -> None:
    base, _ = served
    assert httpx.get(base + "/healthz").status_code == 200
    parsed = sa.make_url(db_url)
    if parsed.get_backend_name() == "sqlite":  # the file gone (a volume unmounted, say)
        path = Path(str(parsed.database))
        aside = path.with_name(path.name + ".aside")
        path.rename(aside)
        try:
            away = httpx.get(base + "/healthz")
        finally:
            aside.rename(path)
    else:
        with database_away(db_url):
            away = httpx.get(base + "/healthz", timeout=30)
    assert away.status_code == 503 and away.text.startswith("unavailable: "), away.text
    wait_until(lambda: httpx.get(base + "/healthz").status_code == 200, timeout=30)
    assert httpx.head(base + "/healthz").status_code == 200


def test_call_task_and_sweep_times_are_histograms_that_survive_the_processes(
    served: tuple[str, dict[str, Any]], db_url: str, spawn: Callable[..., Proc]
) -> None:
    base, _ = served
    db = Database(db_url)
    queue = TaskQueue(db)
    for i in range(2):
        queue.enqueue(TaskSpec(agent="timer", command=f"t{i}", models=("sim/a",)))
    db.dispose()
    worker = spawn("worker", "--agent", "timer", "--db", db_url, "--drain")
    assert worker.wait() == 0  # it adds what it observed as it exits
    assert spawn("sweeper", "--db", db_url, "--once").wait() == 0
    text = httpx.get(base + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    calls = {
        s.name: s.value
        for s in families["agentbus_call_seconds"].samples
        if s.labels.get("agent") == "timer" and s.labels.get("le") in (None, "+Inf")
    }
    assert calls["agentbus_call_seconds_count"] == 2
    assert calls["agentbus_call_seconds_bucket"] == 2 and calls["agentbus_call_seconds_sum"] >= 0
    runs = [
        s
        for s in families["agentbus_task_run_seconds"].samples
        if s.name.endswith("_count") and s.labels == {"agent": "timer", "outcome": "done"}
    ]
    assert [s.value for s in runs] == [2]
    jobs = {
        s.labels["job"]
        for s in families["agentbus_sweep_seconds"].samples
        if s.name.endswith("_count")
    }
    assert {"rescue", "resume", "prune"} <= jobs, jobs
    assert "agentbus_sweep_job_failures" in families


def test_observations_count_each_label_set_once_whatever_the_order_or_how_many() -> None:
    """Labels given in another order are the same series; label sets beyond those a process
    remembers the text of are still each counted, under their own labels."""
    from agentbus.process_metrics import _TEXTS_KEPT, Observations, labels_of

    seen = Observations()
    seen.observe("agentbus_call_seconds", {"agent": "a", "model": "m", "outcome": "ok"}, 0.2)
    seen.observe("agentbus_call_seconds", {"outcome": "ok", "model": "m", "agent": "a"}, 0.3)
    for i in range(_TEXTS_KEPT + 5):
        seen.count("agentbus_sweep_job_failures", {"job": f"j{i}"})
    seen.count("agentbus_sweep_job_failures", {"job": "j0"})
    rows = seen.take()
    calls = {r["le"]: r["value"] for r in rows if r["name"] == "agentbus_call_seconds"}
    assert {r["labels"] for r in rows if r["name"] == "agentbus_call_seconds"} == {
        "agent=a,model=m,outcome=ok"
    }
    assert calls["count"] == 2 and calls["sum"] == pytest.approx(0.5) and calls["0.25"] == 1
    failures = {
        labels_of(r["labels"])["job"]: r["value"]
        for r in rows
        if r["name"] == "agentbus_sweep_job_failures"
    }
    assert len(failures) == _TEXTS_KEPT + 5
    assert failures["j0"] == 2 and failures[f"j{_TEXTS_KEPT + 4}"] == 1
