"""The errors of fencegate, one class per stable error code.

Every error this package raises is a :class:`FencegateError`. An error answer of the
gateway is raised as the class of its ``error`` code (``409 stale_token`` as
:class:`StaleToken`, ``503 overloaded`` as :class:`Overloaded`, ...), and the fence
inside Postgres raises the same classes from its SQLSTATEs (``ZF001`` as
:class:`StaleToken`, ``ZF005`` as :class:`TokenNotIssued`), so a writer handles a stale
term the same way whichever door it wrote through.

Two groups matter for what to do next:

- :class:`FenceError`: the fence refused the token. A :class:`StaleToken` means the
  writer's term is over: stop the work of that term, never retry it with the same
  token, and do not fetch a newer token to push the old work through.
- :class:`TransientError`: the gateway or its database could not answer now. Nothing
  about the term is known; retry later, with the same ``Idempotency-Key``.
  ``write_applied`` says whether a write may have been applied (``False``: certainly
  not; ``None``: unknown). The gateways of this package have already resent the write
  (see :class:`~fencegate.RetryPolicy`) before raising one.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

__all__ = [
    "ERROR_CLASSES",
    "BackendUnavailable",
    "BodyTimeout",
    "BodyTooLarge",
    "FenceError",
    "FencegateError",
    "Forbidden",
    "GatewayUnreachable",
    "IdempotencyInFlight",
    "IdempotencyKeyReused",
    "IdempotencyQuotaExceeded",
    "Internal",
    "InvalidBody",
    "InvalidHolder",
    "InvalidIdempotencyKey",
    "InvalidKey",
    "InvalidParam",
    "InvalidPrecondition",
    "InvalidResource",
    "InvalidToken",
    "InvalidTransaction",
    "IssuerUnavailable",
    "LeaseHeld",
    "LeaseLost",
    "MethodNotAllowed",
    "MissingToken",
    "NotFound",
    "NotSupportedByBackend",
    "NotSynchronouslyReplicated",
    "Overloaded",
    "ResetRefused",
    "ShuttingDown",
    "SqlDisabled",
    "SqlError",
    "StaleResource",
    "StaleToken",
    "StatementNotAllowed",
    "TokenHolderMismatch",
    "TokenNotIssued",
    "TokensExhausted",
    "TooManyOperations",
    "TooManyStatements",
    "TransientError",
    "Unauthenticated",
    "UnsupportedType",
    "VersionMismatch",
    "error_for_code",
    "parse_fence_detail",
]


class FencegateError(Exception):
    """Base class of every error raised by this package.

    Attributes:
        message: The sentence that explains the error (the gateway's ``message``, or
            Postgres's primary message).
        status: The HTTP status of the gateway's answer, or ``None`` when there was no
            answer or the error came from Postgres.
        body: The answer's JSON fields (``error``, ``message`` and the code's extra
            fields), also for errors built from a Postgres error, so that both doors
            read alike.
        sqlstate: The Postgres SQLSTATE behind the error, if any (``ZF001`` for a stale
            token in a fenced table, the writer's statement's for ``sql_error``).
    """

    code: ClassVar[str | None] = None
    """The stable ``error`` code of the class, ``None`` for groups and local errors."""

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        body: Mapping[str, Any] | None = None,
        sqlstate: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.body: dict[str, Any] = dict(body or {})
        self.sqlstate = sqlstate if sqlstate is not None else _opt_str(self.body, "sqlstate")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, status={self.status!r})"


# ---------------------------------------------------------------- groups


class FenceError(FencegateError):
    """The fence refused the token: over HTTP, or inside Postgres (SQLSTATE class ZF).

    Raised as itself for the ZF codes that have no class of their own (``ZF002`` no
    token, ``ZF003`` not a token, ``ZF004`` not a resource name, and any newer one);
    ``detail`` holds the DETAIL's ``key=value`` pairs.
    """

    @property
    def detail(self) -> dict[str, str]:
        """The ``key=value`` pairs of the Postgres DETAIL (empty over HTTP)."""
        raw = self.body.get("detail")
        return parse_fence_detail(raw) if isinstance(raw, str) else {}


class TransientError(FencegateError):
    """No decision was made now; the same request may succeed later.

    Attributes:
        write_applied: For a write: ``False`` if it was certainly not applied, ``None``
            if it may have been (the connection or the database went away after the
            request was sent, by this attempt or an earlier one). Never ``True``: an
            applied write is not an error.
        retry_after: Seconds the gateway asked to wait (``Retry-After``), if it did.
        attempts: How many times the write was sent, all with the same
            ``Idempotency-Key``, before this error was raised.
    """

    def __init__(
        self,
        message: str,
        *,
        status: int | None = None,
        body: Mapping[str, Any] | None = None,
        sqlstate: str | None = None,
        write_applied: bool | None = False,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message, status=status, body=body, sqlstate=sqlstate)
        self.write_applied = write_applied
        self.retry_after = retry_after
        self.attempts = 1


class GatewayUnreachable(TransientError):
    """The gateway did not answer: connection refused or reset, a timeout, or an answer
    that is not the gateway's (a proxy's ``502``).

    ``write_applied`` is ``False`` when the connection was never made, ``None`` when
    the request may have reached the gateway.
    """


# ---------------------------------------------------------------- the fence


@dataclass(frozen=True)
class StaleResource:
    """A resource whose fence is above the token a write presented for it."""

    resource: str
    presented: int
    highest: int


class StaleToken(FenceError):
    """``409 stale_token`` / SQLSTATE ``ZF001``: the token is below the resource's
    highest accepted token. The writer's term is over: stop its work, do not retry it.

    Attributes:
        resource: The fenced resource (of a transaction: the first stale one).
        presented: The token the writer presented.
        highest: The resource's highest accepted token.
        stale: Every stale resource: one for a single write, each one a refused
            transaction (:meth:`Gateway.txn <fencegate.Gateway.txn>`) found stale, in
            the gateway's lock order.
    """

    code = "stale_token"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.resource = _str(self.body, "resource")
        self.presented = _int(self.body, "presented")
        # The contract always sends `highest`; a stale token means highest > presented,
        # so presented + 1 is a true lower bound should an old proxy strip it.
        self.highest = _opt_int(self.body, "highest") or self.presented + 1
        listed = self.body.get("stale")
        stale = tuple(
            StaleResource(_str(item, "resource"), _int(item, "presented"), _int(item, "highest"))
            for item in (listed if isinstance(listed, list) else [])
            if isinstance(item, Mapping)
        )
        self.stale: tuple[StaleResource, ...] = stale or (StaleResource(self.resource, self.presented, self.highest),)


class TokenNotIssued(FenceError):
    """``403 token_not_issued`` / SQLSTATE ``ZF005``: the resource is bound to an issuer
    that never issued this token; the fence did not move.

    Attributes:
        resource: The resource.
        presented: The token presented.
        issued: The latest token the issuer issued (``None`` if it issued none).
    """

    code = "token_not_issued"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.resource = _str(self.body, "resource")
        self.presented = _int(self.body, "presented")
        self.issued = _opt_int(self.body, "issued")


class TokenHolderMismatch(FenceError):
    """``403 token_holder_mismatch``: the issuer's latest token, presented by another
    identity than the one it was issued to."""

    code = "token_holder_mismatch"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.resource = _opt_str(self.body, "resource")
        self.presented = _opt_int(self.body, "presented")


# ---------------------------------------------------------------- transient


class BackendUnavailable(TransientError):
    """``503 backend_unavailable``: the database is unreachable or timed out.

    ``write_applied`` is the gateway's: ``False`` (certainly not applied) or ``None``
    (the database went away after receiving it).
    """

    code = "backend_unavailable"

    def __init__(self, message: str, **kwargs: Any) -> None:
        # The gateway's own word: False (certainly not applied) or null (unknown).
        body = kwargs.get("body") or {}
        kwargs.setdefault("write_applied", body.get("write_applied"))
        super().__init__(message, **kwargs)


class Overloaded(TransientError):
    """``503 overloaded``: the gateway holds as many writes or body bytes as it may;
    nothing was applied. Retry after ``retry_after`` seconds."""

    code = "overloaded"


class ShuttingDown(TransientError):
    """``503 shutting_down``: the gateway began shutting down while the body was still
    arriving; nothing was applied."""

    code = "shutting_down"


class NotSynchronouslyReplicated(TransientError):
    """``503 not_synchronously_replicated``: the gateway requires a synchronous standby
    of its database (``--require-synchronous-replication``) and has none streaming;
    nothing was applied. Retry after ``retry_after`` seconds."""

    code = "not_synchronously_replicated"


class IssuerUnavailable(TransientError):
    """``503 issuer_unavailable``: the token is above every token the gateway knows the
    resource's issuer (etcd or ZooKeeper) issued, and the issuer
    cannot be asked now; nothing was applied. Tokens it already vouched for keep
    working. Retry after ``retry_after`` seconds."""

    code = "issuer_unavailable"


class BodyTimeout(TransientError):
    """``408 body_timeout``: the body did not arrive in time; nothing was applied."""

    code = "body_timeout"


class IdempotencyInFlight(TransientError):
    """``409 idempotency_in_flight``: an earlier attempt with the same
    ``Idempotency-Key`` is still running (Postgres). This attempt applied nothing; the
    earlier one may still apply (``write_applied`` is ``None``). Retry with the same key
    to get its answer."""

    code = "idempotency_in_flight"

    def __init__(self, message: str, **kwargs: Any) -> None:
        kwargs.setdefault("write_applied", None)
        super().__init__(message, **kwargs)


# ---------------------------------------------------------------- leases


class LeaseHeld(FencegateError):
    """``409 lease_held``: another holder holds the lease.

    Attributes:
        holder: Who holds it.
        expires_in_ms: How long it still holds, on the gateway's clock.
    """

    code = "lease_held"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.holder = _opt_str(self.body, "holder")
        self.expires_in_ms = _opt_int(self.body, "expires_in_ms")


class LeaseLost(FencegateError):
    """``409 lease_lost``: this holder no longer holds the lease at that token; the term
    is over. Also raised by a :class:`~fencegate.Lease` asked to act after its term
    ended (``status`` is then ``None``)."""

    code = "lease_lost"


class TokensExhausted(FencegateError):
    """``409 tokens_exhausted``: the fence is at the largest token; reset it."""

    code = "tokens_exhausted"


class ResetRefused(FencegateError):
    """``409 reset_refused``: a reset that does not lower the fence, or goes below an
    issued or written token."""

    code = "reset_refused"


# ---------------------------------------------------------------- requests


class VersionMismatch(FencegateError):
    """``412 version_mismatch``: ``If-Match`` / ``If-None-Match`` did not hold, or a
    transaction's ``if_match`` or ``check`` did not; nothing was applied.

    Attributes:
        current: The object's current version, ``None`` if it does not exist.
        operation: Of a transaction: the index, from 0, of the first operation whose
            precondition failed; ``None`` for a single write.
    """

    code = "version_mismatch"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.current = _opt_int(self.body, "current")
        self.operation = _opt_int(self.body, "operation")


class MissingToken(FencegateError):
    """``428 missing_token``: a write without ``Fencing-Token``."""

    code = "missing_token"


class InvalidToken(FencegateError):
    """``400 invalid_token``: not a decimal, zero, negative, out of range, or twice."""

    code = "invalid_token"


class InvalidHolder(FencegateError):
    """``400 invalid_holder``: ``Fencing-Holder`` too long, not UTF-8, or with control
    characters."""

    code = "invalid_holder"


class InvalidPrecondition(FencegateError):
    """``400 invalid_precondition``: weak or listed entity tags, or both ``If-Match``
    and ``If-None-Match``."""

    code = "invalid_precondition"


class InvalidResource(FencegateError):
    """``400 invalid_resource``: not 1-200 bytes of ``[A-Za-z0-9._-]``, or only dots."""

    code = "invalid_resource"


class InvalidKey(FencegateError):
    """``400 invalid_key``: not 1-1024 bytes of UTF-8 without control characters."""

    code = "invalid_key"


class InvalidBody(FencegateError):
    """``400 invalid_body``: the body could not be read."""

    code = "invalid_body"


class BodyTooLarge(FencegateError):
    """``413 body_too_large``: the body is over the gateway's ``--max-body``."""

    code = "body_too_large"


