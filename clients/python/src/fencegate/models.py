"""The gateway's answers, as immutable values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

__all__ = [
    "FenceState",
    "IfMatch",
    "LeaseState",
    "SqlColumn",
    "SqlOutcome",
    "SqlResult",
    "Statement",
    "StoredObject",
    "TxnAdvance",
    "TxnCheck",
    "TxnDelete",
    "TxnOp",
    "TxnOutcome",
    "TxnPut",
    "TxnResult",
    "WriteResult",
]

IfMatch = Optional[Union[int, Literal["*"]]]
"""``If-Match``: a version (``0``: the object must not exist), or ``"*"`` (it must)."""


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
    replayed: bool = False
    """``True`` when the answer is the one stored for an earlier attempt with the same
    ``Idempotency-Key`` (``Idempotency-Replayed: true``): the write was applied once,
    by that attempt."""


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
    replayed: bool = False
    """An advance's stored answer, replayed (see :attr:`WriteResult.replayed`)."""


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
    """How long the lease still holds, on the gateway's clock (for a replayed answer:
    as it was when first answered)."""
    replayed: bool = False
    """A lease step's stored answer, replayed (see :attr:`WriteResult.replayed`)."""


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
    replayed: bool = False
    """The stored answer of an earlier attempt, replayed (see
    :attr:`WriteResult.replayed`)."""


# ---------------------------------------------------------------- /v1/txn


@dataclass(frozen=True)
class TxnPut:
    """A transaction's write of the object ``resource/key``, as ``PUT /v1/kv``.

    ``value`` text is sent as such, bytes as base64. ``if_match``: a version the object
    must be at (``0``: it must not exist), or ``"*"`` (it must exist).
    """

    resource: str
    key: str
    value: bytes | str
    token: int
    if_match: IfMatch = None


@dataclass(frozen=True)
class TxnDelete:
    """A transaction's delete of the object ``resource/key``, as ``DELETE /v1/kv``."""

    resource: str
    key: str
    token: int
    if_match: IfMatch = None


@dataclass(frozen=True)
class TxnAdvance:
    """A transaction's raise of ``resource``'s fence to ``token``."""

    resource: str
    token: int


@dataclass(frozen=True)
class TxnCheck:
    """A requirement, without writing, that ``resource``'s fence is not above ``token``
    and, with ``key``, that the object is at ``version`` (``0``: it does not exist).
    Held until the commit: no newer term can begin on the resource in between."""

    resource: str
    token: int
    key: str | None = None
    version: int | None = None


TxnOp = Union[TxnPut, TxnDelete, TxnAdvance, TxnCheck]
"""One operation of :meth:`Gateway.txn <fencegate.Gateway.txn>`."""


@dataclass(frozen=True)
class TxnResult:
    """What one operation of a committed transaction did."""

    op: Literal["put", "delete", "advance", "check"]
    resource: str
    token: int
    key: str | None = None
    version: int | None = None
    """The object's version after the transaction (``check``: the version it was found
    at); ``None`` for an advance and a check without a key."""
    created: bool = False
    """``True`` when a put created the object."""


@dataclass(frozen=True)
class TxnOutcome:
    """A committed transaction: one result per operation, in order."""

    results: Sequence[TxnResult]
    replayed: bool = False
    """The stored answer of an earlier attempt, replayed (see
    :attr:`WriteResult.replayed`)."""
