"""What :class:`~fencegate.Lease` and :class:`~fencegate.AsyncLease` share: the
reasons a term ends, the timing, and the state of a term."""

from __future__ import annotations

import enum
import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from ._protocol import ttl_ms
from .errors import FencegateError, LeaseLost
from .models import LeaseState

logger = logging.getLogger("fencegate.lease")

RELEASE_TIMEOUT = 2.0
"""Longest wait for a release on the way out: an unreleased lease just expires."""


class LostReason(str, enum.Enum):
    """Why a term ended."""

    STALE_TOKEN = "stale_token"
    """The gateway or Postgres refused a call made under the term: a newer term wrote."""
    LEASE_LOST = "lease_lost"
    """The gateway said the lease is no longer held at the term's token."""
    DEADLINE = "deadline"
    """No renewal succeeded before the deadline: stepped down on the holder's clock."""
    RELEASED = "released"
    """Released by its holder."""


@dataclass(frozen=True)
class LeaseTiming:
    """A lease's timing, in seconds; every default is a fraction of ``ttl``, the same in
    every fencegate client. For a 15 s lease: renew every 5 s; step down 13 s after the
    last renewal that got through was sent, 2 s before a rival may acquire; after a
    failed renewal, try again every 0.5 s, each attempt given at most 1 s.

    Args:
        ttl: How long each acquisition or renewal holds on the gateway's clock.
        margin: How long before the TTL could pass the holder steps down
            (``ttl * 2 / 15``); above ``renew_timeout``.
        renew_every: Time between renewals (``ttl / 3``); below ``ttl - margin``.
        retry_every: Time between tries to acquire a lease someone else holds
            (``min(renew_every, ttl / 10)``).
        renew_retry_every: Time between renewal attempts after a failed one
            (``ttl / 30``). They go on until the deadline, so that a gateway or
            database that comes back before it finds the holder still asking.
        renew_timeout: The longest one renewal attempt may take (``ttl / 15``; less
            when the deadline is nearer), so that a request that hangs does not use up
            the time left for the attempts after it.
    """

    ttl: float
    margin: float
    renew_every: float
    retry_every: float
    renew_retry_every: float
    renew_timeout: float

    @classmethod
    def of(
        cls,
        ttl: float,
        margin: float | None = None,
        renew_every: float | None = None,
        retry_every: float | None = None,
        renew_retry_every: float | None = None,
        renew_timeout: float | None = None,
    ) -> LeaseTiming:
        """Fills in the defaults and checks that the timing can work."""
        ttl_ms(ttl)  # checks the range the gateway accepts
        margin = ttl * 2 / 15 if margin is None else margin
        renew_every = ttl / 3 if renew_every is None else renew_every
        retry_every = min(renew_every, ttl / 10) if retry_every is None else retry_every
        renew_retry_every = ttl / 30 if renew_retry_every is None else renew_retry_every
        renew_timeout = ttl / 15 if renew_timeout is None else renew_timeout
        if not 0 < margin < ttl:
            raise ValueError(f"margin must be above 0 and below the ttl ({ttl} s), not {margin}")
        if not 0 < renew_every < ttl - margin:
            raise ValueError(
                f"renew_every must be above 0 and below ttl - margin ({ttl - margin} s), "
                f"or the lease would step down before it renews; not {renew_every}"
            )
        if retry_every <= 0:
            raise ValueError(f"retry_every must be above 0, not {retry_every}")
        if renew_retry_every <= 0:
            raise ValueError(f"renew_retry_every must be above 0, not {renew_retry_every}")
        if renew_timeout <= 0:
            raise ValueError(f"renew_timeout must be above 0, not {renew_timeout}")
        if margin <= renew_timeout:
            raise ValueError(
                f"margin ({margin} s) must be above renew_timeout ({renew_timeout} s): a renewal "
                "sent just before the holder steps down must be able to reach the gateway before "
                "the lease can pass there; raise margin or lower renew_timeout"
            )
        return cls(ttl, margin, renew_every, retry_every, renew_retry_every, renew_timeout)

    def attempt_timeout(self, left: float) -> float:
        """How long a renewal attempt may take with ``left`` seconds to the deadline."""
        return min(left, self.renew_timeout)

    def deadline(self, sent: float, state: LeaseState) -> float:
        """The step-down instant after a grant whose request was sent at ``sent``."""
        holds = min(self.ttl, state.expires_in_ms / 1000)
        return sent + holds - self.margin

    def follower_wait(self, expires_in_ms: int | None) -> float:
        """How long to wait before trying again to acquire a lease someone holds."""
        wait = self.retry_every
        if expires_in_ms is not None:
            wait = min(wait, expires_in_ms / 1000)
        # Jitter, so that followers do not all ask at the same instant.
        return max(wait, 0.001) * random.uniform(1.0, 1.2)


def granted_token(state: LeaseState) -> int:
    if state.token is None:
        raise FencegateError("the gateway granted a lease without a token")
    return state.token


class Term:
    """What both flavours know about the term; guarded by the owner's lock."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.deadline = float("-inf")
        self.reason: LostReason | None = None
        self.callbacks: list[Callable[[LostReason], None]] = []

    def require_token(self) -> int:
        if self.token is None:
            raise RuntimeError("the lease has not been acquired")
        return self.token

    def expired(self) -> bool:
        return self.token is not None and self.reason is None and time.monotonic() >= self.deadline


def run_callbacks(callbacks: Sequence[Callable[[LostReason], None]], reason: LostReason) -> None:
    for callback in callbacks:
        try:
            callback(reason)
        except Exception:
            logger.exception("a lost-lease callback raised")


def log_lost(resource: str, holder: str, token: int | None, reason: LostReason) -> None:
    level = logging.INFO if reason is LostReason.RELEASED else logging.WARNING
    logger.log(level, "lease %s: term of %s at token %s ended: %s", resource, holder, token, reason.value)


def lost_error(resource: str, reason: LostReason) -> LeaseLost:
    return LeaseLost(f"the term of lease {resource} is over ({reason.value}): acquire a new lease to lead again")
