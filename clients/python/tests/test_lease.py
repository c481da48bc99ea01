"""Lease and AsyncLease against the real gateway, with a TTL of one second."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Callable

import pytest

import fencegate
from fencegate import LostReason

from harness import GatewayProcess, Hop, eventually

TTL = 1.0


def test_a_held_lease_renews_and_keeps_its_token(gateway: fencegate.Gateway) -> None:
    with gateway.lease("sweeper", holder="node-a", ttl=TTL) as lease:
        token = lease.token
        # Three TTLs: without renewals the lease would have passed twice over.
        for _ in range(6):
            time.sleep(TTL / 2)
            assert lease.held and not lease.lost.is_set()
            state = gateway.read_lease("sweeper")
            assert (state.held, state.holder, state.token) == (True, "node-a", token)
            with pytest.raises(fencegate.LeaseHeld):
                gateway.acquire_lease("sweeper", holder="node-b", ttl=TTL)
        assert lease.put("k", b"v").token == token
    assert lease.reason is LostReason.RELEASED
    # Released on the way out: a rival takes over at once, with the next token.
    rival = gateway.acquire_lease("sweeper", holder="node-b", ttl=TTL)
    assert rival.token == token + 1


def test_seed_timeline_a_paused_leader_is_refused_and_loses_its_term(
    gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]
) -> None:
    """t0 A holds the lease; t1 A's write is delayed; t2 A's lease passes; t3 B acquires;
    t4 B writes; t5 A's delayed write arrives and is refused."""
    hop = make_hop(gateway_process.addr)
    gateway_a = fencegate.Gateway(hop.url, holder="node-a", timeout=10)
    gateway_b = fencegate.Gateway(gateway_process.url, holder="node-b")
    ended: list[LostReason] = []
    a = gateway_a.lease("sweeper", ttl=TTL)
    assert a.acquire(blocking=False)
    a.on_lost(ended.append)
    a.put("state", b"from A, before the pause")

    hop.hold()  # A freezes: its renewals and its next write sit in the network
    acquired_at = time.monotonic()
    late_write: list[BaseException] = []

    def write_late() -> None:
        try:
            a.put("state", b"from A, late")
        except fencegate.FencegateError as error:
            late_write.append(error)

    writer = threading.Thread(target=write_late)
    writer.start()

    b = gateway_b.lease("sweeper", ttl=TTL)
    assert b.acquire(timeout=5), "B never got the lease"
    took_over = time.monotonic() - acquired_at
    assert a.lost.is_set(), "A had not stepped down when B took over"
    assert a.reason is LostReason.DEADLINE
    assert b.token == a.token + 1
    assert took_over < TTL * 3
    b.put("state", b"from B")

    hop.release()  # t5: A's delayed write arrives
    writer.join(10)
    assert len(late_write) == 1 and isinstance(late_write[0], fencegate.StaleToken)
    refused = late_write[0]
    assert (refused.resource, refused.presented, refused.highest) == ("sweeper", a.token, b.token)
    assert ended == [LostReason.DEADLINE]

    stored = gateway_b.get("sweeper", "state")
    assert stored is not None
    assert (stored.value, stored.token) == (b"from B", b.token)
    with pytest.raises(fencegate.LeaseLost):
        a.put("state", b"after the end")  # refused here, never sent
    b.release()
    gateway_a.close()
    gateway_b.close()


def test_a_stale_rejection_ends_the_term_at_once(gateway: fencegate.Gateway) -> None:
    lease = gateway.lease("sweeper", holder="node-a", ttl=30)
    assert lease.acquire(blocking=False)
    reasons: list[LostReason] = []
    lease.on_lost(reasons.append)
    # A newer term, elected elsewhere, raises the fence.
    gateway.advance("sweeper", token=lease.token + 1)
    with pytest.raises(fencegate.StaleToken) as refused:
        lease.put("k", b"v")
    assert refused.value.highest == lease.token + 1
    assert lease.lost.is_set() and reasons == [LostReason.STALE_TOKEN]
    assert lease.remaining() == 0 and not lease.held
    with pytest.raises(fencegate.LeaseLost) as after:
        lease.put("k", b"v")
    assert after.value.status is None, "nothing is sent after the term ended"
    late: list[LostReason] = []
    lease.on_lost(late.append)  # registered after the end: called at once
    assert late == [LostReason.STALE_TOKEN]
    lease.release()


