"""Column types that read whatever a row holds: SQLite keeps any value in any column,
and operators write rows by hand. Each reads a value of another type as its own, or as
None (a marked 0 where the column is NOT NULL: ``not_null``), so that no reader of
``agentbus.schema``'s tables meets a string where it does arithmetic. Which rows hold
such values is said by ``agentbus.queue.malformed``."""

from __future__ import annotations

import json
import math
from typing import Any

import sqlalchemy as sa


class InvalidJSON(str):
    """A JSON column's text that does not parse (a row written by hand or by an older tool)."""


class LenientJSON(sa.TypeDecorator[Any]):
    """JSON that reads a malformed value as ``InvalidJSON`` instead of raising.

    A task row with a broken payload must fail that task with a reason, not
    crash every worker that claims it. (Postgres validates json itself.)
    """

    impl = sa.JSON
    cache_ok = True

    def result_processor(self, dialect: sa.Dialect, coltype: object) -> Any:
        if dialect.name != "sqlite":  # the driver decodes, and the server validated
            return super().result_processor(dialect, coltype)

        def process(value: Any) -> Any:
            if not isinstance(value, (str, bytes)):
                return value
            try:
                return json.loads(value)
            except ValueError:
                return InvalidJSON(
                    value if isinstance(value, str) else value.decode(errors="replace")
                )

        return process


def _text(value: Any) -> Any:
    if value is None or type(value) is str:
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


class UnreadInt(int):
    """0 read from a NOT NULL whole-number column that holds no number (``stored``): it
    counts as 0 for every reader, and a task's reader (``Task.from_row``) knows it for
    what it is: ``type(value) is not int``."""

    stored: Any


class UnreadFloat(float):
    """0.0 read from a NOT NULL time or span that holds no finite number (``stored``)."""

    stored: Any


def _unread(kind: type[Any], stored: Any) -> Any:
    value = kind(0)
    value.stored = stored
    return value


def _integer(fallback: int | None) -> Any:
    def read(value: Any) -> Any:
        if type(value) is int:
            return value
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            return int(value)
        # NULL stays None: an aggregate over no rows (MIN of a NOT NULL column) is NULL.
        return None if fallback is None or value is None else _unread(UnreadInt, value)

    return read


def _real(fallback: float | None) -> Any:
    def read(value: Any) -> Any:
        if type(value) is float and math.isfinite(value):
            return value
        if type(value) is int:
            return float(value)
        return None if fallback is None or value is None else _unread(UnreadFloat, value)

    return read


class Text(sa.TypeDecorator[str]):
    """TEXT, read as text on SQLite whatever was stored (bytes decoded, numbers spelt)."""

    impl = sa.Text
    cache_ok = True

    def result_processor(self, dialect: sa.Dialect, coltype: object) -> Any:
        return _text if dialect.name == "sqlite" else None


class Integer(sa.TypeDecorator[int]):
    """INTEGER, read on SQLite as an int, or as ``fallback`` when it holds none (0 for
    the columns that are NOT NULL: see the end of this module)."""

    impl = sa.Integer
    cache_ok = True

    def __init__(self, fallback: int | None = None) -> None:
        super().__init__()
        self.fallback = fallback

    def result_processor(self, dialect: sa.Dialect, coltype: object) -> Any:
        return _integer(self.fallback) if dialect.name == "sqlite" else None


class BigInteger(Integer):
    impl = sa.BigInteger
    cache_ok = True


class Real(sa.TypeDecorator[float]):
    """Seconds (a time: Unix epoch seconds; or a span) in double precision, read as a
    finite float, or as ``fallback`` when it holds none (text on SQLite, NaN or an
    infinity anywhere; 0.0 for the columns that are NOT NULL)."""

    impl = sa.Float
    cache_ok = True

    def __init__(self, fallback: float | None = None) -> None:
        super().__init__()
        self.fallback = fallback

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        real = sa.REAL() if dialect.name == "sqlite" else sa.Float(precision=53)
        return dialect.type_descriptor(real)

    def result_processor(self, dialect: sa.Dialect, coltype: object) -> Any:
        return _real(self.fallback)


class Float(Real):
    """FLOAT (as ``sa.Float`` makes it: double precision), read as ``Real`` reads."""

    cache_ok = True

    def load_dialect_impl(self, dialect: sa.Dialect) -> sa.types.TypeEngine[Any]:
        return dialect.type_descriptor(sa.Float())


def not_null(table: sa.Table) -> None:
    """A NOT NULL number of ``table`` that holds no number reads as a marked 0: readers
    compare and add these."""
    for column in table.columns:
        if not column.nullable and isinstance(column.type, (Integer, Real)):
            column.type = type(column.type)(fallback=0)
