"""Idempotency keys and retries: every write keyed, resent with its key on the answers
that decide nothing, and applied once."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Callable

import pytest

import fencegate

from harness import CUT, GatewayProcess, Hop, ScriptedGateway

FAST = fencegate.RetryPolicy(attempts=6, backoff=0.01, max_backoff=0.05)

Answer = tuple[int, dict[str, object], dict[str, str]]
"""A scripted answer: status, JSON fields, headers."""


def unavailable(applied: bool | None) -> Answer:
    return 503, {"error": "backend_unavailable", "write_applied": applied}, {}


CREATED: Answer = (201, {"resource": "orders", "key": "o-1", "token": 1, "version": 1}, {})


@pytest.fixture
def scripted() -> Iterator[Callable[..., ScriptedGateway]]:
    servers: list[ScriptedGateway] = []

    def start(*script: Answer | None) -> ScriptedGateway:
        server = ScriptedGateway(script)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


# ---------------------------------------------------------------- against the gateway


def test_the_same_key_twice_is_applied_once_and_replayed(gateway: fencegate.Gateway) -> None:
    key = str(uuid.uuid4())
    first = gateway.put("orders", "o-1", b"paid", token=1, idempotency_key=key)
    assert (first.created, first.version, first.replayed) == (True, 1, False)
    again = gateway.put("orders", "o-1", b"paid", token=1, idempotency_key=key)
    assert (again.created, again.version, again.replayed) == (True, 1, True), "the stored 201, not a second write"
    stored = gateway.get("orders", "o-1")
    assert stored is not None and stored.version == 1

    advanced = gateway.advance("orders", token=2, idempotency_key=f"{key}-advance")
    replayed = gateway.advance("orders", token=2, idempotency_key=f"{key}-advance")
    assert (advanced.replayed, replayed.replayed, replayed.highest) == (False, True, 2)
    deleted = gateway.delete("orders", "o-1", token=2, idempotency_key=f"{key}-delete")
    assert gateway.delete("orders", "o-1", token=2, idempotency_key=f"{key}-delete") == fencegate.WriteResult(
        deleted.resource, deleted.key, deleted.token, deleted.version, deleted.created, replayed=True
    )


def test_a_key_is_kept_across_clients_as_across_restarts(gateway_process: GatewayProcess) -> None:
    """A writer that persisted its key resends the write from a new process: the
    gateway answers with the first attempt's outcome, even after a newer term wrote."""
    key = "order-o-1-paid"
    with fencegate.Gateway(gateway_process.url) as first:
        assert first.put("orders", "o-1", b"paid", token=1, idempotency_key=key).version == 1
        first.put("orders", "o-1", b"by the next term", token=2)
    with fencegate.Gateway(gateway_process.url) as restarted:
        again = restarted.put("orders", "o-1", b"paid", token=1, idempotency_key=key)
        assert (again.version, again.token, again.replayed) == (1, 1, True)
        stored = restarted.get("orders", "o-1")
        assert stored is not None and (stored.text(), stored.version) == ("by the next term", 2)


def test_a_key_reused_for_another_write_is_refused(gateway: fencegate.Gateway) -> None:
    gateway.put("orders", "o-1", b"paid", token=1, idempotency_key="k-1")
    with pytest.raises(fencegate.IdempotencyKeyReused) as reused:
        gateway.put("orders", "o-1", b"refunded", token=1, idempotency_key="k-1")
    assert reused.value.status == 422
    assert not isinstance(reused.value, fencegate.TransientError)
    stored = gateway.get("orders", "o-1")
    assert stored is not None and (stored.value, stored.version) == (b"paid", 1)
    with pytest.raises(ValueError, match="Idempotency-Key"):
        gateway.put("orders", "o-1", b"v", token=1, idempotency_key="not\nascii")


