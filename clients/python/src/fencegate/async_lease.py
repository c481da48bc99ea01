"""One term of a lease hosted by the gateway, for asyncio: :class:`AsyncLease`.

The same as :class:`~fencegate.Lease` (see :mod:`fencegate.lease` for the timing and
the end of a term), with a task instead of threads, and :meth:`AsyncLease.run`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager, suppress
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
    import asyncpg
    import httpx
    import psycopg
    from asyncpg.pool import PoolConnectionProxy

    from .async_gateway import AsyncGateway

    _Async = TypeVar(
        "_Async", bound="psycopg.AsyncConnection[Any] | asyncpg.Connection[Any] | PoolConnectionProxy[Any]"
    )

__all__ = ["AsyncLease", "LeaseTiming", "LostReason"]

_T = TypeVar("_T")


class AsyncLease:
    """A lease hosted by the gateway, held for one term, renewed by an asyncio task.

    Make one with :meth:`AsyncGateway.lease <fencegate.AsyncGateway.lease>`, inside
    the event loop::

        async with gateway.lease("sweeper", holder="node-a", ttl=15) as lease:
            await lease.run(sweep_forever(lease))   # cancelled when the term ends

    Attributes:
        lost: Set when the term ends (an :class:`asyncio.Event`).
    """

    def __init__(
        self,
        gateway: AsyncGateway,
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
        self.lost = asyncio.Event()
        self._term = Term()
        self._tasks: list[asyncio.Task[None]] = []

    def __repr__(self) -> str:
        return f"<AsyncLease {self.resource} holder={self.holder} token={self._term.token} reason={self._term.reason}>"

    @property
    def token(self) -> int:
        """The fencing token of this term."""
        return self._term.require_token()

    @property
    def reason(self) -> LostReason | None:
        """Why the term ended, ``None`` while it lasts."""
        return self._term.reason

    @property
    def held(self) -> bool:
        """Whether the term lasts: acquired, not ended, deadline not passed."""
        return self._term.token is not None and self._term.reason is None and not self._term.expired()

    def remaining(self) -> float:
        """Seconds until the holder steps down unless a renewal succeeds."""
        if self._term.token is None or self._term.reason is not None:
            return 0.0
        return max(0.0, self._term.deadline - time.monotonic())

    def on_lost(self, callback: Callable[[LostReason], None]) -> None:
        """Calls ``callback(reason)`` in the event loop when the term ends, at once if
        it has ended."""
        if self._term.reason is None:
            self._term.callbacks.append(callback)
        else:
            run_callbacks([callback], self._term.reason)

    def check(self) -> int:
        """The term's token if the term lasts; raises :class:`~fencegate.LeaseLost`
        otherwise. The clock is read here too, so a busy event loop that delayed the
        watchdog cannot let a write out after the deadline."""
        token = self._term.require_token()
        if self._term.expired():
            self._end(LostReason.DEADLINE)
        if self._term.reason is not None:
            raise lost_error(self.resource, self._term.reason)
        return token

    async def acquire(self, blocking: bool = True, timeout: float | None = None) -> bool:
        """Acquires the lease; see :meth:`Lease.acquire`."""
        if self._term.token is not None:
            raise RuntimeError("an AsyncLease is one term and was acquired already: make a new one to lead again")
        give_up = None if timeout is None else time.monotonic() + timeout
        while True:
            sent = time.monotonic()
            try:
                state = await self.gateway.acquire_lease(self.resource, holder=self.holder, ttl=self.timing.ttl)
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
                self._term.token = granted_token(state)
                self._term.deadline = self.timing.deadline(sent, state)
                logger.info("lease %s: acquired by %s at token %s", self.resource, self.holder, self._term.token)
                self._tasks = [asyncio.ensure_future(self._renew()), asyncio.ensure_future(self._watch())]
                return True
            if give_up is not None:
                left = give_up - time.monotonic()
                if left <= 0:
                    return False
                wait = min(wait, left)
            await asyncio.sleep(wait)

    async def release(self) -> None:
        """Ends the term and gives the lease up; see :meth:`Lease.release`."""
        token, reason = self._term.token, self._term.reason
        if token is None:
            return
        self._end(LostReason.RELEASED)
        if reason in (None, LostReason.DEADLINE):
            try:
                await self._step("release", token, timeout=RELEASE_TIMEOUT)
            except FencegateError as error:
                logger.info("lease %s: not released (it will expire): %s", self.resource, error)

    async def __aenter__(self) -> AsyncLease:
        await self.acquire()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.release()

    async def run(self, work: Awaitable[_T]) -> _T:
        """Runs ``work`` until it finishes or the term ends, whichever comes first.

        Returns its result; if the term ends first, cancels it and raises
        :class:`~fencegate.LeaseLost`.
        """
        task = asyncio.ensure_future(work)
        ended = asyncio.ensure_future(self.lost.wait())
        try:
            await asyncio.wait({task, ended}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ended.cancel()
            if not task.done():
                task.cancel()
                with suppress(asyncio.CancelledError):
                    await task
        if task.cancelled() or not task.done():
            raise lost_error(self.resource, self._term.reason or LostReason.DEADLINE)
        return task.result()

    def _end(self, reason: LostReason) -> bool:
        if self._term.reason is not None:
            return False
        self._term.reason = reason
        callbacks, self._term.callbacks = self._term.callbacks, []
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()  # the renewal and the deadline timer have nothing left to do
        self.lost.set()
        log_lost(self.resource, self.holder, self._term.token, reason)
        run_callbacks(callbacks, reason)
        return True

    async def _step(
        self, step: Literal["renew", "release"], token: int, *, timeout: float | None = None, ttl: float | None = None
    ) -> LeaseState:
        """See :meth:`Lease._step <fencegate.Lease._step>`."""
        request = proto.lease_step(
            self.resource, step, holder=self.holder, idempotency_key=key_for(None), token=token, ttl=ttl
        )
        return await self.gateway._write(request, proto.lease_state, retry=NO_RETRY, timeout=timeout)

    async def _renew(self) -> None:
        delay = self.timing.renew_every
        while self._term.reason is None:
            await asyncio.sleep(delay)
            if self._term.reason is not None:
                return
            token = self._term.require_token()
            left = self._term.deadline - time.monotonic()
            if left <= 0:
                self._end(LostReason.DEADLINE)
                return
            sent = time.monotonic()
            bound = self.timing.attempt_timeout(left)
            try:
                state = await asyncio.wait_for(self._step("renew", token, ttl=self.timing.ttl, timeout=bound), bound)
            except LeaseLost:
                self._end(LostReason.LEASE_LOST)
                return
            except (Exception, asyncio.TimeoutError) as error:
                # See Lease._renew: retried at short intervals until the deadline.
                logger.warning("lease %s: renewal failed, %.3f s to the deadline: %r", self.resource, left, error)
                delay = self.timing.renew_retry_every
                continue
            if self._term.reason is None:
                self._term.deadline = max(self._term.deadline, self.timing.deadline(sent, state))
            delay = self.timing.renew_every

    async def _watch(self) -> None:
        while self._term.reason is None:
            left = self._term.deadline - time.monotonic()
            if left <= 0:
                self._end(LostReason.DEADLINE)
                return
            await asyncio.sleep(left)

    # -- calls under the term

    async def _under(self, request: Callable[[int], Request], parse: Callable[[httpx.Response, Request], _T]) -> _T:
        """See :meth:`Lease._under <fencegate.Lease._under>`."""
        token = self.check()
        try:
            return await self.gateway._write(request(token), parse, live=self.check)
        except StaleToken:
            self._end(LostReason.STALE_TOKEN)
            raise
        except LeaseLost:
            self._end(LostReason.LEASE_LOST)
            raise

    async def put(
        self,
        key: str,
        value: bytes | str,
        *,
        if_match: IfMatch = None,
        if_none_match: bool = False,
        idempotency_key: str | None = None,
    ) -> WriteResult:
        """See :meth:`Lease.put <fencegate.Lease.put>`."""
        idempotency_key = key_for(idempotency_key)
        return await self._under(
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

    async def delete(self, key: str, *, if_match: IfMatch = None, idempotency_key: str | None = None) -> WriteResult:
        """See :meth:`Lease.delete <fencegate.Lease.delete>`."""
        idempotency_key = key_for(idempotency_key)
        return await self._under(
            lambda token: proto.delete(
                self.resource, key, token=token, holder=self.holder, if_match=if_match, idempotency_key=idempotency_key
            ),
            proto.write_result,
        )

    async def get(self, key: str) -> StoredObject | None:
        """See :meth:`Lease.get <fencegate.Lease.get>`."""
        return await self.gateway.get(self.resource, key)

    async def advance(self, *, idempotency_key: str | None = None) -> FenceState:
        """See :meth:`Lease.advance <fencegate.Lease.advance>`."""
        idempotency_key = key_for(idempotency_key)
        return await self._under(
            lambda token: proto.advance(
                self.resource, token=token, holder=self.holder, idempotency_key=idempotency_key
            ),
            proto.fence_state,
        )

    async def sql(self, statements: Sequence[StatementLike], *, idempotency_key: str | None = None) -> SqlOutcome:
        """See :meth:`Lease.sql <fencegate.Lease.sql>`."""
        idempotency_key = key_for(idempotency_key)
        return await self._under(
            lambda token: proto.sql(
                self.resource, statements, token=token, holder=self.holder, idempotency_key=idempotency_key
            ),
            proto.sql_outcome,
        )

    @asynccontextmanager
    async def transaction(self, conn: _Async) -> AsyncIterator[_Async]:
        """:func:`~fencegate.fenced_transaction` with the term's token, on a psycopg
        ``AsyncConnection`` or an asyncpg connection; a stale rejection ends the term."""
        token = self.check()
        try:
            async with fenced_transaction(conn, self.resource, token) as fenced:
                yield fenced
        except StaleToken:
            self._end(LostReason.STALE_TOKEN)
            raise
