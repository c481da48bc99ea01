"""A gateway or a database that is down: transient errors, never a false ``lost``."""

from __future__ import annotations

import socket
import time

import psycopg
import pytest
from psycopg import sql

import fencegate
from fencegate import LostReason

from conftest import FencedDatabase, admin_url
from harness import GatewayProcess, eventually


def closed_port() -> int:
    """A port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def test_no_gateway_is_a_transient_error_and_nothing_was_applied() -> None:
    with (
        fencegate.Gateway(f"http://127.0.0.1:{closed_port()}", timeout=2) as gateway,
        pytest.raises(fencegate.GatewayUnreachable) as down,
    ):
        gateway.put("orders", "o-1", b"v", token=1)
    error = down.value
    assert isinstance(error, fencegate.TransientError)
    assert not isinstance(error, fencegate.FenceError)
    assert error.write_applied is False, "the connection was refused: nothing was sent"
    assert error.status is None


def test_ready_is_false_while_the_gateway_cannot_answer(gateway_process: GatewayProcess) -> None:
    with fencegate.Gateway(gateway_process.url, timeout=0.5) as gateway:
        assert gateway.ready()
        gateway_process.pause()
        try:
            started = time.monotonic()
            assert not gateway.ready(), "a paused gateway is not ready"
            assert time.monotonic() - started < 2, "ready() waited past the gateway's timeout"
            assert not gateway.ready(timeout=0.1)
        finally:
            gateway_process.resume()
        assert gateway.ready()
        gateway_process.stop()
        assert not gateway.ready(), "a stopped gateway is not ready"
    with fencegate.Gateway(f"http://127.0.0.1:{closed_port()}") as nobody:
        assert not nobody.ready()
    # A mistake in the code is no "not ready".
    with pytest.raises(ValueError, match="http:// or https://"):
        fencegate.Gateway("ftp://127.0.0.1:7070")


@pytest.mark.anyio
async def test_async_ready_is_false_while_the_gateway_cannot_answer(gateway_process: GatewayProcess) -> None:
    async with fencegate.AsyncGateway(gateway_process.url, timeout=0.5) as gateway:
        assert await gateway.ready()
        gateway_process.pause()
        try:
            assert not await gateway.ready()
        finally:
            gateway_process.resume()
        assert await gateway.ready()
        gateway_process.stop()
        assert not await gateway.ready()


def test_a_hung_gateway_leaves_the_write_in_doubt(gateway_process: GatewayProcess) -> None:
    with fencegate.Gateway(gateway_process.url, timeout=0.3) as gateway:
        gateway.put("orders", "o-1", b"v", token=1)  # the connection is open now
        gateway_process.pause()
        try:
            with pytest.raises(fencegate.GatewayUnreachable) as hung:
                gateway.put("orders", "o-1", b"v2", token=1)
        finally:
            gateway_process.resume()
        assert hung.value.write_applied is None, "sent and unanswered: it may have been applied"


def test_a_lease_rides_out_a_gateway_restart_without_a_false_lost(gateway_process: GatewayProcess) -> None:
    ttl = 3.0  # renewals every 1 s, step-down 2.6 s after the last renewal that got through
    with fencegate.Gateway(gateway_process.url, holder="node-a", timeout=1) as gateway:
        with gateway.lease("sweeper", ttl=ttl) as lease:
            token = lease.token
            gateway_process.kill()
            down_at = time.monotonic()
            with pytest.raises(fencegate.GatewayUnreachable):
                lease.put("k", b"while down")
            assert not lease.lost.is_set(), "a gateway that is down is no reason to stop"
            time.sleep(max(0.0, down_at + 1.2 - time.monotonic()))  # at least one renewal fails meanwhile
            assert not lease.lost.is_set()
            gateway_process.start(listen=gateway_process.addr)
            # Past the deadline the term would have had without a renewal after the crash.
            time.sleep(max(0.0, down_at + ttl - time.monotonic()))
            assert not lease.lost.is_set() and lease.held
            assert lease.put("k", b"after the restart").token == token
            assert gateway.read_lease("sweeper").token == token
        assert lease.reason is LostReason.RELEASED


def test_a_lease_steps_down_when_the_gateway_stays_down(gateway_process: GatewayProcess) -> None:
    ttl = 1.5
    with fencegate.Gateway(gateway_process.url, holder="node-a", timeout=1) as gateway:
        lease = gateway.lease("sweeper", ttl=ttl)
        assert lease.acquire(blocking=False)
        gateway_process.kill()
        killed = time.monotonic()
        assert lease.lost.wait(ttl * 2)
        assert lease.reason is LostReason.DEADLINE
        assert time.monotonic() - killed < ttl, "it stepped down after the lease could have passed"
        with pytest.raises(fencegate.LeaseLost):
            lease.put("k", b"v")
        lease.release()  # the gateway is gone: a release that fails is no error


def test_a_database_that_goes_away_is_backend_unavailable(fenced_database: FencedDatabase) -> None:
    process = GatewayProcess(["--database-url", fenced_database.admin_url, "--backend-timeout", "1s"]).start()
    try:
        backend_goes_away(process, fenced_database)
    finally:
        process.stop()


def backend_goes_away(process: GatewayProcess, fenced_database: FencedDatabase) -> None:
    # Sent once: each attempt waits out --backend-timeout, and resending would outlast
    # the term, which is what this test watches.
    with fencegate.Gateway(process.url, holder="node-a", retry=fencegate.NO_RETRY) as gateway:
        lease = gateway.lease("sweeper", ttl=3)
        assert lease.acquire(blocking=False)
        lease.put("k", b"v")
        with psycopg.connect(admin_url(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE {} WITH (FORCE)").format(sql.Identifier(fenced_database.name)))
        with pytest.raises(fencegate.BackendUnavailable) as unavailable:
            lease.put("k", b"v2")
        error = unavailable.value
        assert error.status == 503
        assert isinstance(error, fencegate.TransientError) and not isinstance(error, fencegate.FenceError)
        assert error.write_applied in (False, None)
        assert not lease.lost.is_set(), "a database that is down is no reason to stop yet"
        assert not gateway.ready()
        eventually(lambda: lease.lost.is_set(), timeout=4)
        assert lease.reason is LostReason.DEADLINE
