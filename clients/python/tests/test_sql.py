"""Fenced SQL transactions over HTTP (``POST /v1/sql``), as the writer's login."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import fencegate
from fencegate import LostReason, Statement

from conftest import FencedDatabase
from harness import GatewayProcess


@pytest.fixture
def sql_gateway(fenced_database: FencedDatabase) -> Iterator[fencegate.Gateway]:
    process = GatewayProcess(
        ["--database-url", fenced_database.admin_url, "--sql", "--sql-database-url", fenced_database.sql_url]
    ).start()
    try:
        with fencegate.Gateway(process.url, holder="node-b") as gateway:
            yield gateway
    finally:
        process.stop()


def test_statements_run_after_the_fence_in_one_transaction(
    sql_gateway: fencegate.Gateway, fenced_database: FencedDatabase
) -> None:
    outcome = sql_gateway.sql(
        "sweeper",
        [
            ("UPDATE sweep_state SET note = $1 WHERE id = 1", ["sweep by node-b"]),
            Statement("SELECT id, note FROM sweep_state WHERE id = $1", [1]),
        ],
        token=2,
        idempotency_key="sweep-2",
    )
    assert (outcome.resource, outcome.token) == ("sweeper", 2)
    update, select = outcome.results
    assert update.rows_affected == 1
    assert [column.name for column in select.columns] == ["id", "note"]
    assert [list(row) for row in select.rows] == [[1, "sweep by node-b"]]
    assert not outcome.replayed
    again = sql_gateway.sql(
        "sweeper",
        [
            ("UPDATE sweep_state SET note = $1 WHERE id = 1", ["sweep by node-b"]),
            Statement("SELECT id, note FROM sweep_state WHERE id = $1", [1]),
        ],
        token=2,
        idempotency_key="sweep-2",
    )
    assert again.replayed and again.results == outcome.results, "the stored answer, not a second run"

    with pytest.raises(fencegate.StaleToken) as refused:
        sql_gateway.sql("sweeper", [("UPDATE sweep_state SET note = $1 WHERE id = 1", ["late"])], token=1)
    assert (refused.value.presented, refused.value.highest) == (1, 2)

    with pytest.raises(fencegate.SqlError) as failed:
        sql_gateway.sql("sweeper", ["UPDATE sweep_state SET note = 'half' WHERE id = 1", "SELECT 1 / 0"], token=2)
    assert (failed.value.statement, failed.value.sqlstate, failed.value.status) == (1, "22012", 400)
    assert fenced_database.note() == "sweep by node-b", "nothing of a refused transaction was applied"


def test_sql_under_a_lease(sql_gateway: fencegate.Gateway, fenced_database: FencedDatabase) -> None:
    lease = sql_gateway.lease("sweeper", ttl=30)
    assert lease.acquire(blocking=False)
    lease.sql([("UPDATE sweep_state SET note = $1 WHERE id = 1", ["by the lease"])])
    sql_gateway.advance("sweeper", token=lease.token + 1)
    with pytest.raises(fencegate.StaleToken):
        lease.sql(["UPDATE sweep_state SET note = 'late' WHERE id = 1"])
    assert lease.reason is LostReason.STALE_TOKEN
    assert fenced_database.note() == "by the lease"
