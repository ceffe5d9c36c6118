"""The README, docs/ and the example config stay true to the code: links resolve, the
first task's commands and the Python examples run, the settings page is current."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click
import pytest

from agentbus import AgentBus, AsyncAgentBus
from agentbus.admin.busctl import busctl
from agentbus.admission.routing import resolve
from agentbus.config import Settings, load_config
from agentbus.sweeper.cli import sweeper
from agentbus.worker.cli import worker
from tests.support import Proc, script

ROOT = Path(__file__).resolve().parents[1]


def test_every_setting_and_env_var_is_documented() -> None:
    page = (ROOT / "docs/settings.md").read_text()
    for field in dataclasses.fields(Settings):
        assert f"| `{field.name}` | `AGENTBUS_{field.name.upper()}` |" in page, field.name
    assert page == script("settings_table").page(), "run: python scripts/settings_table.py"


def _commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in command.commands.items():
            yield from _commands(sub, f"{path} {name}")


def test_every_command_option_and_method_is_documented() -> None:
    """Nothing a user can do goes unsaid: each command, each of its long options and
    each public method of the producer API is named somewhere under docs/."""
    docs = "\n".join(page.read_text() for page in (ROOT / "docs").glob("*.md"))
    missing = []
    for root, name in ((busctl, "busctl"), (worker, "worker"), (sweeper, "sweeper")):
        for path, command in _commands(root, name):
            missing += [path] if f"{path}" not in docs else []
            longs = [o for p in command.params for o in p.opts if o.startswith("--")]
            missing += [f"{path} {o}" for o in longs if o not in docs]
    api = (ROOT / "docs/python-api.md").read_text()
    for cls in (AgentBus, AsyncAgentBus):
        public = [n for n, _ in inspect.getmembers(cls) if not n.startswith("_")]
        missing += [f"{cls.__name__}.{n}" for n in public if f"`{n}(" not in api]
    assert not missing


def test_the_design_layout_names_every_module() -> None:
    """docs/design.md's layout matches the tree: each package's folder is a row and each
    module is named in it; a module added, moved or renamed must be said there."""
    design = (ROOT / "docs/design.md").read_text()
    layout = design.split("## Layout", 1)[1].split("\n## ", 1)[0]
    folders = [ROOT / "shared", ROOT / "worker", ROOT / "sweeper"]
    packages = {p.parent for folder in folders for p in folder.glob("**/__init__.py")}
    rows = {f"| `{p.relative_to(ROOT)}/` |" for p in packages}
    assert {row for row in rows if row not in layout} == set()
    modules = [m for p in packages for m in p.glob("*.py") if m.name != "__init__.py"]
    unnamed = [
        str(m.relative_to(ROOT))
        for m in modules
        if not re.search(rf"`([a-z_]+\.)*{m.stem}`", layout)
    ]
    assert len(modules) > 60 and unnamed == []


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def test_every_relative_link_resolves() -> None:
    pages = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
    links = 0
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # not in code blocks
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # http:, https:, mailto:
            path, _, anchor = target.partition("#")
            found = (page.parent / path).resolve() if path else page
            assert found.exists(), f"{page.name}: {target}"
            if anchor and found.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", found.read_text(), flags=re.M)
                assert anchor in {_slug(h) for h in headings}, f"{page.name}: {target}"
            links += 1
    assert links > 40


def _section(text: str, heading: str, fence: str) -> str:
    section = text[text.index(heading) :]
    start = section.index(f"```{fence}\n") + len(fence) + 4
    return section[start : section.index("```\n", start)]


def test_the_first_task_in_the_readme_runs(tmp_path: Path, run_busctl: Callable[..., Any]) -> None:
    """Its commands, run as a user would in a fresh folder: one task done, one paused."""
    shell = _section((ROOT / "README.md").read_text(), "## A first task", "sh")
    commands = [
        re.sub(r"\s+#.*$", "", line).strip()
        for line in shell.replace("\\\n", " ").splitlines()
        if line.strip()
    ]
    assert len(commands) == 5
    bindir = Path(sys.executable).parent
    env = {k: v for k, v in os.environ.items() if not k.startswith("AGENTBUS_")}
    for command in commands:
        ran = subprocess.run(
            command.replace(".venv/bin/", f"{bindir}/"),
            shell=True,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert ran.returncode == 0, (command, ran.stderr)
    shown = run_busctl("tasks", "--json", cwd=tmp_path)
    assert sorted(t["status"] for t in json.loads(shown.stdout)) == ["done", "paused"]


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


@pytest.mark.parametrize(
    ("page", "heading"),
    [("README.md", "## A first task"), ("docs/python-api.md", "# The Python API")],
)
def test_the_python_examples_run(
    tmp_path: Path,
    spawn: Callable[..., Proc],
    run_busctl: Callable[..., Any],
    page: str,
    heading: str,
) -> None:
    """The README's producer example and the API page's, each run as a user would beside a
    worker (SQLite)."""
    example = _section((ROOT / page).read_text(), heading, "python")
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
    first, *rest = ran.stdout.splitlines()
    assert first.startswith("done [sim/a] done: Summarise the macro news")
    if page != "README.md":
        assert rest == [
            "[<TaskStatus.DONE: 'done'>, <TaskStatus.DONE: 'done'>, <TaskStatus.DONE: 'done'>]"
        ]
