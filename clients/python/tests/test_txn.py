"""Transactions over several resources (``POST /v1/txn``), on both backends: all or
nothing, with every stale resource named."""

from __future__ import annotations

import pytest

import fencegate
from fencegate import TxnAdvance, TxnCheck, TxnDelete, TxnPut

from conftest import GatewayFactory


def read(gateway: fencegate.Gateway, resource: str, key: str) -> tuple[bytes, int] | None:
    stored = gateway.get(resource, key)
    return None if stored is None else (stored.value, stored.version)


def test_a_transaction_applies_every_operation(gateway: fencegate.Gateway) -> None:
    gateway.put("shard-7", "owner", b"node-a", token=12)
    gateway.put("shard-7", "handoff", b"pending", token=12)
    gateway.put("cluster-config", "layout", b"v1", token=5)

    outcome = gateway.txn(
        [
            TxnPut("shard-7", "owner", "node-b", token=12, if_match=1),
            TxnDelete("shard-7", "handoff", token=12, if_match="*"),
            TxnAdvance("queue-7", token=30),
            TxnCheck("cluster-config", token=5, key="layout", version=1),
            TxnPut("shard-7", "bytes", b"\x00\xff binary", token=12, if_match=0),
            TxnCheck("cluster-config", token=5),
        ]
    )
    assert not outcome.replayed
    assert list(outcome.results) == [
        fencegate.TxnResult("put", "shard-7", 12, key="owner", version=2),
        fencegate.TxnResult("delete", "shard-7", 12, key="handoff", version=2),
        fencegate.TxnResult("advance", "queue-7", 30),
        fencegate.TxnResult("check", "cluster-config", 5, key="layout", version=1),
        fencegate.TxnResult("put", "shard-7", 12, key="bytes", version=1, created=True),
        fencegate.TxnResult("check", "cluster-config", 5),
    ]
    assert read(gateway, "shard-7", "owner") == (b"node-b", 2)
    assert read(gateway, "shard-7", "handoff") is None
    assert read(gateway, "shard-7", "bytes") == (b"\x00\xff binary", 1)
    assert gateway.fence("queue-7").highest == 30
    assert gateway.fence("cluster-config").highest == 5, "a check raises nothing"
    with pytest.raises(fencegate.StaleToken):
        gateway.advance("queue-7", token=29)


def test_a_stale_transaction_names_every_stale_resource_and_applies_nothing(gateway: fencegate.Gateway) -> None:
    gateway.put("alpha", "k", b"before", token=3)
    gateway.advance("beta", token=8)
    gateway.advance("gamma", token=9)
    operations: list[fencegate.TxnOp] = [
        TxnPut("alpha", "k", "after", token=3),
        TxnAdvance("delta", token=4),
        TxnPut("gamma", "k", "late", token=2),
        TxnCheck("beta", token=7),
    ]
    with pytest.raises(fencegate.StaleToken) as refused:
        gateway.txn(operations)
    stale = refused.value
    assert stale.status == 409 and not isinstance(stale, fencegate.TransientError)
    assert sorted(stale.stale, key=lambda item: item.resource) == [
        fencegate.StaleResource("beta", 7, 8),
        fencegate.StaleResource("gamma", 2, 9),
    ]
    assert (stale.resource, stale.presented, stale.highest) == (
        stale.stale[0].resource,
        stale.stale[0].presented,
        stale.stale[0].highest,
    )
    assert read(gateway, "alpha", "k") == (b"before", 1), "nothing of a refused transaction is applied"
    assert read(gateway, "gamma", "k") is None
    assert gateway.fence("delta").highest is None
    assert (gateway.fence("alpha").highest, gateway.fence("beta").highest) == (3, 8)


def test_a_failed_precondition_names_its_operation_and_applies_nothing(gateway: fencegate.Gateway) -> None:
    gateway.put("jobs", "j-1", b"queued", token=2)
    with pytest.raises(fencegate.VersionMismatch) as mismatch:
        gateway.txn(
            [
                TxnAdvance("queue", token=2),
                TxnPut("jobs", "j-2", "new", token=2, if_match=0),
                TxnPut("jobs", "j-1", "running", token=2, if_match=7),
                TxnCheck("config", token=1, key="limits", version=1),
            ]
        )
    assert (mismatch.value.status, mismatch.value.operation, mismatch.value.current) == (412, 2, 1)
    assert read(gateway, "jobs", "j-1") == (b"queued", 1)
    assert read(gateway, "jobs", "j-2") is None
    assert gateway.fence("queue").highest is None

    with pytest.raises(fencegate.VersionMismatch) as missing:
        gateway.txn([TxnCheck("config", token=1, key="limits", version=1)])
    assert (missing.value.operation, missing.value.current) == (0, None)