def test_every_write_gets_a_key_of_its_own(gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]) -> None:
    hop = make_hop(gateway_process.addr)
    with fencegate.Gateway(hop.url, holder="node-a") as gateway:
        gateway.put("orders", "o-1", b"v", token=1)
        gateway.put("orders", "o-1", b"v", token=1)  # the same write again: a new logical write
        gateway.delete("orders", "o-1", token=1)
        gateway.advance("orders", token=2)
        gateway.txn([fencegate.TxnPut("orders", "o-2", "v", token=2)])
        state = gateway.acquire_lease("sweeper", ttl=10)
        assert state.token is not None
        gateway.renew_lease("sweeper", token=state.token, ttl=10)
        gateway.release_lease("sweeper", token=state.token)
        gateway.get("orders", "o-2")
        gateway.fence("orders")
    keys = [
        line.split(b":", 1)[1].strip()
        for line in hop.sent().lower().split(b"\r\n")
        if line.startswith(b"idempotency-key:")
    ]
    assert len(keys) == 8, "one key per write, none on reads"
    assert len(set(keys)) == 8, "a key was used for two writes"
    for key in keys:
        uuid.UUID(key.decode())


def test_an_answer_lost_after_the_commit_is_resent_with_its_key_and_replayed(
    gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]
) -> None:
    hop = make_hop(gateway_process.addr)
    with fencegate.Gateway(hop.url, retry=FAST) as gateway:
        hop.lose_answers(1)
        result = gateway.put("orders", "o-1", b"paid", token=1)
        assert hop.lost == 1
        assert (result.version, result.created, result.replayed) == (1, True, True)
        keys = [line for line in hop.sent().lower().split(b"\r\n") if line.startswith(b"idempotency-key:")]
        assert len(keys) == 2 and keys[0] == keys[1], "the retry did not carry the first attempt's key"

        hop.lose_answers(2)
        outcome = gateway.txn([fencegate.TxnPut("orders", "o-1", "shipped", token=1, if_match=1)])
        assert hop.lost == 3
        assert outcome.replayed and outcome.results[0].version == 2, "applied once, whatever the retries"
        stored = gateway.get("orders", "o-1")
        assert stored is not None and (stored.text(), stored.version) == ("shipped", 2)


@pytest.mark.anyio
async def test_async_retries_replay_too(gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]) -> None:
    hop = make_hop(gateway_process.addr)
    async with fencegate.AsyncGateway(hop.url, retry=FAST) as gateway:
        hop.lose_answers(1)
        result = await gateway.put("orders", "o-1", b"paid", token=1)
        assert (hop.lost, result.version, result.replayed) == (1, 1, True)
        async with gateway.lease("orders", holder="node-a", ttl=10) as lease:
            hop.lose_answers(1)
            written = await lease.put("o-1", b"under the lease")
            assert (hop.lost, written.version, written.replayed) == (2, 2, True)


def test_a_lease_resends_only_while_its_term_lasts(
    gateway_process: GatewayProcess, make_hop: Callable[[str], Hop]
) -> None:
    hop = make_hop(gateway_process.addr)
    patient = fencegate.RetryPolicy(attempts=1000, backoff=0.05, max_backoff=0.05)
    with fencegate.Gateway(hop.url, holder="node-a", retry=patient, timeout=1) as gateway:
        lease = gateway.lease("sweeper", ttl=1.5)
        assert lease.acquire(blocking=False)
        hop.lose_answers(1_000_000)  # renewals and writes: nothing comes back any more
        began = time.monotonic()
        with pytest.raises(fencegate.LeaseLost) as over:
            lease.put("k", b"v")
        assert time.monotonic() - began < 1.5, "resent past the term's deadline"
        assert isinstance(over.value.__cause__, fencegate.GatewayUnreachable)
        assert over.value.__cause__.write_applied is None
        assert lease.reason is fencegate.LostReason.DEADLINE
        hop.lose_answers(0)
        lease.release()


# ---------------------------------------------------------------- what is resent


def test_the_answers_that_decide_nothing_are_resent_with_the_same_key(
    scripted: Callable[..., ScriptedGateway],
) -> None:
    server = scripted(
        CUT,
        unavailable(None),
        unavailable(False),
        (503, {"error": "overloaded"}, {"Retry-After": "0"}),
        (503, {"error": "shutting_down"}, {"Retry-After": "0"}),
        (409, {"error": "idempotency_in_flight"}, {"Retry-After": "0"}),
        CREATED,
    )
    with fencegate.Gateway(server.url, retry=fencegate.RetryPolicy(attempts=7, backoff=0.01)) as gateway:
        result = gateway.put("orders", "o-1", b"v", token=1)
    assert (result.version, result.created) == (1, True)
    server.assert_done()
    keys = server.keys()
    assert len(keys) == 7 and len(set(keys)) == 1 and keys[0] is not None


