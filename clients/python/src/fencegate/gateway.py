"""The blocking client of the gateway's HTTP API, :class:`Gateway`, on httpx;
:class:`~fencegate.AsyncGateway` is the same for asyncio.

Every write takes the fencing token of the writer's term (``token=``), and every error
answer is raised as the class of its code (:mod:`fencegate.errors`).

Writes and retries
------------------
Every write (objects, advances, ``/v1/sql``, lease steps, transactions) is one logical
write with one ``Idempotency-Key``: the caller's ``idempotency_key=``, or a random one
made for the call. A write that got no decision (no answer, ``503``, ``409
idempotency_in_flight``) is sent again with the same key, up to the
:class:`~fencegate.RetryPolicy`'s attempts, so the gateway applies it at most once; a
stale token, a failed precondition or any other answer is the write's own and is never
resent. Reads are sent once.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, TypeVar

import httpx

from . import _protocol as proto
from . import _retry
from ._protocol import Request
from ._retry import Live, RetryPolicy, key_for
from ._term import LostReason
from ._version import __version__
from .errors import GatewayUnreachable, StaleToken
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
    from .lease import Lease

__all__ = ["DEFAULT_TIMEOUT", "DEFAULT_URL", "Gateway"]

DEFAULT_URL = "http://127.0.0.1:7070"
"""Where the gateway listens by default."""

DEFAULT_TIMEOUT = 10.0
"""Seconds to wait for each of connecting, sending and receiving."""

_T = TypeVar("_T")


class Settings:
    """What both flavours make their httpx client from, and how they resend."""

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
        retry: RetryPolicy | None,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"a gateway URL is http:// or https://, not {url!r}")
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
        if retry is not None and not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry is a fencegate.RetryPolicy, not {type(retry).__name__}")
        self.retry = retry if retry is not None else RetryPolicy()

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


def stale_terms(error: StaleToken, leases: Sequence[Any]) -> None:
    """Ends the term of every lease whose resource ``error`` names as stale."""
    stale = {item.resource for item in error.stale}
    for lease in leases:
        if lease.resource in stale:
            lease._end(LostReason.STALE_TOKEN)


class Gateway:
    """A blocking client of a fencegate gateway.

    >>> gw = Gateway("http://127.0.0.1:7070", holder="node-b")
    >>> gw.put("orders", "o-1", b"from 42", token=42)   # doctest: +SKIP
    WriteResult(resource='orders', key='o-1', token=42, version=2, created=False, replayed=False)

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
        retry: How a write that got no decision is sent again (default:
            ``RetryPolicy()``, four attempts; :data:`~fencegate.NO_RETRY`: never).
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
        self._client = httpx.Client(**self._settings.client_options())

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
        except (httpx.UnsupportedProtocol, httpx.LocalProtocolError):
            raise  # the request cannot be sent at all (the URL, a header): a mistake, not the network
        except httpx.TransportError as error:
            raise proto.unreachable(error, self.url) from error
        return parse(response, request)

    def _write(
        self,
        request: Request,
        parse: Callable[[httpx.Response, Request], _T],
        *,
        live: Live = None,
        retry: RetryPolicy | None = None,
        timeout: float | None = None,
    ) -> _T:
        """Sends a write, and sends it again as the policy says (see the module doc);
        ``live`` is the writer's term, checked before every resend."""
        return _retry.send(lambda: self._send(request, parse, timeout), retry or self._settings.retry, live)

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
            idempotency_key: The write's ``Idempotency-Key`` (default: a fresh random
                one). Pass your own to retry the same logical write later, even from
                another process: the gateway applies it once and answers every
                attempt with the first one's answer.

        Raises:
            StaleToken: A newer term has written; stop this term's work.
            VersionMismatch: The precondition did not hold.
            IdempotencyKeyReused: ``idempotency_key`` named another write before.
            TransientError: Still no decision after the policy's attempts; see
                ``write_applied``, and retry with the same key.
        """
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
        return self._write(request, proto.write_result)

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
            idempotency_key=key_for(idempotency_key),
        )
        return self._write(request, proto.write_result)

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
            resource, token=token, holder=self._settings.holder_for(holder), idempotency_key=key_for(idempotency_key)
        )
        return self._write(request, proto.fence_state)

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
            idempotency_key=key_for(idempotency_key),
        )
        return self._write(request, proto.sql_outcome)

    # -- several resources at once

    def txn(
        self,
        operations: Sequence[TxnOp],
        *,
        idempotency_key: str | None = None,
        leases: Sequence[Lease] = (),
    ) -> TxnOutcome:
        """Applies ``operations`` all or none, in one transaction (``POST /v1/txn``).

        >>> gw.txn([                                                   # doctest: +SKIP
        ...     TxnPut("shard-7", "owner", "node-b", token=12, if_match=4),
        ...     TxnDelete("shard-7", "handoff", token=12),
        ...     TxnAdvance("queue-7", token=30),
        ...     TxnCheck("cluster-config", token=5, key="layout", version=9),
        ... ])

        Each operation carries the token of the writer's term on its resource (all
        operations on one resource the same). Every resource's fence is held from its
        check to the commit, so a checked resource cannot move in between.

        Args:
            idempotency_key: As for :meth:`put`.
            leases: The terms the tokens belong to: each is checked before every
                attempt (:class:`~fencegate.LeaseLost` if one is over), and a stale
                refusal ends the term of every lease whose resource it names.

        Returns:
            One :class:`~fencegate.TxnResult` per operation, in order.

        Raises:
            StaleToken: One resource or more is past its token (``stale`` lists them
                all); nothing was applied.
            VersionMismatch: The precondition of operation ``operation`` did not hold;
                nothing was applied.
            InvalidTransaction: Not a transaction (``operation`` names the culprit).
            TooManyOperations: More than the gateway's ``--txn-max-operations``.
        """
        request = proto.txn(operations, idempotency_key=key_for(idempotency_key))
        live = all_live(leases)
        if live is not None:
            live()
        try:
            return self._write(request, proto.txn_outcome, live=live)
        except StaleToken as stale:
            stale_terms(stale, leases)
            raise

    # -- hosted leases, step by step

    def acquire_lease(
        self, resource: str, *, ttl: float, holder: str | None = None, idempotency_key: str | None = None
    ) -> LeaseState:
        """Takes the lease if it is free, expired or already ``holder``'s: always a new
        token, with the resource's fence raised to it. Raises
        :class:`~fencegate.LeaseHeld` if another holder holds it."""
        request = proto.lease_step(
            resource,
            "acquire",
            holder=self._settings.lease_holder(holder),
            idempotency_key=key_for(idempotency_key),
            ttl=ttl,
        )
        return self._write(request, proto.lease_state)

    def renew_lease(
        self,
        resource: str,
        *,
        token: int,
        ttl: float,
        holder: str | None = None,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> LeaseState:
        """Extends the lease held at ``token``. Raises :class:`~fencegate.LeaseLost`
        when the term is over."""
        request = proto.lease_step(
            resource,
            "renew",
            holder=self._settings.lease_holder(holder),
            idempotency_key=key_for(idempotency_key),
            token=token,
            ttl=ttl,
        )
        return self._write(request, proto.lease_state, timeout=timeout)

    def release_lease(
        self,
        resource: str,
        *,
        token: int,
        holder: str | None = None,
        timeout: float | None = None,
        idempotency_key: str | None = None,
    ) -> LeaseState:
        """Gives the lease up, so that a rival may take it at once."""
        request = proto.lease_step(
            resource,
            "release",
            holder=self._settings.lease_holder(holder),
            idempotency_key=key_for(idempotency_key),
            token=token,
        )
        return self._write(request, proto.lease_state, timeout=timeout)

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
        renew_retry_every: float | None = None,
        renew_timeout: float | None = None,
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
            renew_retry_every=renew_retry_every,
            renew_timeout=renew_timeout,
        )

    # -- health

    def ready(self, *, timeout: float | None = None) -> bool:
        """Whether the gateway and its backend are ready: ``GET /readyz`` answers 200.

        ``False`` when it answers anything else (``503`` while its database is down or
        refuses writes) and when no answer comes: the gateway is stopped, paused or out
        of reach, or ``timeout`` seconds (default: the gateway's ``timeout``) pass.
        Raises only for a request that cannot be sent at all, a mistake in the code.
        """
        try:
            return self._send(Request("GET", "/readyz"), proto.ready, timeout)
        except GatewayUnreachable:
            return False


def all_live(leases: Sequence[Any]) -> Live:
    """A check of every lease's term, or ``None`` without leases."""
    if not leases:
        return None

    def live() -> None:
        for lease in leases:
            lease.check()

    return live
