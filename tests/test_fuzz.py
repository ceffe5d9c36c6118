"""Bad input, generated (hypothesis): every refusal is one clear line and changes nothing;
no input makes a traceback; tasks the worker cannot run fail with a readable reason."""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import given, reject
from hypothesis import strategies as st

from agentbus import cli
from agentbus.admin.busctl import busctl
from agentbus.admission.admission import Admission
from agentbus.admission.cooldowns import CooldownStore
from agentbus.catalog import Catalog, parse_catalog
from agentbus.catalog.parse import _KEYS, SECTIONS
from agentbus.config import Config, Settings, load_config
from agentbus.db import Database
from agentbus.errors import ConfigError
from agentbus.providers import Providers
from agentbus.queue import TaskQueue
from agentbus.queue.tasks import TaskSpec
from agentbus.schema import bus_commands, task_events
from agentbus.worker import policy
from agentbus.worker.runner import Runner
from tests.fuzzing import FUZZ

text = st.text(st.characters(codec="utf-8"), max_size=40)
# What a shell or a careless caller hands over: lone surrogates (undecodable argv bytes).
any_text = st.text(st.characters(), max_size=40)
hostile_payloads = st.one_of(
    st.integers(1, 3000).map(lambda n: '{"a":' * n + "1" + "}" * n),  # deep nesting
    st.integers(4000, 6000).map(lambda n: '{"n": ' + "9" * n + "}"),  # huge integers
    st.just('{"a": 1e999}'),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=4),
    max_leaves=10,
)


def run_busctl(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.run(busctl, "busctl", args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        else:
            code = 0
    return code, out.getvalue(), err.getvalue()


def rows(db: Database) -> tuple[int, int]:
    with db.engine.connect() as conn:
        return (
            conn.execute(sa.select(sa.func.count()).select_from(bus_commands)).scalar_one(),
            conn.execute(sa.select(sa.func.count()).select_from(task_events)).scalar_one(),
        )


@st.composite
def enqueue_args(draw: st.DrawFn) -> list[str]:
    args = ["enqueue"]
    if draw(st.booleans()):
        args += ["--agent", draw(st.sampled_from(["codex", "ron"]) | text)]
    chain = draw(st.sampled_from(["models", "role", "both", "none"]))
    if chain in ("models", "both"):
        args += ["--models", draw(st.sampled_from(["sim/a", "sim/a,sim/b"]) | text)]
    if chain in ("role", "both"):
        args += ["--role", draw(st.sampled_from(["coder"]) | text)]
    if draw(st.booleans()):
        payload = draw(json_values.map(json.dumps) | text | hostile_payloads | any_text)
        args += ["--payload", payload]
    for flag in ("--priority", "--run-after", "--max-attempts", "--key"):
        if draw(st.booleans()):
            number = st.integers(-5, 2_000_000) | st.sampled_from([10**300, 2**63])
            value = draw(number.map(str) | st.floats().map(str) | text | any_text)
            args += [flag, value]
    if draw(st.booleans()):
        args.append(draw(text | any_text))
    return args


def test_fuzzed_enqueue_is_one_line_or_a_task(db_url: str) -> None:
    db = Database(db_url)

    @FUZZ
    @given(enqueue_args())
    def check(args: list[str]) -> None:
        before = rows(db)
        code, out, err = run_busctl(["--db", db_url, *args])
        after = rows(db)
        assert "Traceback" not in out + err
        if code == 0:
            assert out.strip().isdigit(), out
            assert after[0] in (before[0], before[0] + 1)
        else:
            assert code == 2, (code, out, err)
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("busctl: error: "), err
            assert out == ""
            assert after == before  # a refused command changes nothing

    check()
    db.dispose()


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(
            [*Settings.fields_doc(), "providers", "models", "roles", "agents", "bogus"]
        ),
        json_values,
        max_size=6,
    )
)
def test_fuzzed_config_documents_load_or_say_why(doc: dict[str, Any]) -> None:
    try:
        parse_catalog(doc)
        Settings.from_doc(doc, Path("agentbus.toml"), None, {})
    except ConfigError as exc:
        assert exc.message and "\n" not in exc.message


@FUZZ
@given(st.text(max_size=200))
def test_fuzzed_config_text_loads_or_says_why(
    tmp_path_factory: pytest.TempPathFactory, body: str
) -> None:
    path = tmp_path_factory.mktemp("cfg") / "agentbus.toml"
    path.write_text(body, encoding="utf-8")
    try:
        load_config(path, environ={})
    except ConfigError as exc:
        assert exc.message


@st.composite
def task_rows(draw: st.DrawFn) -> dict[str, Any]:
    model = st.sampled_from(["sim/a", "sim/b", "gpt-unknown"]) | text
    return {
        "payload": draw(
            st.one_of(
                json_values,
                st.dictionaries(
                    st.just("simulate"),
                    st.dictionaries(
                        model,
                        json_values
                        | st.sampled_from(
                            ["ok", "rate_limited", "timeout", "fatal", "auth", "error"]
                        ),
                        max_size=3,
                    ),
                ),
            )
        ),
        "models": draw(st.none() | st.lists(model, max_size=3) | json_values),
        "role": draw(st.none() | text),
    }


