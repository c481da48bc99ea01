"""The HTTP API through Gateway and AsyncGateway, on both backends."""

from __future__ import annotations

import json

import pytest

import fencegate

from harness import GatewayProcess


def test_seed_timeline_two_writers(gateway: fencegate.Gateway) -> None:
    first = gateway.put("orders", "o-1", b"from 41", token=41, holder="node-a")
    assert (first.created, first.version, first.token) == (True, 1, 41)
    second = gateway.put("orders", "o-1", "from 42", token=42, holder="node-b")
    assert (second.created, second.version, second.token) == (False, 2, 42)

    with pytest.raises(fencegate.StaleToken) as refused:
        gateway.put("orders", "o-1", b"late", token=41, holder="node-a")
    stale = refused.value
    assert (stale.status, stale.resource, stale.presented, stale.highest) == (409, "orders", 41, 42)
    assert not isinstance(stale, fencegate.TransientError)

    stored = gateway.get("orders", "o-1")
    assert stored is not None
    assert (stored.value, stored.version, stored.token) == (b"from 42", 2, 42)
    assert gateway.fence("orders") == fencegate.FenceState("orders", 42)


def test_delete_is_fenced_and_a_missing_object_reads_as_none(gateway: fencegate.Gateway) -> None:
    gateway.put("orders", "a/b c%d", b"v", token=5)  # slashes, spaces and % survive the path
    assert gateway.get("orders", "a/b c%d") is not None
    with pytest.raises(fencegate.StaleToken):
        gateway.delete("orders", "a/b c%d", token=4)
    deleted = gateway.delete("orders", "a/b c%d", token=5)
    assert deleted.version == 2
    assert gateway.get("orders", "a/b c%d") is None
    assert gateway.get("orders", "never-written") is None


def test_preconditions_order_writes_inside_one_term(gateway: fencegate.Gateway) -> None:
    gateway.put("jobs", "j", b"1", token=3, if_none_match=True)
    with pytest.raises(fencegate.VersionMismatch) as exists:
        gateway.put("jobs", "j", b"again", token=3, if_none_match=True)
    assert exists.value.current == 1
    assert gateway.put("jobs", "j", b"2", token=3, if_match=1).version == 2
    with pytest.raises(fencegate.VersionMismatch) as moved:
        gateway.put("jobs", "j", b"lost update", token=3, if_match=1)
    assert moved.value.current == 2
    stored = gateway.get("jobs", "j")
    assert stored is not None
    assert stored.text() == "2"


def test_advance_shuts_out_older_terms(gateway: fencegate.Gateway) -> None:
    assert gateway.fence("billing").highest is None
    assert gateway.advance("billing", token=10).highest == 10
    with pytest.raises(fencegate.StaleToken) as refused:
        gateway.put("billing", "k", b"v", token=9)
    assert (refused.value.presented, refused.value.highest) == (9, 10)
    with pytest.raises(fencegate.StaleToken):
        gateway.advance("billing", token=9)
    assert gateway.fence("billing").highest == 10


def test_lease_steps_one_by_one(gateway: fencegate.Gateway) -> None:
    first = gateway.acquire_lease("sweeper", holder="node-a", ttl=30)
    assert (first.held, first.holder, first.token) == (True, "node-a", 1)
    assert gateway.fence("sweeper").highest == 1, "acquire raises the fence to the new token"

    with pytest.raises(fencegate.LeaseHeld) as held:
        gateway.acquire_lease("sweeper", holder="node-b", ttl=30)
    assert held.value.holder == "node-a"
    assert held.value.expires_in_ms is not None
    assert 0 < held.value.expires_in_ms <= 30_000

    renewed = gateway.renew_lease("sweeper", holder="node-a", token=1, ttl=30)
    assert (renewed.token, renewed.held) == (1, True)
    with pytest.raises(fencegate.LeaseLost):
        gateway.renew_lease("sweeper", holder="node-b", token=1, ttl=30)

    released = gateway.release_lease("sweeper", holder="node-a", token=1)
    assert not released.held
    second = gateway.acquire_lease("sweeper", holder="node-b", ttl=30)
    assert second.token == 2
    assert gateway.read_lease("sweeper").holder == "node-b"


def test_a_value_is_bytes_or_str_and_json_is_sent_as_text(gateway: fencegate.Gateway) -> None:
    document = {"invoice": "invoice-001", "reminded": True}
    for value in (document, [1, 2], 5, None):
        with pytest.raises(TypeError) as refused:
            gateway.put("orders", "o-1", value, token=1)  # type: ignore[arg-type]
        message = str(refused.value)
        assert "bytes or str" in message and type(value).__name__ in message, message
        assert "json.dumps(value)" in message, message
    with pytest.raises(TypeError, match=r"TxnPut's value is bytes or str, not dict: .*json\.dumps\(value\)"):
        gateway.txn([fencegate.TxnPut("orders", "o-1", document, token=1)])  # type: ignore[arg-type]
    assert gateway.fence("orders").highest is None, "nothing was sent"

    # What the message says to do works.
    gateway.put("orders", "o-1", json.dumps(document), token=1)
    stored = gateway.get("orders", "o-1")
    assert stored is not None and json.loads(stored.value) == document


def test_holder_is_required_for_leases() -> None:
    with fencegate.Gateway("http://127.0.0.1:9") as gateway, pytest.raises(ValueError, match="holder"):
        gateway.lease("sweeper")


@pytest.mark.anyio
async def test_async_gateway_seed_timeline(gateway_process: GatewayProcess) -> None:
    async with fencegate.AsyncGateway(gateway_process.url, holder="node-b") as gateway:
        await gateway.put("orders", "o-1", b"from 41", token=41)
        await gateway.put("orders", "o-1", b"from 42", token=42)
        with pytest.raises(fencegate.StaleToken) as refused:
            await gateway.put("orders", "o-1", b"late", token=41)
        assert (refused.value.presented, refused.value.highest) == (41, 42)
        stored = await gateway.get("orders", "o-1")
        assert stored is not None
        assert stored.value == b"from 42"
        assert (await gateway.fence("orders")).highest == 42
        lease = await gateway.acquire_lease("orders", ttl=10)
        assert lease.token == 43, "a hosted lease's token is above the fence"
        assert await gateway.ready()


def test_sql_needs_postgres_with_sql_enabled(gateway: fencegate.Gateway, backend: str) -> None:
    expected = fencegate.NotSupportedByBackend if backend == "embedded" else fencegate.SqlDisabled
    with pytest.raises(expected):
        gateway.sql("sweeper", ["SELECT 1"], token=1)
