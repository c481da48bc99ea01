"""The asyncio client of the gateway's HTTP API: :class:`AsyncGateway`, the methods of
:class:`~fencegate.Gateway` awaited, with the same writes and retries (see
:mod:`fencegate.gateway`)."""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Callable, TypeVar

import httpx

from . import _protocol as proto
from . import _retry
from ._protocol import Request
from ._retry import Live, RetryPolicy, key_for
from .errors import GatewayUnreachable, StaleToken
from .gateway import DEFAULT_TIMEOUT, DEFAULT_URL, Settings, all_live, stale_terms
from .models import (
    FenceState,
    IfMatch,
    LeaseState,
    SqlOutcome,
    StatementLike,
    StoredObject,
    TxnOp,
    TxnOutcome,
    WriteResult,
)

if TYPE_CHECKING:
    from .async_lease import AsyncLease

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_URL", "AsyncGateway"]

_T = TypeVar("_T")


class AsyncGateway:
    """An asyncio client of a fencegate gateway: :class:`~fencegate.Gateway`'s methods,
    awaited, with the same arguments.

    Use one per event loop and ``await gw.aclose()`` it (or ``async with``).
    """

    def __init__(
        self,
        url: str = DEFAULT_URL,
        *,
        key: str | None = None,
        holder: str | None = None,
        ca_file: str | None = None,
        client_cert: str | None = None,
        client_key: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._settings = Settings(url, key, holder, ca_file, client_cert, client_key, ssl_context, timeout, retry)
        self._client = httpx.AsyncClient(**self._settings.client_options())

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return self._settings.url

    @property
    def holder(self) -> str | None:
        """The default ``Fencing-Holder`` and lease holder."""
        return self._settings.holder

    @property
    def retry(self) -> RetryPolicy:
        """How writes are sent again."""
        return self._settings.retry

    async def aclose(self) -> None:
        """Closes the connections."""
        await self._client.aclose()

    async def __aenter__(self) -> AsyncGateway:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def _send(
        self, request: Request, parse: Callable[[httpx.Response, Request], _T], timeout: float | None = None
    ) -> _T:
        try:
            response = await self._client.request(
                request.method,
                request.path,
                headers=request.headers,
                content=request.content,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except (httpx.UnsupportedProtocol, httpx.LocalProtocolError):
            raise  # the request cannot be sent at all (the URL, a header): a mistake, not the network
        except httpx.TransportError as error:
            raise proto.unreachable(error, self.url) from error
        return parse(response, request)

    async def _write(
        self,
        request: Request,
        parse: Callable[[httpx.Response, Request], _T],
        *,
        live: Live = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> _T:
        """See :meth:`Gateway._write <fencegate.Gateway._write>`."""
        return await _retry.send_async(lambda: self._send(request, parse, timeout), retry or self._settings.retry, live)

    async def put(
        self,
        resource: str,
        key: str,
        value: bytes | str,
        *,
        token: int,
        holder: str | None = None,
        if_match: IfMatch = None,
        if_none_match: bool = False,
        idempotency_key: str | None = None,
    ) -> WriteResult:
        """See :meth:`Gateway.put <fencegate.Gateway.put>`."""
        request = proto.put(
            resource,
            key,
            value,
            token=token,
            holder=self._settings.holder_for(holder),
            if_match=if_match,
            if_none_match=if_none_match,
            idempotency_key=key_for(idempotency_key),
        )
        return await self._write(request, proto.write_result)

    async def delete(
        self,
        resource: str,
        key: str,
        *,
        token: int,
        holder: str | None = None,
        if_match: IfMatch = None,
        idempotency_key: str | None = None,
    ) -> WriteResult:
        """See :meth:`Gateway.delete <fencegate.Gateway.delete>`."""
        request = proto.delete(
            resource,
            key,
            token=token,
            holder=self._settings.holder_for(holder),
            if_match=if_match,
            idempotency_key=key_for(idempotency_key),
        )
        return await self._write(request, proto.write_result)

    async def get(self, resource: str, key: str) -> StoredObject | None:
        """See :meth:`Gateway.get <fencegate.Gateway.get>`."""
        return await self._send(proto.get(resource, key), proto.stored_object)

    async def fence(self, resource: str) -> FenceState:
        """See :meth:`Gateway.fence <fencegate.Gateway.fence>`."""
        return await self._send(proto.fence(resource), proto.fence_state)

    async def advance(
        self,
        resource: str,
        *,
        token: int,
        holder: str | None = None,
        idempotency_key: str | None = None,
    ) -> FenceState:
        """See :meth:`Gateway.advance <fencegate.Gateway.advance>`."""
        request = proto.advance(
            resource, token=token, holder=self._settings.holder_for(holder), idempotency_key=key_for(idempotency_key)
        )
        return await self._write(request, proto.fence_state)

    async def sql(
        self,
        resource: str,
        statements: Sequence[StatementLike],
        *,
        token: int,
        holder: str | None = None,
        idempotency_key: str | None = None,
    ) -> SqlOutcome:
        """See :meth:`Gateway.sql <fencegate.Gateway.sql>`."""
        request = proto.sql(
            resource,
            statements,
            token=token,
            holder=self._settings.holder_for(holder),
            idempotency_key=key_for(idempotency_key),
        )
        return await self._write(request, proto.sql_outcome)

    async def txn(
        self,
        operations: Sequence[TxnOp],
        *,
        idempotency_key: str | None = None,
        leases: Sequence[AsyncLease] = (),
    ) -> TxnOutcome:
        """See :meth:`Gateway.txn <fencegate.Gateway.txn>`."""
        request = proto.txn(operations, idempotency_key=key_for(idempotency_key))
        live = all_live(leases)
        if live is not None:
            live()
        try:
            return await self._write(request, proto.txn_outcome, live=live)
        except StaleToken as stale:
            stale_terms(stale, leases)
            raise

    async def acquire_lease(
        self, resource: str, *, ttl: float, holder: str | None = None, idempotency_key: str | None = None
    ) -> LeaseState:
        """See :meth:`Gateway.acquire_lease <fencegate.Gateway.acquire_lease>`."""
        request = proto.lease_step(
            resource,
            "acquire",
            holder=self._settings.lease_holder(holder),
            idempotency_key=key_for(idempotency_key),
            ttl=ttl,
        )
        return await self._write(request, proto.lease_state)

    async def renew_lease(
        self,
        resource: str,
        *,
        token: int,
        ttl: float,
        holder: str | None = None,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> LeaseState:
        """See :meth:`Gateway.renew_lease <fencegate.Gateway.renew_lease>`."""
        request = proto.lease_step(
            resource,
            "renew",
            holder=self._settings.lease_holder(holder),
            idempotency_key=key_for(idempotency_key),
            token=token,
            ttl=ttl,
        )
        return await self._write(request, proto.lease_state, timeout=timeout)

    async def release_lease(
        self,
        resource: str,
        *,
        token: int,
        holder: str | None = None,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> LeaseState:
        """See :meth:`Gateway.release_lease <fencegate.Gateway.release_lease>`."""
        request = proto.lease_step(
            resource,
            "release",
            holder=self._settings.lease_holder(holder),
            idempotency_key=key_for(idempotency_key),
            token=token,
        )
        return await self._write(request, proto.lease_state, timeout=timeout)

    async def read_lease(self, resource: str) -> LeaseState:
        """See :meth:`Gateway.read_lease <fencegate.Gateway.read_lease>`."""
        return await self._send(proto.read_lease(resource), proto.lease_state)

    def lease(
        self,
        resource: str,
        *,
        holder: str | None = None,
        ttl: float = 15.0,
        margin: float | None = None,
        renew_every: float | None = None,
        retry_every: float | None = None,
        renew_retry_every: float | None = None,
        renew_timeout: float | None = None,
    ) -> AsyncLease:
        """An :class:`~fencegate.AsyncLease` on ``resource``; see
        :meth:`Gateway.lease <fencegate.Gateway.lease>`."""
        from .async_lease import AsyncLease

        return AsyncLease(
            self,
            resource,
            holder=self._settings.lease_holder(holder),
            ttl=ttl,
            margin=margin,
            renew_every=renew_every,
            retry_every=retry_every,
            renew_retry_every=renew_retry_every,
            renew_timeout=renew_timeout,
        )

    async def ready(self, *, timeout: float | None = None) -> bool:
        """See :meth:`Gateway.ready <fencegate.Gateway.ready>`."""
        try:
            return await self._send(Request("GET", "/readyz"), proto.ready, timeout)
        except GatewayUnreachable:
            return False