def test_fuzzed_task_rows_never_crash_the_worker(
    db: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("agentbus.providers.simulated.time.sleep", lambda _s: None)
    queue = TaskQueue(db)
    quick = Settings(call_retries=0, call_retry_wait_sec=0.001)
    cooldowns = CooldownStore(db)
    runner = Runner(
        admission=Admission(
            db, Config(quick, Catalog(), None), worker="fuzz", cooldowns=cooldowns, environ={}
        ),
        providers=Providers(Catalog(), {}),
        worker_id="fuzz",
    )

    counter = itertools.count()

    @FUZZ
    @given(task_rows())
    def check(row: dict[str, Any]) -> None:
        agent = f"fuzz{next(counter)}"  # one agent per example: claim exactly this row
        task_id = queue.enqueue(TaskSpec(agent=agent, command="x", models=("sim/a",))).id
        try:
            with db.engine.begin() as conn:  # the row as another tool might have written it
                conn.execute(
                    sa.update(bus_commands)
                    .where(bus_commands.c.id == task_id)
                    .values(payload=row["payload"], models=row["models"], role=row["role"])
                )
        except sa.exc.DataError:
            reject()  # the database itself refuses such a row (Postgres: NUL, Infinity)
        (task,) = queue.claim(agent, "fuzz", 30)
        assert task.id == task_id
        run = runner.run(task)  # must not raise
        assert isinstance(
            run.decision, (policy.Complete, policy.Pause, policy.Requeue, policy.Fail)
        )
        if isinstance(run.decision, policy.Fail):
            assert run.decision.reason.strip()
        queue.release(task.id, task.claim_token)
        with db.engine.begin() as conn:
            conn.execute(sa.delete(bus_commands).where(bus_commands.c.id == task_id))

    check()


@pytest.mark.parametrize("program", ["busctl", "worker", "sweeper"])
def test_a_password_in_the_config_never_reaches_the_output(
    program: str, tmp_path: Path, run_busctl: Any
) -> None:
    import subprocess
    import sys

    secret = "pw-THAT-MUST-NOT-SHOW"
    config = tmp_path / "agentbus.toml"
    config.write_text(f'database_url = "postgresql://agent:{secret}@127.0.0.1:1/bus"\n')
    args = {"busctl": ["status"], "worker": ["--agent", "codex"], "sweeper": ["--once"]}[program]
    exe = str(Path(sys.executable).with_name(program))
    done = subprocess.run(
        [exe, "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 3  # the database is away: retry later
    assert "cannot connect to postgresql+psycopg://agent:***@127.0.0.1:1/bus" in done.stderr
    assert secret not in done.stdout + done.stderr


# Names the catalog's tables refer to one another by: a small set, so that references
# often resolve (and sometimes loop: roles falling back on each other).
names = st.sampled_from(["a", "b", "sim", "sim/a", "gpt", "x y", ""])
loose = json_values | st.sampled_from([-1, 0, 10**12, 1.5, float("inf"), "", [], {}])
PROVIDER_KEYS = sorted({k for keys in _KEYS.values() for k in keys} | {"bogus"})
TABLE_KEYS = {
    "models": ["provider", "name", "bulkhead", "input_cost_per_1k", "output_cost_per_1k", "params"],
    "roles": ["models", "candidates", "fallback"],
    "agents": ["models", "role", "rate", "rate_window_sec"],
}


def entries(keys: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    """A table's entry: its own keys (and an unknown one now and then), each given a
    plausible name, a list of names or anything at all."""
    value = names | st.lists(names, max_size=3) | loose
    return st.dictionaries(st.sampled_from([*keys, "bogus"]), value, max_size=4)


@st.composite
def catalog_docs(draw: st.DrawFn) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if draw(st.booleans()):
        kinds = st.sampled_from(sorted(_KEYS)) | loose
        doc["providers"] = draw(
            st.dictionaries(
                names,
                entries(PROVIDER_KEYS).flatmap(lambda e: kinds.map(lambda k: {**e, "kind": k})),
                max_size=2,
            )
        )
    for table, keys in TABLE_KEYS.items():
        if draw(st.booleans()):
            doc[table] = draw(st.dictionaries(names, entries(keys) | loose, max_size=3))
    if draw(st.booleans()):
        doc["bulkheads"] = draw(st.dictionaries(names, loose, max_size=2))
    if draw(st.booleans()):
        doc["routing"] = draw(st.dictionaries(st.sampled_from(["default_role", "x"]), names))
    if draw(st.booleans()):
        keys = ["client_rate", "default_concurrency", "circuit_open_sec", "slot_wait_ms"]
        mcp = draw(st.dictionaries(st.sampled_from([*keys, "client_header", "tools"]), loose))
        doc["mcp"] = mcp
    if draw(st.integers(0, 4)) == 0:
        doc[draw(st.sampled_from(SECTIONS))] = draw(loose)  # a table that is not one
    return doc


@FUZZ
@given(catalog_docs())
def test_fuzzed_catalogs_load_or_name_the_table(doc: dict[str, Any]) -> None:
    """The catalog's tables with wrong types, unknown keys, dangling references, loops
    and numbers out of range: a catalog, or a ConfigError of one line naming the table
    (``load_config`` puts the file's path before it)."""
    try:
        parse_catalog(doc)
    except ConfigError as exc:
        assert exc.message and "\n" not in exc.message
        assert exc.message.startswith("["), exc.message  # [providers.a], [mcp], …
