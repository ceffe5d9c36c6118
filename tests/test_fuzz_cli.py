"""Every command line fed generated arguments (hypothesis): each subcommand of busctl,
worker and sweeper, given a mix of its own options and arbitrary words, exits 0, 1,
2, 3 or 4 and never prints a traceback."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import click
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from agentbus import cli
from agentbus.admin.busctl import busctl
from agentbus.sweeper.cli import sweeper
from agentbus.worker.cli import worker
from tests.fuzzing import FUZZ

#: Commands that run until stopped (a server, a follower, the live demo): their
#: arguments are checked by the other tests; here they would never return.
ENDLESS = {"busctl serve", "busctl demo"}
#: What keeps a service's run short: it does one pass and exits.
ONE_PASS = {"worker": ["--drain", "--max-tasks", "1"], "sweeper": ["--once"]}


def commands(command: click.Command, path: str) -> Iterator[tuple[str, click.Command]]:
    yield path, command
    if isinstance(command, click.Group):
        for name, sub in sorted(command.commands.items()):
            yield from commands(sub, f"{path} {name}")


ALL = [
    (path, command)
    for root, name in ((busctl, "busctl"), (worker, "worker"), (sweeper, "sweeper"))
    for path, command in commands(root, name)
    if path not in ENDLESS
]
ROOTS = {"busctl": busctl, "worker": worker, "sweeper": sweeper}

words = st.one_of(
    st.sampled_from(
        ["-", "--", "0", "-1", "1e999", "nan", "@missing.json", "{}", "[]", "sim/a", "codex"]
    ),
    st.integers(-(2**70), 2**70).map(str),
    # Lone surrogates, NULs, newlines; no absolute path (``busctl init PATH`` writes one).
    st.text(st.characters(), max_size=12).filter(lambda w: not w.startswith(("/", "~"))),
)


plausible = st.sampled_from(["1", "2", "3", "codex", "sim/a", "sim/a,sim/b", "queued", "5m"])


def values(param: click.Parameter) -> st.SearchStrategy[list[str]]:
    """What may follow one of the command's options, or stand for one of its arguments:
    mostly values of its type (so that the command itself runs), sometimes any word."""
    kind = param.type
    if isinstance(kind, click.Choice):
        right: st.SearchStrategy[str] = st.sampled_from([str(c) for c in kind.choices])
    elif isinstance(kind, (click.IntRange, click.FloatRange)) or kind in (click.INT, click.FLOAT):
        right = st.integers(-3, 10**6).map(str) | st.sampled_from(["0.5", "1e9", "-0"])
    else:
        right = plausible
    one = right | right | words
    if isinstance(param, click.Option) and (param.is_flag or param.count):
        return st.just([])
    if isinstance(param, click.Argument) and param.nargs == -1:
        return st.lists(one, max_size=3)
    return one.map(lambda v: [v])


@st.composite
def invocations(draw: st.DrawFn) -> tuple[str, list[str]]:
    path, command = draw(st.sampled_from(ALL))
    args: list[str] = []
    for param in command.params:
        if isinstance(param, click.Argument):
            args += draw(values(param))
        elif draw(st.integers(0, 3)) == 0:  # an option now and then
            args += [draw(st.sampled_from(param.opts)), *draw(values(param))]
    if draw(st.integers(0, 4)) == 0:  # and a stray word
        args.insert(draw(st.integers(0, len(args))), draw(words))
    return path, args


def said(program: click.Command, prog: str, args: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            cli.run(program, prog, args)
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        else:
            code = 0
        finally:  # the command set logging up for its process: the next test logs as default
            structlog.reset_defaults()
    return code, out.getvalue() + err.getvalue()


@pytest.fixture
def in_tmp(tmp_path: Path) -> Iterator[Path]:
    """Run in an empty folder (``busctl init`` writes one), with no config around."""
    here = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(here)


def test_every_command_takes_any_arguments(db_url: str, in_tmp: Path) -> None:
    @FUZZ
    @given(invocations())
    def check(invocation: tuple[str, list[str]]) -> None:
        path, args = invocation
        prog, *sub = path.split()
        if "--follow" in args or "-f" in args:
            args = [a for a in args if a not in ("--follow", "-f")]
        full = ["--db", db_url, *sub, *args] if prog == "busctl" else [*args, "--db", db_url]
        full += ONE_PASS.get(prog, [])
        if prog == "worker" and "--agent" not in args:
            full += ["--agent", "codex"]
        code, text = said(ROOTS[prog], prog, full)
        assert "Traceback" not in text, (full, text)
        assert code in (0, 1, 2, 3, 4), (full, code, text)

    check()
