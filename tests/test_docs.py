"""The README and the example config stay true to the code."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentbus.admission.routing import resolve
from agentbus.config import Settings, load_config
from tests.support import Proc

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_and_env_var_is_documented() -> None:
    readme = (ROOT / "README.md").read_text()
    for field in dataclasses.fields(Settings):
        assert f"| `{field.name}` | `AGENTBUS_{field.name.upper()}` |" in readme, field.name


def test_the_example_config_loads() -> None:
    config = load_config(ROOT / "shared/admin/agentbus.example.toml", environ={})
    found = resolve(config.catalog, models=None, role=None, agent="codex", environ=None)
    assert found.candidates[0].model == "claude-opus"


def test_the_example_config_shows_every_catalog_key() -> None:
    from agentbus.catalog import parse as catalog_toml

    text = (ROOT / "shared/admin/agentbus.example.toml").read_text()
    keys = set().union(*catalog_toml._KEYS.values()) | {"key_env", "rpm", "models", "candidates"}
    keys |= {"fallback", "role", "rate", "rate_window_sec", "bulkhead", "default_role"}
    keys |= {"input_cost_per_1k", "output_cost_per_1k", "provider", "name", "account", "params"}
    keys |= {*catalog_toml._MCP_COUNTS, *catalog_toml._MCP_TIMES, "client_header", "concurrency"}
    for key in sorted(keys):
        shown = (f"{key} =", f".{key}.", f"{{ {key} =")  # a key, a table, an inline key
        assert any(form in text for form in shown), key
    for setting in Settings.fields_doc():
        if setting.startswith(("circuit_", "admission_", "daily_", "rpm_", "global_")):
            assert f"\n{setting} =" in text, setting


def test_the_python_example_in_the_readme_runs(
    tmp_path: Path, spawn: Callable[..., Proc], run_busctl: Callable[..., Any]
) -> None:
    """The README's producer example, run as a user would beside a worker (SQLite)."""
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## From Python") :]
    example = section[section.index("```python\n") + 10 : section.index("```\n", 10)]
    assert run_busctl("migrate", cwd=tmp_path).returncode == 0
    url = f"sqlite:///{tmp_path / 'ops_multiagent.db'}"
    worker = spawn("worker", "--agent", "codex", "--db", url)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBUS_")}
    ran = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    worker.signal(signal.SIGTERM)
    assert worker.wait() == 0
    assert ran.returncode == 0, ran.stderr
    first, second = ran.stdout.splitlines()
    assert first.startswith("done [sim/a] done: Summarise the macro news")
    assert (
        second
        == "[<TaskStatus.DONE: 'done'>, <TaskStatus.DONE: 'done'>, <TaskStatus.DONE: 'done'>]"
    )