class NotFound(FencegateError):
    """``404 not_found``: no such object or path."""

    code = "not_found"


class MethodNotAllowed(FencegateError):
    """``405 method_not_allowed``: the path exists, the method does not."""

    code = "method_not_allowed"


class Unauthenticated(FencegateError):
    """``401 unauthenticated``: no known key or client certificate."""

    code = "unauthenticated"


class Forbidden(FencegateError):
    """``403 forbidden``: the identity has no grant for the action on the resource."""

    code = "forbidden"


class InvalidIdempotencyKey(FencegateError):
    """``400 invalid_idempotency_key``: ``Idempotency-Key`` empty, over 255 bytes, not
    printable ASCII, sent twice, or sent to a fence reset."""

    code = "invalid_idempotency_key"


class IdempotencyKeyReused(FencegateError):
    """``422 idempotency_key_reused``: the key was used before (by this identity) for
    another request: another method, path, token, precondition or body. Nothing was
    applied. A key names one logical write; never use it for a second one."""

    code = "idempotency_key_reused"


class IdempotencyQuotaExceeded(FencegateError):
    """``429 idempotency_quota_exceeded``: a new key while the answers stored under this
    identity's keys, or all identities', are at the gateway's bound. Nothing was
    applied. Stored answers expire after the gateway's ``--idempotency-ttl``; a retry
    of a key already stored is answered as ever."""

    code = "idempotency_quota_exceeded"


