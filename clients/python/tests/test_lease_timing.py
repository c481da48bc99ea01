"""Lease timing through an outage: the gateway paused with SIGSTOP, as it hangs while
its database fails over, then resumed.

A TTL of 3 s, with the default fractions: renew every 1 s, step down 0.4 s before the
lease could pass (2.6 s after the last renewal that got through was sent), retry a
failed renewal every 0.1 s, each attempt given at most 0.2 s. The pause starts just
before the first renewal is due, so the whole outage falls between two renewals.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import pytest

import fencegate
from fencegate import LostReason

from harness import GatewayProcess, Hop

TTL = 3.0
TIMING = fencegate.LeaseTiming.of(TTL)
PAUSE_AT = TIMING.renew_every - 0.1
"""Seconds after the acquisition: just before the first renewal is due."""
SHORT_PAUSE = TTL - TIMING.margin - TIMING.renew_every - 0.5
"""The budget (1.6 s) less a little: attempts after the resume land before the deadline."""
LONG_PAUSE = TTL - TIMING.margin + 0.3
"""Past ``ttl - margin``: no renewal can get through before the deadline."""
RENEW = b"POST /v1/leases/sweeper/renew"


def sleep_until(instant: float) -> None:
    time.sleep(max(0.0, instant - time.monotonic()))


def test_the_defaults_for_a_short_lease() -> None:
    assert (TIMING.renew_every, TIMING.margin) == pytest.approx((1.0, 0.4))
    assert (TIMING.renew_retry_every, TIMING.renew_timeout) == pytest.approx((0.1, 0.2))


def test_a_pause_shorter_than_the_budget_is_ridden_out(gateway_process: GatewayProcess) -> None:
    with fencegate.Gateway(gateway_process.url, holder="node-a") as gateway:
        lease = gateway.lease("sweeper", ttl=TTL)
        assert lease.acquire(blocking=False)
        acquired = time.monotonic()
        first_deadline = acquired + lease.remaining()
        ended: list[LostReason] = []
        lease.on_lost(ended.append)

        sleep_until(acquired + PAUSE_AT)
        gateway_process.pause()
        time.sleep(SHORT_PAUSE)
        gateway_process.resume()
        resumed = time.monotonic()
        assert resumed < first_deadline - 2 * TIMING.renew_timeout, "the pause ran long: the test proves nothing"

        # Past the deadline the acquisition set: only a renewal after the resume keeps the term.
        sleep_until(first_deadline + TIMING.renew_every / 2)
        assert ended == [] and not lease.lost.is_set(), f"the term ended: {ended}"
        assert lease.held
        assert lease.put("after-the-pause", b"still leading").token == lease.token
        state = gateway.read_lease("sweeper")
        assert (state.held, state.holder, state.token) == (True, "node-a", lease.token)
        lease.release()
    assert ended == [LostReason.RELEASED]


def test_a_pause_past_ttl_minus_margin_ends_the_term_at_the_deadline_after_attempts_until_then(
    gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]
) -> None:
    hop = make_hop(gateway_process.addr)  # to see when each renewal attempt is sent
    with fencegate.Gateway(hop.url, holder="node-a") as gateway:
        lease = gateway.lease("sweeper", ttl=TTL)
        assert lease.acquire(blocking=False)
        acquired = time.monotonic()
        deadline = acquired + lease.remaining()
        ended_at: list[float] = []
        lease.on_lost(lambda _reason: ended_at.append(time.monotonic()))

        sleep_until(acquired + PAUSE_AT)
        gateway_process.pause()
        paused = time.monotonic()
        try:
            assert lease.lost.wait(LONG_PAUSE), "the term outlived the pause"
        finally:
            sleep_until(paused + LONG_PAUSE)
            gateway_process.resume()

        assert lease.reason is LostReason.DEADLINE
        assert len(ended_at) == 1
        assert ended_at[0] >= deadline, f"stepped down {deadline - ended_at[0]:.3f} s before the deadline"
        assert ended_at[0] < deadline + 0.2, f"stepped down {ended_at[0] - deadline:.3f} s after the deadline"

        attempts = [at for at in hop.sent_at(RENEW) if at > paused]
        # Every renewal_timeout + renew_retry_every (0.3 s) from the first renewal to the
        # deadline: about five. Several, none that waited for the deadline, the last close to it.
        assert len(attempts) >= 4, f"renewal attempts while paused: {attempts}"
        gaps = [later - earlier for earlier, later in zip(attempts, attempts[1:])]
        assert max(gaps) < TIMING.renew_timeout + TIMING.renew_retry_every + 0.25, f"gaps between attempts: {gaps}"
        assert attempts[-1] < deadline
        assert deadline - attempts[-1] <= 2 * TIMING.renew_timeout, (
            f"the last attempt came {deadline - attempts[-1]:.3f} s before the deadline"
        )
        with pytest.raises(fencegate.LeaseLost):
            lease.put("k", b"after the end")


@pytest.mark.anyio
async def test_async_lease_rides_out_a_pause_shorter_than_the_budget(gateway_process: GatewayProcess) -> None:
    async with fencegate.AsyncGateway(gateway_process.url, holder="node-a") as gateway:
        lease = gateway.lease("sweeper", ttl=TTL)
        assert await lease.acquire(blocking=False)
        acquired = time.monotonic()
        first_deadline = acquired + lease.remaining()

        await asyncio.sleep(max(0.0, acquired + PAUSE_AT - time.monotonic()))
        gateway_process.pause()
        await asyncio.sleep(SHORT_PAUSE)
        gateway_process.resume()

        await asyncio.sleep(max(0.0, first_deadline + TIMING.renew_every / 2 - time.monotonic()))
        assert not lease.lost.is_set(), f"the term ended: {lease.reason}"
        assert (await lease.put("after-the-pause", b"still leading")).token == lease.token
        await lease.release()
        assert lease.reason is LostReason.RELEASED
