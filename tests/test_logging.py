"""The logging set-up of agentbus's own processes (commands, workers, the sweeper)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

PROCESS = """
import sys
from agentbus.logging import configure, get_logger
configure()
print("rich" in sys.modules)
try:
    1 / 0
except ZeroDivisionError:
    get_logger("t").exception("failed")
import rich
print(rich.LOADED)
"""


def test_a_process_logs_without_loading_pretty_printers_it_never_uses(tmp_path: Path) -> None:
    """An installed rich is not imported with structlog (start-up time and memory);
    tracebacks print plainly; the process may still import rich itself."""
    (tmp_path / "rich").mkdir()
    (tmp_path / "rich" / "__init__.py").write_text("LOADED = True\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", PROCESS], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["False", "True"]
    assert "Traceback (most recent call last)" in out.stderr
    assert "ZeroDivisionError: division by zero" in out.stderr
