"""The logging set-up of agentbus's own processes (commands, workers, the sweeper)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from agentbus.logging import PlainLines, console

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


# Texts of the characters that make ConsoleRenderer quote a value, and any texts.
_text = st.text(st.sampled_from(" \t=\r\n\"'xé"), max_size=6) | st.text(max_size=6)
_scalar = st.one_of(_text, st.integers(), st.floats(allow_nan=False), st.booleans(), st.none())
_value = st.one_of(
    _scalar, st.lists(_scalar, max_size=3), st.dictionaries(_text, _scalar, max_size=2)
)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.dictionaries(
        st.text("abcdefghijklmnopqrstuvwxyz_", min_size=1, max_size=8), _value, max_size=5
    ),
    columns=st.fixed_dictionaries(
        {},
        optional={
            "timestamp": st.one_of(_text, st.none()),
            "level": st.sampled_from(["debug", "info", "warning", "error", "exception"]),
            "event": st.one_of(_text, st.integers()),
            "logger": _text,
            "logger_name": _text,
            "exception": _text,
            "stack": _text,
            "exc_info": st.just(False),
        },
    ),
)
def test_plain_lines_are_the_console_renderers_lines(
    fields: dict[str, Any], columns: dict[str, Any]
) -> None:
    """A worker's lines in a log file are rendered without structlog's ConsoleRenderer
    (a tenth of a no-op task's CPU), and read exactly as it renders them."""
    event = {**fields, **columns}
    ours = PlainLines(console(colors=False))(None, "info", dict(event))
    assert ours == console(colors=False)(None, "info", dict(event))