def test_what_is_not_a_transaction_is_refused_before_anything_runs(gateway: fencegate.Gateway) -> None:
    with pytest.raises(fencegate.InvalidTransaction) as twice:
        gateway.txn([TxnAdvance("a", token=1), TxnPut("b", "k", "v", token=1), TxnDelete("b", "k", token=1)])
    assert (twice.value.status, twice.value.operation) == (400, 2)
    with pytest.raises(fencegate.InvalidTransaction) as two_tokens:
        gateway.txn([TxnAdvance("a", token=1), TxnAdvance("a", token=2)])
    assert two_tokens.value.status == 400
    with pytest.raises(fencegate.InvalidTransaction):
        gateway.txn([])
    assert gateway.fence("a").highest is None and gateway.get("b", "k") is None
    with pytest.raises(ValueError, match="fencing token"):
        gateway.txn([TxnAdvance("a", token=0)])
    with pytest.raises(ValueError, match="both key and version"):
        gateway.txn([TxnCheck("a", token=1, key="k")])
    with pytest.raises(TypeError):
        gateway.txn([("put", "a", "k")])  # type: ignore[list-item]


def test_too_many_operations(gateways: GatewayFactory) -> None:
    process = gateways.start("--txn-max-operations", "2")
    with fencegate.Gateway(process.url) as gateway:
        with pytest.raises(fencegate.TooManyOperations) as refused:
            gateway.txn([TxnAdvance(f"r{i}", token=1) for i in range(3)])
        assert (refused.value.status, refused.value.limit) == (400, 2)
        assert len(gateway.txn([TxnAdvance(f"r{i}", token=1) for i in range(2)]).results) == 2


def test_a_keyed_transaction_is_applied_once(gateway: fencegate.Gateway) -> None:
    operations: list[fencegate.TxnOp] = [
        TxnPut("ledger", "entry-1", "debit 10", token=1, if_match=0),
        TxnAdvance("audit", token=1),
    ]
    first = gateway.txn(operations, idempotency_key="move-entry-1")
    again = gateway.txn(operations, idempotency_key="move-entry-1")
    assert (first.replayed, again.replayed) == (False, True)
    assert first.results == again.results
    assert read(gateway, "ledger", "entry-1") == (b"debit 10", 1)
    with pytest.raises(fencegate.IdempotencyKeyReused):
        gateway.txn(operations[:1], idempotency_key="move-entry-1")


def test_a_stale_transaction_ends_the_terms_it_names(gateway: fencegate.Gateway) -> None:
    shard = gateway.lease("shard-7", holder="node-b", ttl=30)
    queue = gateway.lease("queue-7", holder="node-b", ttl=30)
    assert shard.acquire(blocking=False) and queue.acquire(blocking=False)
    try:
        done = gateway.txn(
            [TxnPut("shard-7", "owner", "node-b", token=shard.token), TxnAdvance("queue-7", token=queue.token)],
            leases=[shard, queue],
        )
        assert [result.token for result in done.results] == [shard.token, queue.token]

        gateway.advance("queue-7", token=queue.token + 1)  # a newer term of the queue
        with pytest.raises(fencegate.StaleToken) as refused:
            gateway.txn(
                [TxnPut("shard-7", "owner", "node-c", token=shard.token), TxnAdvance("queue-7", token=queue.token)],
                leases=[shard, queue],
            )
        assert [item.resource for item in refused.value.stale] == ["queue-7"]
        assert queue.reason is fencegate.LostReason.STALE_TOKEN
        assert shard.held, "a term the refusal does not name goes on"
        with pytest.raises(fencegate.LeaseLost):
            gateway.txn([TxnPut("shard-7", "owner", "node-c", token=shard.token)], leases=[shard, queue])
        assert read(gateway, "shard-7", "owner") == (b"node-b", 1)
    finally:
        shard.release()
        queue.release()


@pytest.mark.anyio
async def test_async_transactions(gateways: GatewayFactory) -> None:
    process = gateways.start()
    async with (
        fencegate.AsyncGateway(process.url, holder="node-a") as gateway,
        gateway.lease("orders", ttl=30) as lease,
    ):
        outcome = await gateway.txn(
            [TxnPut("orders", "o-1", "paid", token=lease.token), TxnAdvance("invoices", token=lease.token)],
            leases=[lease],
        )
        assert [result.op for result in outcome.results] == ["put", "advance"]
        await gateway.advance("orders", token=lease.token + 1)
        with pytest.raises(fencegate.StaleToken) as refused:
            await gateway.txn([TxnDelete("orders", "o-1", token=lease.token)], leases=[lease])
        assert refused.value.stale == (fencegate.StaleResource("orders", lease.token, lease.token + 1),)
        assert lease.reason is fencegate.LostReason.STALE_TOKEN
