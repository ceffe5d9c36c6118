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


SECRET_IN_A_TRACEBACK = """
import sys
from agentbus import masking
from agentbus.logging import configure, get_logger
masking.register(["sk-test-0123456789abcdef"])
configure(json=sys.argv[1] == "json")
try:
    raise RuntimeError("the key sk-test-0123456789abcdef was refused")
except RuntimeError:
    get_logger("t").exception("failed")
"""


def test_a_logged_traceback_is_masked_in_both_formats() -> None:
    """A secret in an exception's message does not reach a log line through its
    traceback, readable or JSON."""
    for form in ("text", "json"):
        out = subprocess.run(
            [sys.executable, "-c", SECRET_IN_A_TRACEBACK, form],
            capture_output=True,
            text=True,
            check=True,
        )
        assert "RuntimeError: the key *** was refused" in out.stderr.replace("\\n", "\n"), form
        assert "0123456789abcdef" not in out.stderr, form
