"""Leases hosted by the gateway, held for one term: :class:`Lease`, renewed by threads.
:class:`~fencegate.AsyncLease` is the same for asyncio.

A lease object is one term. Acquiring it mints a new fencing token and raises the
resource's fence to it in the same step, so the term's first write needs no advance
and the previous term's late writes are refused from then on. While held, it renews
itself in the background every ``renew_every`` (a third of the TTL by default).

Timing
------
The holder's own monotonic clock decides when to stop, never the gateway's answer
alone. Each successful renewal moves the **deadline** to the instant the renewal was
*sent*, plus the TTL (or what the gateway granted, if less), less ``margin`` (2/15 of
the TTL by default: 2 s of 15 s). The gateway starts the TTL when it receives the
request, later than it was sent, so the holder stops at least ``margin`` before any
rival can take over, whatever the network did.

A renewal that fails is tried again every ``renew_retry_every`` (1/30 of the TTL) until
the deadline, each attempt abandoned after ``renew_timeout`` (1/15 of the TTL) or at the
deadline, whichever comes first. So a gateway that hangs (its database failing over)
cannot use up the time left with one request, and the last attempt is sent shortly
before the deadline: a lease whose database is back in time is kept. ``margin`` must
stay above ``renew_timeout``, so that an attempt sent just before the deadline reaches
the gateway before the lease can pass there.

The term ends (``lost`` is set, callbacks run, ``reason`` says why) on the first of:

- ``409 lease_lost`` from a renewal: the gateway says the lease is no longer ours;
- ``409 stale_token`` (or ``ZF001`` in a fenced transaction) from any call made
  through the lease: a newer term has written;
- the deadline passing without a successful renewal, gateway reachable or not: a
  gateway that is down is a transient error and never ends the term by itself, but
  the holder cannot know for longer than the deadline that nobody else holds the lease;
- :meth:`Lease.release` (or leaving the ``with`` block).

After that every call through the lease raises :class:`~fencegate.LeaseLost` without
being sent. To lead again, acquire a new lease: a new term, a new token.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any, Callable, Literal, TypeVar

from . import _protocol as proto
from ._protocol import Request
from ._retry import NO_RETRY, key_for
from ._term import (
    RELEASE_TIMEOUT,
    LeaseTiming,
    LostReason,
    Term,
    granted_token,
    log_lost,
    logger,
    lost_error,
    run_callbacks,
)
from .errors import FencegateError, LeaseHeld, LeaseLost, StaleToken, TransientError
from .fenced import fenced_transaction
from .models import FenceState, IfMatch, LeaseState, SqlOutcome, StatementLike, StoredObject, WriteResult

if TYPE_CHECKING:
    import httpx
    import psycopg

    from .gateway import Gateway

    _Sync = TypeVar("_Sync", bound=psycopg.Connection[Any])

__all__ = ["Lease", "LeaseTiming", "LostReason"]

_T = TypeVar("_T")


class Lease:
    """A lease hosted by the gateway, held for one term, renewed by a background
    thread.

    Make one with :meth:`Gateway.lease <fencegate.Gateway.lease>`::

        with gateway.lease("sweeper", holder="node-a", ttl=15) as lease:
            while not lease.lost.is_set():
                lease.put("invoice-1/reminder", b"sent")

    Attributes:
        lost: Set when the term ends, for whatever reason (see :attr:`reason`).
        resource: The lease's name, which is also the resource it fences.
        holder: The holder's name.
        timing: The timing (:class:`LeaseTiming`).
    """

    def __init__(
        self,
        gateway: Gateway,
        resource: str,
        *,
        holder: str,
        ttl: float = 15.0,
        margin: float | None = None,
        renew_every: float | None = None,
        retry_every: float | None = None,
        renew_retry_every: float | None = None,
        renew_timeout: float | None = None,
    ) -> None:
        self.gateway = gateway
        self.resource = resource
        self.holder = holder
        self.timing = LeaseTiming.of(ttl, margin, renew_every, retry_every, renew_retry_every, renew_timeout)
        self.lost = threading.Event()
        # Guards _term; notified when the term ends, to wake the watchdog.
        self._cond = threading.Condition()
        self._term = Term()

    def __repr__(self) -> str:
        return f"<Lease {self.resource} holder={self.holder} token={self._term.token} reason={self._term.reason}>"

    # -- state

    @property
    def token(self) -> int:
        """The fencing token of this term (the same for the whole term)."""
        with self._cond:
            return self._term.require_token()

    @property
    def reason(self) -> LostReason | None:
        """Why the term ended, ``None`` while it lasts."""
        with self._cond:
            return self._term.reason

    @property
    def held(self) -> bool:
        """Whether the term lasts: acquired, not ended, deadline not passed."""
        with self._cond:
            return self._term.token is not None and self._term.reason is None and not self._term.expired()

    def remaining(self) -> float:
        """Seconds until the holder steps down unless a renewal succeeds; 0 when not
        held."""
        with self._cond:
            if self._term.token is None or self._term.reason is not None:
                return 0.0
            return max(0.0, self._term.deadline - time.monotonic())

    def on_lost(self, callback: Callable[[LostReason], None]) -> None:
        """Calls ``callback(reason)`` when the term ends, at once if it has ended.

        Callbacks run on the thread that noticed the end (a background thread, or the
        one whose call was refused); keep them short.
        """
        with self._cond:
            if self._term.reason is None:
                self._term.callbacks.append(callback)
                return
            reason = self._term.reason
        run_callbacks([callback], reason)

    def check(self) -> int:
        """The term's token if the term lasts; raises :class:`~fencegate.LeaseLost`
        otherwise (stepping down first if the deadline has just passed)."""
        with self._cond:
            token = self._term.require_token()
            expired = self._term.expired()
            reason = self._term.reason
        if expired:
            self._end(LostReason.DEADLINE)
            reason = LostReason.DEADLINE
        if reason is not None:
            raise lost_error(self.resource, reason)
        return token

    # -- acquire and release

    def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Acquires the lease, as a lock's ``acquire``.

        Blocking, it waits until the lease is free (trying every ``retry_every``, and
        riding out transient errors) or ``timeout`` seconds pass. Non-blocking, it tries
        once: one acquisition, resent with its ``Idempotency-Key`` as the gateway's
        :class:`~fencegate.RetryPolicy` says, so that a lost answer cannot mint a second
        token. Returns whether it was acquired; raises other errors (for example
        :class:`~fencegate.Forbidden`).
        """
        with self._cond:
            if self._term.token is not None:
                raise RuntimeError("a Lease is one term and was acquired already: make a new one to lead again")
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            sent = time.monotonic()
            try:
                state = self.gateway.acquire_lease(self.resource, holder=self.holder, ttl=self.timing.ttl)
            except LeaseHeld as held:
                if not blocking:
                    return False
                wait = self.timing.follower_wait(held.expires_in_ms)
            except TransientError as error:
                if not blocking:
                    raise
                logger.info("lease %s: acquire failed, will retry: %s", self.resource, error)
                wait = self.timing.retry_every
            else:
                self._begin(state, sent)
                return True
            if give_up is not None:
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                wait = min(wait, left)
            time.sleep(wait)

    def _begin(self, state: LeaseState, sent: float) -> None:
        with self._cond:
            self._term.token = granted_token(state)
            self._term.deadline = self.timing.deadline(sent, state)
        logger.info("lease %s: acquired by %s at token %s", self.resource, self.holder, self._term.token)
        for target, name in ((self._renew, "renew"), (self._watch, "watchdog")):
            threading.Thread(target=target, name=f"fencegate-lease-{name}-{self.resource}", daemon=True).start()

    def release(self) -> None:
        """Ends the term and gives the lease up, so that a rival may take it at once.

        Nothing more is sent under the term once this begins. A release that fails is
        not an error: the lease then expires after its TTL.
        """
        with self._cond:
            token = self._term.token
            reason = self._term.reason
        if token is None:
            return
        self._end(LostReason.RELEASED)
        # After a step-down on the deadline the gateway may still count the lease ours.
        if reason in (None, LostReason.DEADLINE):
            try:
                self._step("release", token, timeout=RELEASE_TIMEOUT)
            except FencegateError as error:
                logger.info("lease %s: not released (it will expire): %s", self.resource, error)

    def __enter__(self) -> Lease:
        self.acquire()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.release()

    # -- the background

    def _end(self, reason: LostReason) -> bool:
        """Ends the term once; returns whether this call ended it."""
        with self._cond:
            if self._term.reason is not None:
                return False
            self._term.reason = reason
            callbacks, self._term.callbacks = self._term.callbacks, []
            token = self._term.token
            self._cond.notify_all()
        self.lost.set()
        log_lost(self.resource, self.holder, token, reason)
        run_callbacks(callbacks, reason)
        return True

    def _step(
        self, step: Literal["renew", "release"], token: int, *, timeout: float, ttl: float | None = None
    ) -> LeaseState:
        """A renewal or the release, sent once: renewals are retried by :meth:`_renew`
        until the deadline, each with a key of its own, and a release that fails is
        no error."""
        request = proto.lease_step(
            self.resource, step, holder=self.holder, idempotency_key=key_for(None), token=token, ttl=ttl
        )
        return self.gateway._write(request, proto.lease_state, retry=NO_RETRY, timeout=timeout)

    def _renew(self) -> None:
        delay = self.timing.renew_every
        while not self.lost.wait(delay):
            with self._cond:
                token = self._term.require_token()
                left = self._term.deadline - time.monotonic()
            if left <= 0:
                self._end(LostReason.DEADLINE)
                return
            sent = time.monotonic()
            try:
                state = self._step("renew", token, ttl=self.timing.ttl, timeout=self.timing.attempt_timeout(left))
            except LeaseLost:
                self._end(LostReason.LEASE_LOST)
                return
            except Exception as error:
                # Down, slow or refusing: the term lasts until the deadline, and the
                # watchdog ends it there if no renewal gets through by then. Until then,
                # short attempts at short intervals: the last one is sent close to the
                # deadline, in case the gateway or its database is back by then.
                logger.warning("lease %s: renewal failed, %.3f s to the deadline: %s", self.resource, left, error)
                delay = self.timing.renew_retry_every
                continue
            with self._cond:
                if self._term.reason is None:
                    self._term.deadline = max(self._term.deadline, self.timing.deadline(sent, state))
            delay = self.timing.renew_every

    def _watch(self) -> None:
        with self._cond:
            while self._term.reason is None:
                left = self._term.deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            else:
                return
        self._end(LostReason.DEADLINE)

    # -- calls under the term

    def _under(self, request: Callable[[int], Request], parse: Callable[[httpx.Response, Request], _T]) -> _T:
        """Sends the write made with the term's token, and resends it (same key) only
        while the term lasts."""
        token = self.check()
        try:
            return self.gateway._write(request(token), parse, live=self.check)
        except StaleToken:
            self._end(LostReason.STALE_TOKEN)
            raise
        except LeaseLost:
            self._end(LostReason.LEASE_LOST)
            raise

    def put(
        self,
        key: str,
        value: bytes | str,
        *,
        if_match: IfMatch = None,
        if_none_match: bool = False,
        idempotency_key: str | None = None,
    ) -> WriteResult:
        """Writes an object of the lease's resource with the term's token; see
        :meth:`Gateway.put <fencegate.Gateway.put>`."""
        idempotency_key = key_for(idempotency_key)
        return self._under(
            lambda token: proto.put(
                self.resource,
                key,
                value,
                token=token,
                holder=self.holder,
                if_match=if_match,
                if_none_match=if_none_match,
                idempotency_key=idempotency_key,
            ),
            proto.write_result,
        )

    def delete(self, key: str, *, if_match: IfMatch = None, idempotency_key: str | None = None) -> WriteResult:
        """Deletes an object of the lease's resource with the term's token."""
        idempotency_key = key_for(idempotency_key)
        return self._under(
            lambda token: proto.delete(
                self.resource, key, token=token, holder=self.holder, if_match=if_match, idempotency_key=idempotency_key
            ),
            proto.write_result,
        )

    def get(self, key: str) -> StoredObject | None:
        """Reads an object of the lease's resource (no token needed)."""
        return self.gateway.get(self.resource, key)

    def advance(self, *, idempotency_key: str | None = None) -> FenceState:
        """Raises the resource's fence to the term's token."""
        idempotency_key = key_for(idempotency_key)
        return self._under(
            lambda token: proto.advance(
                self.resource, token=token, holder=self.holder, idempotency_key=idempotency_key
            ),
            proto.fence_state,
        )

    def sql(self, statements: Sequence[StatementLike], *, idempotency_key: str | None = None) -> SqlOutcome:
        """Runs statements after the fence check of the term's token (``/v1/sql``)."""
        idempotency_key = key_for(idempotency_key)
        return self._under(
            lambda token: proto.sql(
                self.resource, statements, token=token, holder=self.holder, idempotency_key=idempotency_key
            ),
            proto.sql_outcome,
        )

    @contextmanager
    def transaction(self, conn: _Sync) -> Iterator[_Sync]:
        """:func:`~fencegate.fenced_transaction` with the term's token, on a psycopg 3
        connection; a stale rejection ends the term."""
        token = self.check()
        try:
            with fenced_transaction(conn, self.resource, token) as fenced:
                yield fenced
        except StaleToken:
            self._end(LostReason.STALE_TOKEN)
            raise
