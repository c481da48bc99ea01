"""Fenced transactions with your own Postgres driver: psycopg 3 and asyncpg.

A writer that keeps its data in tables protected with ``fencegate protect`` presents
its token first in every transaction, through the gateway's Postgres door or straight
to Postgres. :func:`fenced_transaction` does that, and turns the fence's SQLSTATEs into
this package's exceptions:

========  ==========================  ==============================================
SQLSTATE  raised as                   DETAIL
========  ==========================  ==============================================
ZF001     :class:`StaleToken`         ``resource=<r> presented=<n> highest=<n>``
ZF005     :class:`TokenNotIssued`     ``resource=<r> presented=<n> issued=<n>``
ZF...     :class:`FenceError`         (``ZF002`` no token, ``ZF003`` not a token, ...)
========  ==========================  ==============================================

The driver's exception is kept as ``__cause__``. Nothing of a refused transaction was
applied: Postgres rolled it back.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, AbstractContextManager, asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any, TypeVar, overload

from ._protocol import check_token
from .errors import FenceError, FencegateError, StaleToken, TokenNotIssued, parse_fence_detail

if TYPE_CHECKING:
    import asyncpg
    import psycopg
    from asyncpg.pool import PoolConnectionProxy

    _Sync = TypeVar("_Sync", bound=psycopg.Connection[Any])
    _Async = TypeVar(
        "_Async", bound="psycopg.AsyncConnection[Any] | asyncpg.Connection[Any] | PoolConnectionProxy[Any]"
    )

__all__ = ["SQLSTATE_STALE", "SQLSTATE_TOKEN_NOT_ISSUED", "fence_error", "fenced_transaction"]

SQLSTATE_STALE = "ZF001"
"""The fence's SQLSTATE for a stale token."""

SQLSTATE_TOKEN_NOT_ISSUED = "ZF005"
"""The fence's SQLSTATE for a token its resource's issuer never issued."""

# The casts pin the function's signature whatever type a driver infers for an int.
_FENCE_PSYCOPG = "SELECT fencegate.fence(%s::text, %s::bigint)"
_FENCE_ASYNCPG = "SELECT fencegate.fence($1::text, $2::bigint)"


@overload
def fenced_transaction(conn: _Sync, resource: str, token: int) -> AbstractContextManager[_Sync]: ...


@overload
def fenced_transaction(conn: _Async, resource: str, token: int) -> AbstractAsyncContextManager[_Async]: ...


def fenced_transaction(conn: Any, resource: str, token: int) -> Any:
    """A transaction that presents ``token`` for ``resource`` before anything else.

    With psycopg 3 (a ``Connection``, or a pool's)::

        with fenced_transaction(conn, "sweeper", lease.token):
            conn.execute("UPDATE sweep_state SET note = %s WHERE id = 1", ("node-b",))

    With an ``AsyncConnection`` of psycopg, or asyncpg (a connection or a pool's)::

        async with fenced_transaction(conn, "sweeper", lease.token):
            await conn.execute("UPDATE sweep_state SET note = $1 WHERE id = 1", "node-b")

    The block runs inside the driver's own transaction, which begins with
    ``SELECT fencegate.fence(resource, token)``: a stale token fails there, before any
    write. It commits when the block ends and rolls back if it raises. The context
    manager yields ``conn``.

    Raises:
        StaleToken: ``ZF001``: a newer term has raised the fence. Stop this term's work
            and do not retry it with the same token.
        TokenNotIssued: ``ZF005``: the resource's issuer never issued ``token``.
        FenceError: Any other fence SQLSTATE (class ``ZF``).
        TypeError: ``conn`` is not a psycopg 3 or asyncpg connection (a pool is not:
            a transaction needs one connection).
    """
    check_token(token)
    module = type(conn).__module__
    if module.startswith("psycopg"):
        import psycopg

        if isinstance(conn, psycopg.AsyncConnection):
            return _psycopg_async(conn, resource, token)
        if isinstance(conn, psycopg.Connection):
            return _psycopg(conn, resource, token)
    if module.startswith("asyncpg") and hasattr(conn, "transaction"):
        return _asyncpg(conn, resource, token)
    raise TypeError(f"fenced_transaction takes a psycopg 3 or asyncpg connection, not {type(conn).__name__}")


@contextmanager
def _psycopg(conn: Any, resource: str, token: int) -> Iterator[Any]:
    try:
        with conn.transaction():
            conn.execute(_FENCE_PSYCOPG, (resource, token))
            yield conn
    except Exception as error:
        found = fence_error(error)
        if found is None:
            raise
        raise found from error


@asynccontextmanager
async def _psycopg_async(conn: Any, resource: str, token: int) -> AsyncIterator[Any]:
    try:
        async with conn.transaction():
            await conn.execute(_FENCE_PSYCOPG, (resource, token))
            yield conn
    except Exception as error:
        found = fence_error(error)
        if found is None:
            raise
        raise found from error


@asynccontextmanager
async def _asyncpg(conn: Any, resource: str, token: int) -> AsyncIterator[Any]:
    try:
        async with conn.transaction():
            await conn.execute(_FENCE_ASYNCPG, resource, token)
            yield conn
    except Exception as error:
        found = fence_error(error)
        if found is None:
            raise
        raise found from error


def fence_error(error: BaseException) -> FenceError | None:
    """The fence error behind a driver's exception, or ``None`` if it is not one.

    For writers who run their own transactions (an ORM's session, Django's
    ``atomic``): it reads psycopg's and asyncpg's exceptions, and follows SQLAlchemy's
    ``orig`` and Python's ``__cause__`` to the driver's.

    >>> try:
    ...     session.commit()                                   # doctest: +SKIP
    ... except Exception as e:
    ...     stale = fence_error(e)
    ...     raise stale or e
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, FencegateError):
            return None  # already ours
        found = _from_driver(current)
        if found is not None:
            return found
        orig = getattr(current, "orig", None)
        current = orig if isinstance(orig, BaseException) else current.__cause__
    return None


def _from_driver(error: BaseException) -> FenceError | None:
    sqlstate = getattr(error, "sqlstate", None)
    if not isinstance(sqlstate, str) or not sqlstate.startswith("ZF"):
        return None
    diag = getattr(error, "diag", None)
    if diag is not None:  # psycopg
        detail = getattr(diag, "message_detail", None)
        message = getattr(diag, "message_primary", None)
    else:  # asyncpg
        detail = getattr(error, "detail", None)
        message = getattr(error, "message", None)
    return fence_error_from_sqlstate(
        sqlstate,
        message if isinstance(message, str) and message else str(error),
        detail if isinstance(detail, str) else None,
    )


def fence_error_from_sqlstate(sqlstate: str, message: str, detail: str | None) -> FenceError:
    """The exception of a fence error given its SQLSTATE, message and DETAIL."""
    body: dict[str, Any] = {"message": message}
    if detail is not None:
        body["detail"] = detail
        for key, value in parse_fence_detail(detail).items():
            body[key] = int(value) if key in ("presented", "highest", "issued") and value.isdigit() else value
    if sqlstate == SQLSTATE_STALE:
        return StaleToken(message, body={"error": StaleToken.code, **body}, sqlstate=sqlstate)
    if sqlstate == SQLSTATE_TOKEN_NOT_ISSUED:
        return TokenNotIssued(message, body={"error": TokenNotIssued.code, **body}, sqlstate=sqlstate)
    return FenceError(message, body=body, sqlstate=sqlstate)