def test_a_stale_token_is_never_resent(scripted: Callable[..., ScriptedGateway]) -> None:
    server = scripted(
        unavailable(None),
        (
            409,
            {
                "error": "stale_token",
                "resource": "orders",
                "presented": 1,
                "highest": 2,
                "stale": [{"resource": "orders", "presented": 1, "highest": 2}],
            },
            {},
        ),
    )
    with fencegate.Gateway(server.url, retry=FAST) as gateway, pytest.raises(fencegate.StaleToken) as stale:
        gateway.put("orders", "o-1", b"v", token=1)
    server.assert_done()
    assert len(server.requests) == 2
    assert stale.value.stale == (fencegate.StaleResource("orders", 1, 2),)


@pytest.mark.parametrize(
    ("answer", "raised"),
    [
        ((422, {"error": "idempotency_key_reused"}, {}), fencegate.IdempotencyKeyReused),
        ((412, {"error": "version_mismatch", "current": 3}, {}), fencegate.VersionMismatch),
        ((408, {"error": "body_timeout"}, {}), fencegate.BodyTimeout),
        ((400, {"error": "invalid_idempotency_key"}, {}), fencegate.InvalidIdempotencyKey),
        ((500, {"error": "internal"}, {}), fencegate.Internal),
    ],
)
def test_a_decided_answer_is_the_writes_own(
    scripted: Callable[..., ScriptedGateway],
    answer: Answer,
    raised: type[fencegate.FencegateError],
) -> None:
    server = scripted(answer)
    with fencegate.Gateway(server.url, retry=FAST) as gateway, pytest.raises(raised):
        gateway.put("orders", "o-1", b"v", token=1)
    server.assert_done()


def test_attempts_are_bounded_and_the_last_error_keeps_the_doubt(scripted: Callable[..., ScriptedGateway]) -> None:
    server = scripted(unavailable(None), unavailable(False), unavailable(False))
    retry = fencegate.RetryPolicy(attempts=3, backoff=0.01)
    with fencegate.Gateway(server.url, retry=retry) as gateway, pytest.raises(fencegate.BackendUnavailable) as down:
        gateway.put("orders", "o-1", b"v", token=1)
    server.assert_done()
    assert down.value.attempts == 3
    assert down.value.write_applied is None, "the first attempt may have been applied"
    assert len(set(server.keys())) == 1


def test_no_retry_sends_once_and_reads_are_never_resent(scripted: Callable[..., ScriptedGateway]) -> None:
    server = scripted(unavailable(False), unavailable(False))
    with fencegate.Gateway(server.url, retry=fencegate.NO_RETRY) as gateway:
        with pytest.raises(fencegate.BackendUnavailable) as down:
            gateway.put("orders", "o-1", b"v", token=1, idempotency_key="mine")
        assert (down.value.attempts, down.value.write_applied) == (1, False)
    with fencegate.Gateway(server.url, retry=FAST) as gateway, pytest.raises(fencegate.BackendUnavailable):
        gateway.fence("orders")
    server.assert_done()
    assert server.keys() == ["mine", None]


@pytest.mark.anyio
async def test_async_resends_the_same_way(scripted: Callable[..., ScriptedGateway]) -> None:
    server = scripted(CUT, (409, {"error": "idempotency_in_flight"}, {"Retry-After": "0"}), CREATED)
    async with fencegate.AsyncGateway(server.url, retry=FAST) as gateway:
        assert (await gateway.put("orders", "o-1", b"v", token=1, idempotency_key="k-9")).version == 1
    server.assert_done()
    assert server.keys() == ["k-9", "k-9", "k-9"]


def test_retry_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="attempts"):
        fencegate.RetryPolicy(attempts=0)
    with pytest.raises(ValueError, match="backoff"):
        fencegate.RetryPolicy(backoff=3.0, max_backoff=1.0)
    with pytest.raises(TypeError):
        fencegate.Gateway("http://127.0.0.1:9", retry=3)  # type: ignore[arg-type]
