"""The gateway's answers, as immutable values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Union

__all__ = [
    "FenceState",
    "LeaseState",
    "SqlColumn",
    "SqlOutcome",
    "SqlResult",
    "Statement",
    "StoredObject",
    "WriteResult",
]


@dataclass(frozen=True)
class WriteResult:
    """An accepted ``PUT`` or ``DELETE``: committed, with the fence at least ``token``."""

    resource: str
    key: str
    token: int
    version: int
    """The object's version after the write; versions rise by one per write of a key."""
    created: bool = False
    """``True`` when a ``PUT`` created the object (``201``)."""


@dataclass(frozen=True)
class StoredObject:
    """An object read with ``GET``."""

    value: bytes
    version: int
    token: int
    """The token of the write that stored this value."""

    def text(self, encoding: str = "utf-8") -> str:
        """The value decoded as text."""
        return self.value.decode(encoding)


@dataclass(frozen=True)
class FenceState:
    """A resource's fence."""

    resource: str
    highest: int | None
    """The highest accepted token, ``None`` if nothing was ever accepted."""


@dataclass(frozen=True)
class LeaseState:
    """A lease hosted by the gateway, as it stands after a request."""

    resource: str
    held: bool
    holder: str | None
    identity: str | None
    """The authenticated identity the lease is bound to (with ``--auth-file``)."""
    token: int | None
    expires_in_ms: int
    """How long the lease still holds, on the gateway's clock."""


@dataclass(frozen=True)
class Statement:
    """One statement of a fenced SQL transaction (``POST /v1/sql``), with ``$n``
    parameters."""

    sql: str
    params: Sequence[Any] = ()


StatementLike = Union[Statement, str, tuple[str, Sequence[Any]]]
"""A :class:`Statement`, SQL text without parameters, or ``(sql, params)``."""


@dataclass(frozen=True)
class SqlColumn:
    """A result column: its name and Postgres type."""

    name: str
    type: str


@dataclass(frozen=True)
class SqlResult:
    """The result of one statement."""

    rows_affected: int
    columns: Sequence[SqlColumn] = ()
    rows: Sequence[Sequence[Any]] = ()
    truncated: bool = False
    """Rows past the gateway's ``--sql-max-rows`` were left out."""


@dataclass(frozen=True)
class SqlOutcome:
    """A committed fenced SQL transaction."""

    resource: str
    token: int
    results: Sequence[SqlResult] = field(default_factory=tuple)