class Internal(FencegateError):
    """``500 internal``: a bug in the gateway; details are in its log."""

    code = "internal"


# ---------------------------------------------------------------- /v1/sql


class SqlError(FencegateError):
    """``400 sql_error``: a statement of the writer failed; nothing was committed.

    Attributes:
        statement: Index of the failed statement.
        sqlstate: Its SQLSTATE.
    """

    code = "sql_error"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.statement = _opt_int(self.body, "statement")


class InvalidParam(FencegateError):
    """``400 invalid_param``: a parameter does not fit its type.

    Attributes:
        statement: Index of the statement.
        parameter: 1-based index of the parameter.
    """

    code = "invalid_param"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.statement = _opt_int(self.body, "statement")
        self.parameter = _opt_int(self.body, "parameter")


class StatementNotAllowed(FencegateError):
    """``400 statement_not_allowed``: a statement refused before anything ran."""

    code = "statement_not_allowed"


class UnsupportedType(FencegateError):
    """``400 unsupported_type``: a parameter or column type ``/v1/sql`` cannot carry."""

    code = "unsupported_type"


class TooManyStatements(FencegateError):
    """``400 too_many_statements``: more statements than ``--sql-max-statements``."""

    code = "too_many_statements"


class SqlDisabled(FencegateError):
    """``403 sql_disabled``: the gateway was started without ``--sql``."""

    code = "sql_disabled"