def test_lease_lost_from_a_renewal_ends_the_term(gateway: fencegate.Gateway) -> None:
    first = gateway.lease("sweeper", holder="node-a", ttl=TTL)
    assert first.acquire(blocking=False)
    # The same holder name acquires again (a restarted process): a new term.
    second = gateway.lease("sweeper", holder="node-a", ttl=TTL)
    assert second.acquire(blocking=False)
    assert second.token == first.token + 1
    assert first.lost.wait(TTL), "the old term's renewal was not refused"
    assert first.reason is LostReason.LEASE_LOST
    assert second.held
    second.release()


def test_steps_down_on_its_own_clock_before_the_lease_can_pass(
    gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]
) -> None:
    hop = make_hop(gateway_process.addr)
    with fencegate.Gateway(hop.url, holder="node-a") as gateway, fencegate.Gateway(gateway_process.url) as direct:
        lease = gateway.lease("sweeper", ttl=TTL, margin=0.5)
        sent = time.monotonic()
        assert lease.acquire(blocking=False)
        hop.hold()  # renewals stop getting through
        assert lease.lost.wait(TTL * 2)
        stepped_down = time.monotonic() - sent
        # Still held on the gateway's clock when the holder gave up.
        state = direct.read_lease("sweeper")
        assert lease.reason is LostReason.DEADLINE
        assert TTL - 0.5 - 0.05 <= stepped_down < TTL
        assert state.held and state.holder == "node-a"
        hop.release()


@pytest.mark.anyio
async def test_async_lease_renews_and_run_is_cancelled_when_the_term_ends(gateway_process: GatewayProcess) -> None:
    async with fencegate.AsyncGateway(gateway_process.url, holder="node-a") as gateway:
        lease = gateway.lease("sweeper", ttl=TTL)
        async with lease:
            token = lease.token
            await asyncio.sleep(TTL * 2)
            assert lease.held
            assert (await gateway.read_lease("sweeper")).token == token
            await lease.put("k", b"v")

            cancelled = asyncio.Event()

            async def work() -> None:
                try:
                    await asyncio.sleep(60)
                finally:
                    cancelled.set()

            async def take_over() -> None:
                await asyncio.sleep(0.1)
                await gateway.acquire_lease("sweeper", ttl=TTL)  # same holder: a new term

            started = time.monotonic()
            rival = asyncio.ensure_future(take_over())
            with pytest.raises(fencegate.LeaseLost):
                await lease.run(work())
            await rival
            assert cancelled.is_set()
            assert lease.reason is LostReason.LEASE_LOST
            assert time.monotonic() - started < TTL
        assert lease.reason is LostReason.LEASE_LOST


@pytest.mark.anyio
async def test_async_lease_stale_rejection_ends_the_term(gateway_process: GatewayProcess) -> None:
    async with fencegate.AsyncGateway(gateway_process.url, holder="node-a") as gateway:
        lease = gateway.lease("sweeper", ttl=30)
        assert await lease.acquire(blocking=False)
        reasons: list[LostReason] = []
        lease.on_lost(reasons.append)
        await gateway.advance("sweeper", token=lease.token + 1)
        with pytest.raises(fencegate.StaleToken):
            await lease.put("k", b"v")
        assert lease.lost.is_set() and reasons == [LostReason.STALE_TOKEN]
        with pytest.raises(fencegate.LeaseLost):
            await lease.put("k", b"v")
        await lease.release()


@pytest.mark.anyio
async def test_async_lease_steps_down_before_the_lease_can_pass(
    gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]
) -> None:
    hop = make_hop(gateway_process.addr)
    async with fencegate.AsyncGateway(hop.url, holder="node-a") as gateway:
        lease = gateway.lease("sweeper", ttl=TTL)
        sent = time.monotonic()
        assert await lease.acquire(blocking=False)
        hop.hold()
        await asyncio.wait_for(lease.lost.wait(), TTL * 2)
        stepped_down = time.monotonic() - sent
        assert lease.reason is LostReason.DEADLINE
        assert TTL - lease.timing.margin - 0.05 <= stepped_down < TTL
        with pytest.raises(fencegate.LeaseLost):
            await lease.put("k", b"v")
        hop.release()


def test_blocking_acquire_waits_for_the_holder_to_go(gateway: fencegate.Gateway) -> None:
    holder = gateway.lease("sweeper", holder="node-a", ttl=TTL)
    assert holder.acquire()
    follower = gateway.lease("sweeper", holder="node-b", ttl=TTL)
    assert not follower.acquire(blocking=False)
    assert not follower.acquire(timeout=0.2)
    threading.Timer(0.3, holder.release).start()
    started = time.monotonic()
    assert follower.acquire(timeout=5)
    assert time.monotonic() - started < 1.0, "the follower did not see the release"
    assert follower.token == holder.token + 1
    eventually(lambda: holder.lost.is_set())
    with pytest.raises(RuntimeError, match="one term"):
        follower.acquire()
    follower.release()
