"""fenced_transaction with psycopg 3 and asyncpg, through the Postgres door and straight
to Postgres, on a table fenced with ``fencegate protect``."""

from __future__ import annotations

import re

import asyncpg
import httpx
import psycopg
import pytest

import fencegate
from fencegate import LostReason, fenced_transaction

from conftest import FencedDatabase
from harness import GatewayProcess

UPDATE_PSYCOPG = "UPDATE sweep_state SET note = %s WHERE id = 1"
UPDATE_ASYNCPG = "UPDATE sweep_state SET note = $1 WHERE id = 1"


@pytest.fixture(params=["door", "direct"])
def writer_url(request: pytest.FixtureRequest, fenced_database: FencedDatabase) -> str:
    """The writer's connection string: through the gateway's Postgres door, or straight
    to Postgres. Either way the fence is Postgres's own."""
    if request.param == "direct":
        return fenced_database.writer_url()
    door: GatewayProcess = request.getfixturevalue("door")
    assert door.pg_addr is not None
    return fenced_database.writer_url(door.pg_addr)


def stale_rejections(door: GatewayProcess) -> float:
    """What the gateway counted of the resource's stale rejections."""
    metrics = httpx.get(f"{door.url}/metrics").text
    for line in metrics.splitlines():
        if line.startswith('fencegate_stale_rejections_total{resource="sweeper"}'):
            return float(line.split()[-1])
    return 0.0


def assert_seed_refusal(error: fencegate.StaleToken) -> None:
    assert (error.resource, error.presented, error.highest, error.sqlstate) == ("sweeper", 1, 2, "ZF001")
    assert error.status is None
    assert "stale fencing token 1" in error.message
    assert error.detail.items() >= {"resource": "sweeper", "presented": "1", "highest": "2"}.items()


def test_psycopg_stale_transaction_is_refused_with_its_fields(writer_url: str, fenced_database: FencedDatabase) -> None:
    with psycopg.connect(writer_url, autocommit=True) as conn:
        with fenced_transaction(conn, "sweeper", 2) as tx:
            assert tx is conn
            conn.execute(UPDATE_PSYCOPG, ("sweep by node-b",))

        ran: list[str] = []
        with pytest.raises(fencegate.StaleToken) as refused, fenced_transaction(conn, "sweeper", 1):
            ran.append("body")
            conn.execute(UPDATE_PSYCOPG, ("late write by node-a",))
        assert ran == [], "the stale transaction failed at its fence, before any write"
        assert_seed_refusal(refused.value)
        assert isinstance(refused.value.__cause__, psycopg.Error)
        assert conn.execute("SELECT 1").fetchone() == (1,), "the connection is usable after the rollback"
    assert fenced_database.note() == "sweep by node-b"


def test_psycopg_async_stale_transaction_is_refused(writer_url: str, fenced_database: FencedDatabase) -> None:
    import asyncio

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(writer_url, autocommit=True) as conn:
            async with fenced_transaction(conn, "sweeper", 2):
                await conn.execute(UPDATE_PSYCOPG, ("sweep by node-b",))
            with pytest.raises(fencegate.StaleToken) as refused:
                async with fenced_transaction(conn, "sweeper", 1):
                    await conn.execute(UPDATE_PSYCOPG, ("late write by node-a",))
            assert_seed_refusal(refused.value)

    asyncio.run(scenario())
    assert fenced_database.note() == "sweep by node-b"


@pytest.mark.anyio
async def test_asyncpg_stale_transaction_is_refused(writer_url: str, fenced_database: FencedDatabase) -> None:
    conn = await asyncpg.connect(writer_url)
    try:
        async with fenced_transaction(conn, "sweeper", 2):
            await conn.execute(UPDATE_ASYNCPG, "sweep by node-b")
        with pytest.raises(fencegate.StaleToken) as refused:
            async with fenced_transaction(conn, "sweeper", 1):
                await conn.execute(UPDATE_ASYNCPG, "late write by node-a")
        assert_seed_refusal(refused.value)
        assert isinstance(refused.value.__cause__, asyncpg.PostgresError)
        assert not conn.is_in_transaction()
    finally:
        await conn.close()
    assert fenced_database.note() == "sweep by node-b"


def test_the_door_counts_the_refusal(door: GatewayProcess, fenced_database: FencedDatabase) -> None:
    assert door.pg_addr is not None
    with psycopg.connect(fenced_database.writer_url(door.pg_addr), autocommit=True) as conn:
        with fenced_transaction(conn, "sweeper", 2):
            conn.execute(UPDATE_PSYCOPG, ("sweep by node-b",))
        with pytest.raises(fencegate.StaleToken), fenced_transaction(conn, "sweeper", 1):
            pass
    assert stale_rejections(door) == 1


