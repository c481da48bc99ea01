"""Resending writes: one ``Idempotency-Key`` per logical write, resent only on the
answers that decided nothing.

Behavior
--------
- Every write carries an ``Idempotency-Key``: the caller's, or a random one (a UUID 4)
  made once per call. Every attempt of the call sends the same key and the same
  request, so the gateway applies it at most once and answers a late attempt with the
  first one's answer.
- A write is resent after: no answer (:class:`GatewayUnreachable`: refused, reset,
  timed out, or a proxy's 502/503/504), ``503 backend_unavailable`` (``write_applied``
  ``null`` or ``false``), ``503 overloaded``, ``503 shutting_down`` and
  ``409 idempotency_in_flight``. Any other answer is the write's own and is returned or
  raised at once: a ``409 stale_token`` above all, which ends the term and is never
  resent.
- At most :attr:`RetryPolicy.attempts` attempts. Between two, a pause that doubles
  from :attr:`RetryPolicy.backoff` up to :attr:`RetryPolicy.max_backoff`, with jitter,
  and never shorter than the ``Retry-After`` the gateway asked for.
- Under a lease, only while its term lasts: the term is checked before every resend,
  and when it is over :class:`LeaseLost` is raised, with the last transient error as
  its ``__cause__``.
- The error raised after the last attempt has ``write_applied = None`` if any attempt
  may have been applied, and ``attempts`` set to the number of attempts.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Callable, Optional, TypeVar

from .errors import (
    BackendUnavailable,
    GatewayUnreachable,
    IdempotencyInFlight,
    IssuerUnavailable,
    LeaseLost,
    NotSynchronouslyReplicated,
    Overloaded,
    ShuttingDown,
    TransientError,
)

__all__ = ["NO_RETRY", "RetryPolicy", "check_idempotency_key", "new_idempotency_key"]

_T = TypeVar("_T")

MAX_IDEMPOTENCY_KEY_LEN = 255
"""The longest ``Idempotency-Key`` the gateway takes, in bytes."""

_RESENT = (
    GatewayUnreachable,
    BackendUnavailable,
    Overloaded,
    ShuttingDown,
    IdempotencyInFlight,
    NotSynchronouslyReplicated,
    IssuerUnavailable,
)
"""The transient errors after which a write is resent (not ``body_timeout``: the
client's own request was too slow, and the same request would be again)."""

Live = Optional[Callable[[], object]]
"""Raises :class:`LeaseLost` when the writer's term is over; ``None``: no term."""


@dataclass(frozen=True)
class RetryPolicy:
    """How a gateway client resends a write that got no decision.

    Args:
        attempts: Attempts of one write in all, the first included (``1``: never
            resend).
        backoff: Seconds before the first resend; doubled before each further one.
        max_backoff: The longest pause between two attempts, unless the gateway asks
            for a longer one with ``Retry-After``.
    """

    attempts: int = 4
    backoff: float = 0.1
    max_backoff: float = 2.0

    def __post_init__(self) -> None:
        if isinstance(self.attempts, bool) or not isinstance(self.attempts, int) or self.attempts < 1:
            raise ValueError(f"attempts is an int of at least 1, not {self.attempts!r}")
        if not 0 <= self.backoff <= self.max_backoff:
            raise ValueError(
                f"backoff and max_backoff need 0 <= backoff <= max_backoff, not {self.backoff}, {self.max_backoff}"
            )

    def pause(self, resend: int, error: TransientError) -> float:
        """Seconds to wait before resend number ``resend`` (from 1)."""
        wait = min(self.max_backoff, self.backoff * 2.0 ** (resend - 1))
        # Jitter, so that writers cut off together do not come back together.
        wait *= random.uniform(0.5, 1.0)
        if error.retry_after is not None:
            wait = max(wait, error.retry_after)
        return wait


NO_RETRY = RetryPolicy(attempts=1)
"""Send each write once."""


def new_idempotency_key() -> str:
    """A fresh key for one logical write: a random UUID."""
    return str(uuid.uuid4())


def check_idempotency_key(key: str) -> str:
    """``key`` if the gateway would take it (1 to 255 printable ASCII characters);
    ``ValueError`` or ``TypeError`` otherwise."""
    if not isinstance(key, str):
        raise TypeError(f"an Idempotency-Key is a str, not {type(key).__name__}")
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY_LEN or not all(" " <= c <= "~" for c in key):
        raise ValueError(f"an Idempotency-Key is 1 to {MAX_IDEMPOTENCY_KEY_LEN} printable ASCII characters: {key!r}")
    return key


def key_for(idempotency_key: str | None) -> str:
    """The caller's key, checked, or a fresh one for a new logical write."""
    if idempotency_key is None:
        return new_idempotency_key()
    return check_idempotency_key(idempotency_key)


class _Attempts:
    """What the attempts of one write have told so far."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.made = 0
        self.in_doubt = False

    def failed(self, error: TransientError) -> float | None:
        """The pause before the next attempt, or ``None`` to raise ``error`` now."""
        self.made += 1
        self.in_doubt = self.in_doubt or error.write_applied is None
        error.attempts = self.made
        if self.in_doubt:
            error.write_applied = None  # an earlier attempt may have been applied
        if not isinstance(error, _RESENT) or self.made >= self.policy.attempts:
            return None
        return self.policy.pause(self.made, error)


def _term_check(live: Live, error: TransientError) -> None:
    if live is None:
        return
    try:
        live()
    except LeaseLost as lost:
        raise lost from error


def send(attempt: Callable[[], _T], policy: RetryPolicy, live: Live = None) -> _T:
    """``attempt()``, repeated as the policy says; see the module's Behavior."""
    attempts = _Attempts(policy)
    while True:
        try:
            return attempt()
        except TransientError as error:
            pause = attempts.failed(error)
            if pause is None:
                raise
            failure = error
        time.sleep(pause)
        _term_check(live, failure)


async def send_async(attempt: Callable[[], Awaitable[_T]], policy: RetryPolicy, live: Live = None) -> _T:
    """:func:`send` for asyncio."""
    attempts = _Attempts(policy)
    while True:
        try:
            return await attempt()
        except TransientError as error:
            pause = attempts.failed(error)
            if pause is None:
                raise
            failure = error
        await asyncio.sleep(pause)
        _term_check(live, failure)
