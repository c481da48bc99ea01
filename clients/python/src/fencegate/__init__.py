"""fencegate: fenced writes, hosted leases and fenced transactions for Python.

A writer that holds a lease presents its fencing token with every write; the gateway,
or Postgres itself for fenced tables, refuses a token older than the newest one it has
accepted for the resource. This package is the writer's side:

- :class:`Gateway` / :class:`AsyncGateway`: the HTTP API (objects, fences, hosted
  leases step by step, ``/v1/sql``, transactions over several resources with
  :meth:`Gateway.txn`), with bearer keys and TLS. Every write carries an
  ``Idempotency-Key`` and is resent with it, as the :class:`RetryPolicy` says, when it
  got no decision.
- :class:`Lease` / :class:`AsyncLease`: one term of a hosted lease, renewed in the
  background, ended on the holder's own clock before the lease can pass, with a
  ``lost`` signal that fires at once when the gateway says the term is over.
- :func:`fenced_transaction`: a psycopg 3 or asyncpg transaction that presents the
  token first, through the gateway's Postgres door or straight to Postgres.
- :func:`fence_s3_client`: a boto3 client whose writes carry the token in the
  ``Fencing-Token`` header, for the gateway's S3 door.
- :mod:`fencegate.errors`: one exception class per stable error code.
"""

from ._retry import NO_RETRY, RetryPolicy
from ._version import __version__
from .async_gateway import AsyncGateway
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
    IdempotencyInFlight,
    IdempotencyKeyReused,
    IdempotencyQuotaExceeded,
    Internal,
    InvalidBody,
    InvalidHolder,
    InvalidIdempotencyKey,
    InvalidKey,
    InvalidParam,
    InvalidPrecondition,
    InvalidResource,
    InvalidToken,
    InvalidTransaction,
    IssuerUnavailable,
    LeaseHeld,
    LeaseLost,
    MethodNotAllowed,
    MissingToken,
    NotFound,
    NotSupportedByBackend,
    NotSynchronouslyReplicated,
    Overloaded,
    ResetRefused,
    ShuttingDown,
    SqlDisabled,
    SqlError,
    StaleResource,
    StaleToken,
    StatementNotAllowed,
    TokenHolderMismatch,
    TokenNotIssued,
    TokensExhausted,
    TooManyOperations,
    TooManyStatements,
    TransientError,
    Unauthenticated,
    UnsupportedType,
    VersionMismatch,
)
from .fenced import fence_error, fenced_transaction
from .gateway import Gateway
from .lease import Lease, LeaseTiming, LostReason
from .models import (
    FenceState,
    LeaseState,
    SqlColumn,
    SqlOutcome,
    SqlResult,
    Statement,
    StoredObject,
    TxnAdvance,
    TxnCheck,
    TxnDelete,
    TxnOp,
    TxnOutcome,
    TxnPut,
    TxnResult,
    WriteResult,
)
from .s3 import S3_WRITE_OPERATIONS, fence_s3_client

__all__ = [
    "ERROR_CLASSES",
    "NO_RETRY",
    "S3_WRITE_OPERATIONS",
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
    "NotSynchronouslyReplicated",
    "Overloaded",
    "ResetRefused",
    "RetryPolicy",
    "ShuttingDown",
    "SqlColumn",
    "SqlDisabled",
    "SqlError",
    "SqlOutcome",
    "SqlResult",
    "StaleResource",
    "StaleToken",
    "Statement",
    "StatementNotAllowed",
    "StoredObject",
    "TokenHolderMismatch",
    "TokenNotIssued",
    "TokensExhausted",
    "TooManyOperations",
    "TooManyStatements",
    "TransientError",
    "TxnAdvance",
    "TxnCheck",
    "TxnDelete",
    "TxnOp",
    "TxnOutcome",
    "TxnPut",
    "TxnResult",
    "Unauthenticated",
    "UnsupportedType",
    "VersionMismatch",
    "WriteResult",
    "__version__",
    "fence_error",
    "fence_s3_client",
    "fenced_transaction",
]