def test_other_fence_errors_and_other_errors(writer_url: str, fenced_database: FencedDatabase) -> None:
    with psycopg.connect(writer_url, autocommit=True) as conn:
        # A token for another resource opens nothing here: the fence refuses it with a ZF
        # code of its own (the role holds no such resource, or the table wants its own),
        # which is neither stale nor unissued: the generic class, with its SQLSTATE.
        with pytest.raises(fencegate.FenceError) as other, fenced_transaction(conn, "billing", 5):
            conn.execute(UPDATE_PSYCOPG, ("wrong resource",))
        assert type(other.value) is fencegate.FenceError
        assert other.value.sqlstate is not None
        assert re.fullmatch(r"ZF[0-9A-Z]{3}", other.value.sqlstate)
        assert other.value.sqlstate not in ("ZF001", "ZF005")
        assert other.value.detail.get("resource") in ("billing", "sweeper")
        assert isinstance(other.value.__cause__, psycopg.Error)
        # Errors that are not the fence's are the driver's own, untouched.
        with pytest.raises(psycopg.errors.DivisionByZero), fenced_transaction(conn, "sweeper", 3):
            conn.execute("SELECT 1 / 0")
    assert fenced_database.note() == "initial"


def test_a_token_the_issuer_never_issued(fenced_database: FencedDatabase) -> None:
    process = GatewayProcess(["--database-url", fenced_database.admin_url, "--issued-by", "gateway:sweeper"]).start()
    try:
        assert process.pg_addr is not None
        with fencegate.Gateway(process.url, holder="node-a") as gateway:
            lease = gateway.lease("sweeper", ttl=30)
            assert lease.acquire(blocking=False)
            with psycopg.connect(fenced_database.writer_url(process.pg_addr), autocommit=True) as conn:
                forged = lease.token + 5
                with pytest.raises(fencegate.TokenNotIssued) as refused, fenced_transaction(conn, "sweeper", forged):
                    conn.execute(UPDATE_PSYCOPG, ("forged",))
                error = refused.value
                assert (error.resource, error.presented, error.issued, error.sqlstate) == (
                    "sweeper",
                    forged,
                    lease.token,
                    "ZF005",
                )
                with lease.transaction(conn):
                    conn.execute(UPDATE_PSYCOPG, ("by the lease's term",))
            assert gateway.fence("sweeper").highest == lease.token, "the forged token did not move the fence"
            lease.release()
    finally:
        process.stop()
    assert fenced_database.note() == "by the lease's term"


def test_a_stale_transaction_under_a_lease_ends_its_term(door: GatewayProcess, fenced_database: FencedDatabase) -> None:
    assert door.pg_addr is not None
    with (
        fencegate.Gateway(door.url, holder="node-a") as gateway,
        psycopg.connect(fenced_database.writer_url(door.pg_addr), autocommit=True) as conn,
    ):
        lease = gateway.lease("sweeper", ttl=30)
        assert lease.acquire(blocking=False)
        with lease.transaction(conn):
            conn.execute(UPDATE_PSYCOPG, ("node-a's term",))
        gateway.advance("sweeper", token=lease.token + 1)  # a newer term, elsewhere
        with pytest.raises(fencegate.StaleToken), lease.transaction(conn):
            conn.execute(UPDATE_PSYCOPG, ("late",))
        assert lease.reason is LostReason.STALE_TOKEN
        with pytest.raises(fencegate.LeaseLost), lease.transaction(conn):
            pass
    assert fenced_database.note() == "node-a's term"


@pytest.mark.anyio
async def test_async_lease_transaction_with_asyncpg(door: GatewayProcess, fenced_database: FencedDatabase) -> None:
    assert door.pg_addr is not None
    pool = await asyncpg.create_pool(fenced_database.writer_url(door.pg_addr), min_size=1, max_size=2)
    try:
        async with fencegate.AsyncGateway(door.url, holder="node-a") as gateway:
            lease = gateway.lease("sweeper", ttl=30)
            assert await lease.acquire(blocking=False)
            async with pool.acquire() as conn, lease.transaction(conn):
                await conn.execute(UPDATE_ASYNCPG, "node-a's term")
            await gateway.advance("sweeper", token=lease.token + 1)
            with pytest.raises(fencegate.StaleToken):
                async with pool.acquire() as conn, lease.transaction(conn):
                    await conn.execute(UPDATE_ASYNCPG, "late")
            assert lease.reason is LostReason.STALE_TOKEN
    finally:
        await pool.close()
    assert fenced_database.note() == "node-a's term"


def test_fence_error_follows_wrappers_to_the_driver(fenced_database: FencedDatabase) -> None:
    with psycopg.connect(fenced_database.writer_url(), autocommit=True) as conn:
        conn.execute("SELECT fencegate.fence('sweeper', 2)")
        try:
            conn.execute("SELECT fencegate.fence('sweeper', 1)")
        except psycopg.Error as driver_error:
            wrapped = RuntimeError("an ORM's error")
            wrapped.orig = driver_error  # type: ignore[attr-defined]  # as SQLAlchemy's DBAPIError
            found = fencegate.fence_error(wrapped)
        else:
            pytest.fail("a stale fence call was accepted")
    assert isinstance(found, fencegate.StaleToken)
    assert (found.presented, found.highest) == (1, 2)
    assert fencegate.fence_error(ValueError("unrelated")) is None


def test_only_drivers_it_knows() -> None:
    with pytest.raises(TypeError, match="psycopg 3 or asyncpg"):
        fenced_transaction(object(), "sweeper", 1)  # type: ignore[call-overload]