class NotSupportedByBackend(FencegateError):
    """``501 not_supported_by_backend``: ``/v1/sql`` on the embedded store."""

    code = "not_supported_by_backend"


# ---------------------------------------------------------------- /v1/txn


class InvalidTransaction(FencegateError):
    """``400 invalid_transaction``: not a transaction: no operations, a resource with
    two tokens, an object twice, a put without exactly one value, ...

    Attributes:
        operation: Index, from 0, of the operation at fault, if one is.
    """

    code = "invalid_transaction"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.operation = _opt_int(self.body, "operation")


class TooManyOperations(FencegateError):
    """``400 too_many_operations``: more operations than ``--txn-max-operations``.

    Attributes:
        limit: The gateway's limit.
    """

    code = "too_many_operations"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.limit = _opt_int(self.body, "operation")


# ---------------------------------------------------------------- lookup


def _code_classes() -> dict[str, type[FencegateError]]:
    found: dict[str, type[FencegateError]] = {}
    pending: list[type[FencegateError]] = [FencegateError]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        if cls.code is not None:
            if cls.code in found and found[cls.code] is not cls:
                raise RuntimeError(f"two classes for error code {cls.code}")
            found[cls.code] = cls
    return found


ERROR_CLASSES: Mapping[str, type[FencegateError]] = _code_classes()
"""Every stable error code of the gateway and its class."""


def error_for_code(code: str) -> type[FencegateError]:
    """The class of an ``error`` code; :class:`FencegateError` for a code this version
    does not know (a newer gateway's)."""
    return ERROR_CLASSES.get(code, FencegateError)


def parse_fence_detail(detail: str) -> dict[str, str]:
    """The ``key=value`` pairs of a fence error's DETAIL.

    >>> parse_fence_detail("resource=sweeper presented=1 highest=2")
    {'resource': 'sweeper', 'presented': '1', 'highest': '2'}
    """
    pairs: dict[str, str] = {}
    for item in detail.split():
        key, sep, value = item.partition("=")
        if sep:
            pairs[key] = value
    return pairs


def _opt_str(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    return value if isinstance(value, str) else None


def _str(body: Mapping[str, Any], name: str) -> str:
    return _opt_str(body, name) or ""


def _opt_int(body: Mapping[str, Any], name: str) -> int | None:
    value = body.get(name)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return None


def _int(body: Mapping[str, Any], name: str) -> int:
    value = _opt_int(body, name)
    return 0 if value is None else value
