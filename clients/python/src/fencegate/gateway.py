"""Clients of the gateway's HTTP API: :class:`Gateway` (blocking) and
:class:`AsyncGateway` (asyncio), on httpx.

Both have the same methods with the same arguments; every write takes the fencing
token of the writer's term (``token=``), and every error answer is raised as the class
of its code (:mod:`fencegate.errors`). Neither retries anything by itself: a stale
write must never be retried, and whether to retry a transient one is the writer's
call (``write_applied`` tells whether it may have been applied).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import httpx

from . import _protocol as proto
from ._protocol import IfMatch, Request
from ._version import __version__
from .models import (
    FenceState,
    LeaseState,
    SqlOutcome,
    StatementLike,
    StoredObject,
    WriteResult,
)

if TYPE_CHECKING:
    from .async_lease import AsyncLease
    from .lease import Lease

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_URL", "AsyncGateway", "Gateway"]

DEFAULT_URL = "http://127.0.0.1:7070"
"""Where the gateway listens by default."""

DEFAULT_TIMEOUT = 10.0
"""Seconds to wait for each of connecting, sending and receiving."""

_T = TypeVar("_T")


class _Settings:
    """What both flavours make their httpx client from."""

    def __init__(
        self,
        url: str,
        key: str | None,
        holder: str | None,
        ca_file: str | None,
        client_cert: str | None,
        client_key: str | None,
        ssl_context: ssl.SSLContext | None,
        timeout: float,
    ) -> None:
        self.url = url.rstrip("/")
        self.holder = holder
        self.headers = {"User-Agent": f"fencegate-python/{__version__}"}
        if key is not None:
            self.headers["Authorization"] = f"Bearer {key}"
        self.verify: ssl.SSLContext | bool = True
        if ssl_context is not None:
            self.verify = ssl_context
        elif ca_file is not None or client_cert is not None:
            context = ssl.create_default_context(cafile=ca_file)
            if client_cert is not None:
                context.load_cert_chain(client_cert, client_key)
            self.verify = context
        self.timeout = timeout

    def client_options(self) -> dict[str, Any]:
        return {
            "base_url": self.url,
            "headers": self.headers,
            "verify": self.verify,
            "timeout": self.timeout,
        }

    def holder_for(self, holder: str | None) -> str | None:
        return holder if holder is not None else self.holder

    def lease_holder(self, holder: str | None) -> str:
        chosen = self.holder_for(holder)
        if chosen is None:
            raise ValueError("a lease needs a holder: pass holder=, or Gateway(holder=...)")
        return chosen


class Gateway:
    """A blocking client of a fencegate gateway.

    >>> gw = Gateway("http://127.0.0.1:7070", holder="node-b")
    >>> gw.put("orders", "o-1", b"from 42", token=42)   # doctest: +SKIP
    WriteResult(resource='orders', key='o-1', token=42, version=2, created=False)

    Thread-safe; use one per process and :meth:`close` it (or use ``with``).

    Args:
        url: The gateway's base URL, ``http://host:port`` or ``https://...``.
        key: A bearer key of an identity of the gateway's ``--auth-file``.
        holder: The writer's name, sent as ``Fencing-Holder`` with every write (for the
            gateway's logs) and used as the lease holder by default.
        ca_file: PEM file of the CA that signed the gateway's certificate.
        client_cert: PEM client certificate (with its key, or with ``client_key``), for
            a gateway with ``--tls-client-ca``.
        client_key: PEM key of ``client_cert``, if not in the same file.
        ssl_context: A complete TLS context instead of the three above.
        timeout: Seconds to wait for each of connecting, sending and receiving.
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
    ) -> None:
        self._settings = _Settings(url, key, holder, ca_file, client_cert, client_key, ssl_context, timeout)
        self._client = httpx.Client(**self._settings.client_options())

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return self._settings.url

    @property
    def holder(self) -> str | None:
        """The default ``Fencing-Holder`` and lease holder."""
        return self._settings.holder

    def close(self) -> None:
        """Closes the connections."""
        self._client.close()

    def __enter__(self) -> Gateway:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _send(
        self, request: Request, parse: Callable[[httpx.Response, Request], _T], timeout: float | None = None
    ) -> _T:
        try:
            response = self._client.request(
                request.method,
                request.path,
                headers=request.headers,
                content=request.content,
                timeout=timeout if timeout is not None else httpx.USE_CLIENT_DEFAULT,
            )
        except httpx.TransportError as error:
            raise proto.unreachable(error, self.url) from error
        return parse(response, request)

    # -- objects

    def put(
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
        """Writes ``value`` as the object ``resource/key`` if ``token`` is current.

        Args:
            token: The fencing token of the writer's term.
            holder: ``Fencing-Holder`` for this write (default: the gateway's).
            if_match: Compare-and-swap on the object's version (``0``: must not exist;
                ``"*"``: must exist).
            if_none_match: The object must not exist.
            idempotency_key: Sent as ``Idempotency-Key``, so that a gateway that keeps
                outcomes answers a retry with the first attempt's outcome.

        Raises:
            StaleToken: A newer term has written; stop this term's work.
            VersionMismatch: The precondition did not hold.
            TransientError: Nothing decided; see ``write_applied``.
        """
        request = proto.put(
            resource,
            key,
            value,
            token=token,
            holder=self._settings.holder_for(holder),
            if_match=if_match,
            if_none_match=if_none_match,
            idempotency_key=idempotency_key,
        )
        return self._send(request, proto.write_result)

    def delete(
        self,
        resource: str,
        key: str,
        *,
        token: int,
        holder: str | None = None,
        if_match: IfMatch = None,
        idempotency_key: str | None = None,
    ) -> WriteResult:
        """Deletes the object (a missing one is fine) if ``token`` is current; see
        :meth:`put`."""
        request = proto.delete(
            resource,
            key,
            token=token,
            holder=self._settings.holder_for(holder),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )
        return self._send(request, proto.write_result)

    def get(self, resource: str, key: str) -> StoredObject | None:
        """Reads an object; ``None`` if there is none. Needs no token."""
        return self._send(proto.get(resource, key), proto.stored_object)

    # -- fences

    def fence(self, resource: str) -> FenceState:
        """Reads the resource's fence."""
        return self._send(proto.fence(resource), proto.fence_state)

    def advance(
        self,
        resource: str,
        *,
        token: int,
        holder: str | None = None,
        idempotency_key: str | None = None,
    ) -> FenceState:
        """Raises the fence to ``token`` without writing, so that writes still in
        flight from older terms are refused from now on."""
        request = proto.advance(
            resource, token=token, holder=self._settings.holder_for(holder), idempotency_key=idempotency_key
        )
        return self._send(request, proto.fence_state)

    def sql(
        self,
        resource: str,
        statements: Sequence[StatementLike],
        *,
        token: int,
        holder: str | None = None,
        idempotency_key: str | None = None,
    ) -> SqlOutcome:
        """Runs the writer's statements after the fence check, in one transaction
        (``POST /v1/sql``; Postgres backend with ``--sql``).

        ``statements`` are SQL texts, ``(sql, params)`` pairs with ``$n`` parameters,
        or :class:`~fencegate.Statement` values.
        """
        request = proto.sql(
            resource,
            statements,
            token=token,
            holder=self._settings.holder_for(holder),
            idempotency_key=idempotency_key,
        )
        return self._send(request, proto.sql_outcome)

    # -- hosted leases, step by step

    def acquire_lease(self, resource: str, *, ttl: float, holder: str | None = None) -> LeaseState:
        """Takes the lease if it is free, expired or already ``holder``'s: always a new
        token, with the resource's fence raised to it. Raises
        :class:`~fencegate.LeaseHeld` if another holder holds it."""
        request = proto.lease_step(resource, "acquire", holder=self._settings.lease_holder(holder), ttl=ttl)
        return self._send(request, proto.lease_state)

    def renew_lease(
        self,
        resource: str,
        *,
        token: int,
        ttl: float,
        holder: str | None = None,
        timeout: float | None = None,
    ) -> LeaseState:
        """Extends the lease held at ``token``. Raises :class:`~fencegate.LeaseLost`
        when the term is over."""
        request = proto.lease_step(resource, "renew", holder=self._settings.lease_holder(holder), token=token, ttl=ttl)
        return self._send(request, proto.lease_state, timeout)

    def release_lease(
        self, resource: str, *, token: int, holder: str | None = None, timeout: float | None = None
    ) -> LeaseState:
        """Gives the lease up, so that a rival may take it at once."""
        request = proto.lease_step(resource, "release", holder=self._settings.lease_holder(holder), token=token)
        return self._send(request, proto.lease_state, timeout)

    def read_lease(self, resource: str) -> LeaseState:
        """Reads the lease."""
        return self._send(proto.read_lease(resource), proto.lease_state)

    def lease(
        self,
        resource: str,
        *,
        holder: str | None = None,
        ttl: float = 15.0,
        margin: float | None = None,
        renew_every: float | None = None,
        retry_every: float | None = None,
    ) -> Lease:
        """A :class:`~fencegate.Lease` on ``resource``: acquire it with ``with`` or
        :meth:`~fencegate.Lease.acquire`; it renews itself and steps down on time."""
        from .lease import Lease

        return Lease(
            self,
            resource,
            holder=self._settings.lease_holder(holder),
            ttl=ttl,
            margin=margin,
            renew_every=renew_every,
            retry_every=retry_every,
        )

    # -- health

    def ready(self) -> bool:
        """Whether the gateway and its backend answer (``GET /readyz``)."""
        return self._send(Request("GET", "/readyz"), proto.ready)


class AsyncGateway:
    """An asyncio client of a fencegate gateway: :class:`Gateway`'s methods, awaited.

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
    ) -> None:
        self._settings = _Settings(url, key, holder, ca_file, client_cert, client_key, ssl_context, timeout)
        self._client = httpx.AsyncClient(**self._settings.client_options())

    @property
    def url(self) -> str:
        """The gateway's base URL."""
        return self._settings.url

    @property
    def holder(self) -> str | None:
        """The default ``Fencing-Holder`` and lease holder."""
        return self._settings.holder

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
        except httpx.TransportError as error:
            raise proto.unreachable(error, self.url) from error
        return parse(response, request)

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
        """See :meth:`Gateway.put`."""
        request = proto.put(
            resource,
            key,
            value,
            token=token,
            holder=self._settings.holder_for(holder),
            if_match=if_match,
            if_none_match=if_none_match,
            idempotency_key=idempotency_key,
        )
        return await self._send(request, proto.write_result)

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
        """See :meth:`Gateway.delete`."""
        request = proto.delete(
            resource,
            key,
            token=token,
            holder=self._settings.holder_for(holder),
            if_match=if_match,
            idempotency_key=idempotency_key,
        )
        return await self._send(request, proto.write_result)

    async def get(self, resource: str, key: str) -> StoredObject | None:
        """See :meth:`Gateway.get`."""
        return await self._send(proto.get(resource, key), proto.stored_object)

    async def fence(self, resource: str) -> FenceState:
        """See :meth:`Gateway.fence`."""
        return await self._send(proto.fence(resource), proto.fence_state)

    async def advance(
        self,
        resource: str,
        *,
        token: int,
        holder: str | None = None,
        idempotency_key: str | None = None,
    ) -> FenceState:
        """See :meth:`Gateway.advance`."""
        request = proto.advance(
            resource, token=token, holder=self._settings.holder_for(holder), idempotency_key=idempotency_key
        )
        return await self._send(request, proto.fence_state)

    async def sql(
        self,
        resource: str,
        statements: Sequence[StatementLike],
        *,
        token: int,
        holder: str | None = None,
        idempotency_key: str | None = None,
    ) -> SqlOutcome:
        """See :meth:`Gateway.sql`."""
        request = proto.sql(
            resource,
            statements,
            token=token,
            holder=self._settings.holder_for(holder),
            idempotency_key=idempotency_key,
        )
        return await self._send(request, proto.sql_outcome)

    async def acquire_lease(self, resource: str, *, ttl: float, holder: str | None = None) -> LeaseState:
        """See :meth:`Gateway.acquire_lease`."""
        request = proto.lease_step(resource, "acquire", holder=self._settings.lease_holder(holder), ttl=ttl)
        return await self._send(request, proto.lease_state)

    async def renew_lease(
        self,
        resource: str,
        *,
        token: int,
        ttl: float,
        holder: str | None = None,
        timeout: float | None = None,
    ) -> LeaseState:
        """See :meth:`Gateway.renew_lease`."""
        request = proto.lease_step(resource, "renew", holder=self._settings.lease_holder(holder), token=token, ttl=ttl)
        return await self._send(request, proto.lease_state, timeout)

    async def release_lease(
        self, resource: str, *, token: int, holder: str | None = None, timeout: float | None = None
    ) -> LeaseState:
        """See :meth:`Gateway.release_lease`."""
        request = proto.lease_step(resource, "release", holder=self._settings.lease_holder(holder), token=token)
        return await self._send(request, proto.lease_state, timeout)

    async def read_lease(self, resource: str) -> LeaseState:
        """See :meth:`Gateway.read_lease`."""
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
    ) -> AsyncLease:
        """An :class:`~fencegate.AsyncLease` on ``resource``; see :meth:`Gateway.lease`."""
        from .async_lease import AsyncLease

        return AsyncLease(
            self,
            resource,
            holder=self._settings.lease_holder(holder),
            ttl=ttl,
            margin=margin,
            renew_every=renew_every,
            retry_every=retry_every,
        )

    async def ready(self) -> bool:
        """See :meth:`Gateway.ready`."""
        return await self._send(Request("GET", "/readyz"), proto.ready)
