"""Importing our libraries without optional modules that our processes never use.

Many libraries import an optional module inside ``try: import x`` / ``except
ImportError`` and work without it. In one of agentbus's own processes (a worker,
the sweeper, a command), the modules are hidden while the library loads, so the
process does not pay for them. A program that imports agentbus as a library is
never affected.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from importlib.util import find_spec

#: Pretty-printers structlog loads at import when they are installed, for tracebacks
#: our lines never show (rich alone: ~50 ms of a process's start-up and ~5 MB).
UNUSED_BY_STRUCTLOG = ("rich", "better_exceptions")


def unused_by_sqlalchemy(exists: Callable[[str], bool] | None = None) -> tuple[str, ...]:
    """What importing SQLAlchemy loads that a worker and the sweeper never use. Both load
    OpenSSL's libcrypto (~3.5 MB resident): asyncio's TLS support (``ssl``; these
    processes run threads, not asyncio) and hashlib's OpenSSL constructors
    (``_hashlib``). Without the latter, hashlib uses Python's own md5 and sha256 (all
    that SQLAlchemy's labels and our credential fingerprints hash with), so
    ``_hashlib`` is left alone where this Python was built without them (some
    distributions leave every hash but blake2 to OpenSSL). ``exists`` says whether a
    module can be imported."""
    exists = exists or (lambda name: find_spec(name) is not None)
    own = exists("_md5") and (exists("_sha2") or exists("_sha256"))  # _sha2 from 3.12
    return ("ssl", "_hashlib") if own else ("ssl",)


def import_sqlalchemy() -> None:
    """Import SQLAlchemy without ``unused_by_sqlalchemy()``, once, before anything else
    imports it. Later imports of those modules work as usual (httpx loads ``ssl`` for an
    HTTP provider; psycopg's binary package loads it on PostgreSQL)."""
    if "sqlalchemy" not in sys.modules:
        with hidden(*unused_by_sqlalchemy()):
            import sqlalchemy  # noqa: F401


def import_psycopg() -> None:
    """Import psycopg without ``ssl``, once, before anything else imports it (a PostgreSQL
    process's engine, its listener). psycopg imports asyncio for its async connections,
    and asyncio imports ``ssl`` for its TLS support: the system's OpenSSL (~4 MB
    resident), which a worker and the sweeper never use. psycopg's compiled
    implementations (the binary package, or psycopg-c) connect over TLS through libpq,
    which brings its own. Its pure-Python implementation imports ``ssl`` on purpose
    (libcrypto before libpq): where that is the one installed, the lean import fails and
    psycopg is imported as usual, later, by whoever needs it."""
    if "psycopg" not in sys.modules and find_spec("psycopg") is not None:
        with contextlib.suppress(ImportError), hidden("ssl"):
            import psycopg  # noqa: F401


def import_structlog() -> None:
    """Import structlog without ``UNUSED_BY_STRUCTLOG``, once, before anything else
    imports it; a printer the process imported itself stays as it is."""
    if "structlog" not in sys.modules:
        with hidden(*UNUSED_BY_STRUCTLOG):
            import structlog  # noqa: F401


@contextlib.contextmanager
def hidden(*names: str) -> Iterator[None]:
    """Inside: importing any of ``names`` raises ImportError, unless it is imported
    already. After: they import as usual. A module that was imported inside and got
    the ImportError goes on without them."""
    hide = [name for name in names if name not in sys.modules]
    for name in hide:
        sys.modules[name] = None  # type: ignore[assignment]  # "import name" raises
    try:
        yield
    finally:
        for name in hide:
            if sys.modules.get(name, ()) is None:
                del sys.modules[name]
