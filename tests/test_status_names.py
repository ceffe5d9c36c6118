"""Every task status written as a literal, in SQL or in the dashboard, is one of
``TaskStatus``: the views and indexes the migrations made, the shipped KPI queries,
the statements in the code and the docs, and the dashboard's reads of the totals."""

from __future__ import annotations

import re
from pathlib import Path

import sqlalchemy as sa

from agentbus.db import Database
from agentbus.queue.states import TaskStatus

ROOT = Path(__file__).resolve().parent.parent
STATUSES = {s.value for s in TaskStatus}

# A status column compared with literals: ``status = 'paused'``, ``to_status IN ('failed',
# 'error')``, and PostgreSQL's own spelling of a stored view, ``(to_status)::text =
# ANY (ARRAY['failed'::character varying, ...])``.
_COMPARED = re.compile(
    r"\b(?:from_|to_)?status\b\)?(?:::\w+(?: varying)?)?\s*"
    r"(?:=|<>|!=|(?:NOT\s+)?IN\s*\(|=\s*ANY\s*\(\s*(?:\(\s*)?ARRAY\[)\s*"
    r"((?:'\w+'(?:::\w+(?: varying)?)?\)?\s*,?\s*)+)",
    re.IGNORECASE,
)
# The KPI views' ``outcome`` is the status a task went to next.
_OUTCOME = re.compile(r"\boutcome\s*=\s*'(\w+)'")


def literals(text: str) -> list[str]:
    found = [w for m in _COMPARED.finditer(text) for w in re.findall(r"'(\w+)'", m.group(1))]
    return found


def test_the_pattern_reads_each_spelling() -> None:
    """The pattern itself: a literal it missed would pass the checks below unseen."""
    assert literals("WHERE status = 'paused' AND x = 'y'") == ["paused"]
    assert literals("e.to_status IN ('failed', 'error')") == ["failed", "error"]
    assert literals(
        "((e.to_status)::text = ANY ((ARRAY['failed'::character varying, "
        "'error'::character varying])::text[]))"
    ) == ["failed", "error"]
    assert literals("(status)::text = 'queued'::text") == ["queued"]
    assert literals("r.outcome IN ('rate_limited')") == []


def test_the_shipped_sql_and_code_name_only_statuses() -> None:
    files = [
        *(ROOT / "shared").rglob("*.py"),
        *(ROOT / "worker").rglob("*.py"),
        *(ROOT / "sweeper").rglob("*.py"),
        *(ROOT / "migrations").rglob("*.py"),
        *(ROOT / "shared").rglob("*.sql"),
        *(ROOT / "docs").glob("*.md"),
        ROOT / "README.md",
    ]
    seen: dict[str, set[str]] = {}
    for path in files:
        for word in literals(path.read_text()):
            seen.setdefault(word, set()).add(str(path.relative_to(ROOT)))
    unknown = {word: places for word, places in seen.items() if word not in STATUSES}
    assert not unknown, f"not a task status: {unknown}"
    assert {"queued", "claimed", "paused", "done", "failed", "error"} <= set(seen)
    kpi_queries = (ROOT / "shared/admin/kpi.py").read_text()
    outcomes = set(_OUTCOME.findall(kpi_queries))
    assert outcomes and outcomes <= STATUSES


def test_the_dashboard_reads_totals_by_status() -> None:
    page = (ROOT / "shared/admin/dashboard.html").read_text()
    keys = set(re.findall(r"\btotals\.(\w+)", page))
    assert keys and keys <= STATUSES, keys - STATUSES


def test_the_database_names_only_statuses(db: Database) -> None:
    """The views and indexes as the database holds them after every migration, and the
    status CHECK constraint, which must allow exactly ``TaskStatus``."""
    if db.dialect == "sqlite":
        query = "SELECT sql FROM sqlite_master WHERE type IN ('view', 'index', 'table')"
    else:
        query = (
            "SELECT definition FROM pg_views WHERE schemaname = 'public' UNION ALL "
            "SELECT indexdef FROM pg_indexes WHERE schemaname = 'public' UNION ALL "
            "SELECT pg_get_constraintdef(oid) FROM pg_constraint WHERE contype = 'c'"
        )
    texts = db.read(lambda conn: [r[0] for r in conn.execute(sa.text(query)) if r[0]])
    words = [w for text in texts for w in literals(text)]
    assert set(words) - STATUSES == set()
    assert {"queued", "claimed", "paused", "done", "failed", "error"} <= set(words)
    checks = [text for text in texts if "cancelled" in text and "queued" in text]
    allowed = {w for text in checks for w in literals(text)}
    assert allowed == STATUSES
