"""busctl as a user runs it: the real console script against a real database."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from agentbus.admission.cooldowns import CooldownStore
from agentbus.admission.routing import Route
from agentbus.db import Database
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import metadata

Run = Callable[..., subprocess.CompletedProcess[str]]


def snapshot(url: str) -> dict[str, list[tuple[object, ...]]]:
    db = Database(url)
    with db.engine.connect() as conn:
        out = {
            table.name: sorted(tuple(map(repr, row)) for row in conn.execute(sa.select(table)))
            for table in metadata.sorted_tables
        }
    db.dispose()
    return out


def assert_one_line_error(
    result: subprocess.CompletedProcess[str], *, contains: str, status: int = 2
) -> None:
    """One line on stderr and the exit status: 2 bad input, 3 the database is away or not
    migrated (retry later), 4 not found."""
    assert result.returncode == status, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("busctl: error: "), lines[0]
    assert contains in lines[0], lines[0]
    assert result.stdout == ""


def test_enqueue_show_status_retry(db_url: str, run_busctl: Run) -> None:
    out = run_busctl(
        "--db",
        db_url,
        "enqueue",
        "--agent",
        "codex",
        "--models",
        "sim/a,sim/b",
        "--payload",
        '{"simulate": {"sim/a": "ok"}}',
        "--priority",
        "3",
        "write a haiku",
    )
    assert out.returncode == 0, out.stderr
    task_id = int(out.stdout)
    shown = json.loads(run_busctl("--db", db_url, "show", str(task_id), "--json").stdout)
    assert shown["task"]["models"] == ["sim/a", "sim/b"]
    assert shown["task"]["payload"] == {"simulate": {"sim/a": "ok"}}
    assert [e["to_status"] for e in shown["events"]] == ["queued"]
    status = json.loads(run_busctl("--db", db_url, "status", "--json").stdout)
    assert status["queue"]["codex"]["queued"] == 1
    assert status["totals"]["queued"] == 1
    table = run_busctl("--db", db_url, "status").stdout
    assert "codex" in table and "queued" in table
    listed = json.loads(run_busctl("--db", db_url, "tasks", "--agent", "codex", "--json").stdout)
    assert [t["id"] for t in listed] == [task_id]

    db = Database(db_url)
    queue = TaskQueue(db)
    (task,) = queue.claim("codex", "w", 30)
    queue.fail(task.id, task.claim_token, "permanent")
    db.dispose()
    retried = run_busctl("--db", db_url, "retry", str(task_id))
    assert retried.returncode == 0, retried.stderr
    again = json.loads(run_busctl("--db", db_url, "show", str(task_id), "--json").stdout)
    assert again["task"]["status"] == "queued"


def test_idempotency_key_from_the_command_line(db_url: str, run_busctl: Run) -> None:
    args = ("--db", db_url, "enqueue", "--agent", "codex", "--role", "coder", "--key", "k1", "x")
    first = run_busctl(*args)
    second = run_busctl(*args)
    assert first.stdout == second.stdout
    assert "already names task" in second.stderr


BAD_ENQUEUE = [
    (["--payload", "{not json"], "payload is not valid JSON"),
    (["--payload", "[1, 2]"], "payload must be a JSON object"),
    (["--payload", '{"x": NaN}'], "payload"),
    (["--priority", "high"], "Invalid value for '--priority'"),
    (["--run-after", "-5"], "run-after must not be negative"),
    (["--run-after", "inf"], "run-after must be a finite"),
    (["--max-attempts", "0"], "max-attempts must be an integer from 1 to 1000"),
    (["--models", "a,,b"], "invalid model name ''"),
    (["--models", "a,a"], "names a model twice"),
    (["--models", "a", "--role", "r"], "not both"),
    (["--bogus"], "No such option"),
]


@pytest.mark.parametrize(("extra", "message"), BAD_ENQUEUE)
def test_bad_enqueue_input_changes_nothing(
    db_url: str, run_busctl: Run, extra: list[str], message: str
) -> None:
    before = snapshot(db_url)
    if "--models" not in extra and "--role" not in extra:
        extra = [*extra, "--models", "sim/a"]
    result = run_busctl("--db", db_url, "enqueue", "--agent", "codex", *extra, "text")
    assert_one_line_error(result, contains=message)
    assert snapshot(db_url) == before


@pytest.mark.parametrize(
    ("args", "message", "status"),
    [
        (["enqueue", "--agent", "bad agent!", "--models", "a", "x"], "invalid agent name", 2),
        (["enqueue", "--agent", "codex", "--models", "a", "  "], "task text is empty", 2),
        (["enqueue", "--agent", "codex", "x"], "needs a model chain", 2),
        (["show", "424242"], "task 424242 does not exist", 4),
        (["show", "abc"], "is not a valid integer", 2),
        (["retry", "424242"], "task 424242 does not exist", 4),
        (["tasks", "--status", "lost"], "Invalid value for '--status'", 2),
        (["frobnicate"], "No such command", 2),
    ],
)
def test_bad_commands_change_nothing(
    db_url: str, run_busctl: Run, args: list[str], message: str, status: int
) -> None:
    before = snapshot(db_url)
    result = run_busctl("--db", db_url, *args)
    assert_one_line_error(result, contains=message, status=status)
    assert snapshot(db_url) == before


def test_unmigrated_database_says_run_migrate(empty_db_url: str, run_busctl: Run) -> None:
    result = run_busctl("--db", empty_db_url, "status")
    assert_one_line_error(result, contains="run `busctl migrate`", status=3)


def test_missing_sqlite_file_is_reported_not_created(tmp_path: Path, run_busctl: Run) -> None:
    path = tmp_path / "nothing.db"
    result = run_busctl("--db", f"sqlite:///{path}", "status")
    assert_one_line_error(result, contains="does not exist", status=3)
    assert not path.exists()


@pytest.mark.parametrize(
    ("url", "message", "status"),
    [
        ("postgresql://agent:hunter2@127.0.0.1:1/bus", "cannot connect", 3),
        ("mysql://agent:hunter2@localhost/bus", "unsupported database", 2),
        ("not a url", "invalid database URL", 2),
        ("sqlite:////no/such/dir/bus.db", "does not exist", 3),
    ],
)
def test_bad_database_urls(run_busctl: Run, url: str, message: str, status: int) -> None:
    result = run_busctl("--db", url, "status")
    assert_one_line_error(result, contains=message, status=status)
    assert "hunter2" not in result.stderr


def test_default_database_and_env_var(tmp_path: Path, run_busctl: Run) -> None:
    assert run_busctl("migrate", cwd=tmp_path).returncode == 0
    assert (tmp_path / "ops_multiagent.db").exists()
    other = tmp_path / "other.db"
    env = {"AGENTBUS_DATABASE_URL": f"sqlite:///{other}"}
    assert run_busctl("migrate", env=env, cwd=tmp_path).returncode == 0
    assert other.exists()


def test_bad_config_file(tmp_path: Path, run_busctl: Run) -> None:
    cfg = tmp_path / "agentbus.toml"
    cfg.write_text("lease_sec = [\n")
    result = run_busctl("--config", str(cfg), "status")
    assert_one_line_error(result, contains="is not valid TOML")
    cfg.write_text("lease_sec = -1\n")
    assert_one_line_error(run_busctl("--config", str(cfg), "status"), contains="must be positive")
    cfg.write_text("leese_sec = 3\n")
    assert_one_line_error(run_busctl("--config", str(cfg), "status"), contains="unknown setting")


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: Path("/dev/zero"), "is not a regular file"),
        (lambda p: p.write_bytes(b"a = '" + b"x" * 1_100_000 + b"'\n"), "larger than 1,048,576"),
        (lambda p: p.write_bytes(bytes(range(256))), "is not UTF-8 text"),
        (lambda p: p.write_text("a = " + "[" * 50_000 + "]" * 50_000), "too deeply"),
    ],
)
def test_a_config_file_is_read_within_bounds(
    tmp_path: Path, run_busctl: Run, make: Callable[[Path], object], message: str
) -> None:
    cfg = tmp_path / "agentbus.toml"
    made = make(cfg)
    path = made if isinstance(made, Path) else cfg
    assert_one_line_error(run_busctl("--config", str(path), "status"), contains=message)
    small = {"AGENTBUS_CONFIG_MAX_BYTES": "10"}
    cfg.write_text("lease_sec = 30\n")
    result = run_busctl("--config", str(cfg), "status", env=small)
    assert_one_line_error(result, contains="larger than 10 bytes")


def test_cooldowns_lists_the_active_ones(db_url: str, run_busctl: Run) -> None:
    db = Database(db_url)
    store = CooldownStore(db)
    store.set("sim/live", time.time() + 600, reason="RateLimited", source="w1")
    store.set("sim/over", time.time() - 1, reason="RateLimited", source="w1")
    db.dispose()
    shown = json.loads(run_busctl("--db", db_url, "cooldowns", "--json").stdout)
    assert [(r["model_id"], r["source"]) for r in shown] == [("sim/live", "w1")]
    assert 0 < shown[0]["seconds_left"] <= 600
    assert "sim/live" in run_busctl("--db", db_url, "cooldowns").stdout


def route_row(task_id: int, token: int, **values: Any) -> Route:
    row: dict[str, object] = {
        "task_id": task_id,
        "claim_token": token,
        "agent": "codex",
        "worker": "w1",
        "model": "sim/a",
        "decision": "call",
        "outcome": "ok",
        "cooldown_until": None,
        "at": time.time(),
        "role": "coder",
        "fallback_from": None,
        "provider": "sim",
        "account": None,
        "code": None,
        "retry_after": None,
        "gates": {"cooldown": "ok"},
        "prompt_tokens": 30,
        "completion_tokens": 12,
        "cost": 0.25,
    }
    return Route(**{**row, **values})  # type: ignore[arg-type]


def test_routes_and_usage_are_shown(db_url: str, run_busctl: Run) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    task_id = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",))).id
    (task,) = queue.claim("codex", "w1", 30)
    refused = route_row(
        task.id,
        task.claim_token,
        model="sim/b",
        decision="refuse",
        outcome=None,
        code="rate_limited",
        retry_after=time.time() + 30,
        fallback_from="lead",
        prompt_tokens=None,
        completion_tokens=None,
        cost=None,
    )
    called = route_row(task.id, task.claim_token)
    queue.complete(task.id, task.claim_token, "ok", worker="w1", routes=[refused, called])
    db.dispose()

    shown = json.loads(
        run_busctl("--db", db_url, "routes", "--task", str(task_id), "--json").stdout
    )
    assert [(r["model"], r["decision"], r["code"]) for r in shown] == [
        ("sim/a", "call", None),
        ("sim/b", "refuse", "rate_limited"),
    ]
    text = run_busctl("--db", db_url, "routes", "--limit", "1").stdout
    assert "sim/a" in text and "sim/b" not in text and "42" in text  # tokens 30 + 12
    assert "rate_limited until" in run_busctl("--db", db_url, "routes").stdout
    status = json.loads(run_busctl("--db", db_url, "status", "--json").stdout)
    (usage,) = status["usage_today"]
    assert (usage["model"], usage["calls"], usage["tokens"], usage["cost"]) == (
        "sim/a",
        1,
        42,
        0.25,
    )
    assert "42 tokens" in run_busctl("--db", db_url, "status").stdout


def test_events_lists_workspace_and_task_events(db_url: str, run_busctl: Run) -> None:
    db = Database(db_url)
    queue = TaskQueue(db)
    task_id = queue.enqueue(TaskSpec(agent="codex", command="x", models=("sim/a",))).id
    (task,) = queue.claim("codex", "w1", 30)
    CooldownStore(db).set("sim/a", time.time() + 60, reason="RateLimited", source="w1")
    queue.pause(task.id, task.claim_token, time.time() + 60, "cooling", model="sim/a")
    db.dispose()
    out = run_busctl("--db", db_url, "events")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert [line.split()[2] for line in lines] == ["cooldown_set", "paused"]
    assert "model=sim/a" in lines[0] and f"task_id={task_id}" in lines[1]
    only = run_busctl("--db", db_url, "events", "--kind", "paused").stdout.splitlines()
    assert len(only) == 1 and "paused" in only[0]
    argv = [str(Path(sys.executable).with_name("busctl")), "--db", db_url, "events", "--follow"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, text=True) as follow:
        assert follow.stdout is not None
        assert "cooldown_set" in follow.stdout.readline()
        assert "paused" in follow.stdout.readline()
        db = Database(db_url)
        CooldownStore(db).set("sim/b", time.time() + 60, reason="RateLimited")
        db.dispose()
        assert "model=sim/b" in follow.stdout.readline()  # shows up while following
        follow.terminate()
        assert follow.wait(10) == 0  # SIGTERM ends --follow cleanly


def test_init_writes_the_commented_config_once(tmp_path: Path, run_busctl: Run) -> None:
    made = run_busctl("init", cwd=tmp_path)
    assert made.returncode == 0, made.stderr
    written = (tmp_path / "agentbus.toml").read_text()
    assert "[providers." in written and "database_url" in written
    (tmp_path / "agentbus.toml").write_text("# mine\n")
    again = run_busctl("init", cwd=tmp_path)
    assert_one_line_error(again, contains="--force")
    assert (tmp_path / "agentbus.toml").read_text() == "# mine\n"
    forced = run_busctl("init", "--force", str(tmp_path / "agentbus.toml"))
    assert forced.returncode == 0 and (tmp_path / "agentbus.toml").read_text() == written


def test_kpi_sql_is_printed_without_a_database(tmp_path: Path, run_busctl: Run) -> None:
    out = run_busctl("--db", f"sqlite:///{tmp_path / 'none.db'}", "kpi", "--sql")
    assert out.returncode == 0, out.stderr
    assert "kpi_summary" in out.stdout
    assert not (tmp_path / "none.db").exists()


def test_tasks_come_a_page_at_a_time(db_url: str, run_busctl: Run) -> None:
    """``busctl tasks`` pages back by id (``--before`` the last id shown), with or
    without a state."""
    db = Database(db_url)
    queue = TaskQueue(db)
    ids = queue.enqueue_many([TaskSpec(agent="a", command=f"t{i}") for i in range(7)])
    claimed = sorted(task.id for task in queue.claim("a", "w", 30, 2))
    db.dispose()

    def page(*args: str) -> list[int]:
        done = run_busctl("--db", db_url, "tasks", "--limit", "3", "--json", *args)
        assert done.returncode == 0, done.stderr
        return [task["id"] for task in json.loads(done.stdout)]

    newest = ids[::-1]
    assert page() == newest[:3]
    assert page("--before", str(newest[2])) == newest[3:6]
    assert page("--before", str(newest[5])) == newest[6:]
    assert page("--status", "claimed") == claimed[::-1]
    queued = [i for i in newest if i not in claimed]
    assert page("--status", "queued", "--before", str(queued[0])) == queued[1:4]
