"""fencegate: fenced writes, hosted leases and fenced transactions for Python.

A writer that holds a lease presents its fencing token with every write; the gateway,
or Postgres itself for fenced tables, refuses a token older than the newest one it has
accepted for the resource. This package is the writer's side:

- :class:`Gateway` / :class:`AsyncGateway`: the HTTP API (objects, fences, hosted
  leases step by step, ``/v1/sql``), with bearer keys and TLS.
- :class:`Lease` / :class:`AsyncLease`: one term of a hosted lease, renewed in the
  background, ended on the holder's own clock before the lease can pass, with a
  ``lost`` signal that fires at once when the gateway says the term is over.
- :func:`fenced_transaction`: a psycopg 3 or asyncpg transaction that presents the
  token first, through the gateway's Postgres door or straight to Postgres.
- :mod:`fencegate.errors`: one exception class per stable error code.
"""

from ._version import __version__
from .async_lease import AsyncLease
from .errors import (
    ERROR_CLASSES,
    BackendUnavailable,
    BodyTimeout,
    BodyTooLarge,
    FenceError,
    FencegateError,
    Forbidden,
    GatewayUnreachable,
    Internal,
    InvalidBody,
    InvalidHolder,
    InvalidKey,
    InvalidParam,
    InvalidPrecondition,
    InvalidResource,
    InvalidToken,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    MissingToken,
    NotFound,
    NotSupportedByBackend,
    Overloaded,
    ResetRefused,
    ShuttingDown,
    SqlDisabled,
    SqlError,
    StaleToken,
    StatementNotAllowed,
    TokenHolderMismatch,
    TokenNotIssued,
    TokensExhausted,
    TooManyStatements,
    TransientError,
    Unauthenticated,
    UnsupportedType,
    VersionMismatch,
)
from .fenced import fence_error, fenced_transaction
from .gateway import AsyncGateway, Gateway
from .lease import Lease, LeaseTiming, LostReason
from .models import (
    FenceState,
    LeaseState,
    SqlColumn,
    SqlOutcome,
    SqlResult,
    Statement,
    StoredObject,
    WriteResult,
)

__all__ = [
    "ERROR_CLASSES",
    "AsyncGateway",
    "AsyncLease",
    "BackendUnavailable",
    "BodyTimeout",
    "BodyTooLarge",
    "FenceError",
    "FenceState",
    "FencegateError",
    "Forbidden",
    "Gateway",
    "GatewayUnreachable",
    "Internal",
    "InvalidBody",
    "InvalidHolder",
    "InvalidKey",
    "InvalidParam",
    "InvalidPrecondition",
    "InvalidResource",
    "InvalidToken",
    "Lease",
    "LeaseHeld",
    "LeaseLost",
    "LeaseState",
    "LeaseTiming",
    "LostReason",
    "MethodNotAllowed",
    "MissingToken",
    "NotFound",
    "NotSupportedByBackend",
    "Overloaded",
    "ResetRefused",
    "ShuttingDown",
    "SqlColumn",
    "SqlDisabled",
    "SqlError",
    "SqlOutcome",
    "SqlResult",
    "StaleToken",
    "Statement",
    "StatementNotAllowed",
    "StoredObject",
    "TokenHolderMismatch",
    "TokenNotIssued",
    "TokensExhausted",
    "TooManyStatements",
    "TransientError",
    "Unauthenticated",
    "UnsupportedType",
    "VersionMismatch",
    "WriteResult",
    "__version__",
    "fence_error",
    "fenced_transaction",
]
