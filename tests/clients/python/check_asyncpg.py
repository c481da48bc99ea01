#!/usr/bin/env python3
"""The fencing scenarios through asyncpg (its own protocol code), against FENCEGATE_CLIENT_DSN.

Starts from the state tests/clients/fixture.sh leaves (sweep_state row 1 'initial',
resource `sweeper` with no token yet) and moves `sweeper` through terms 42 and 43,
so it runs once per fresh fixture. Prints one line per check and `ok <n> checks`,
or `FAIL <scenario>: <what differed>` and exits 1. See ../README.md.

asyncpg sends statements with arguments as Parse/Bind/Execute (prepared, cached),
and `execute(sql)` without arguments as one simple query.
"""

import asyncio
import contextlib
import hashlib
import os
import re
import sys
import time

import asyncpg

DSN = os.environ["FENCEGATE_CLIENT_DSN"]
SCENARIO_TIMEOUT_S = 20

UPDATE = "UPDATE sweep_state SET note = $1 WHERE id = 1"
# One statement that presents its own token: with the connection's token (42) the
# trigger lets the INSERT start, and fence() then checks this row's token.
BATCH_INSERT = ("INSERT INTO sweep_state (id, note) SELECT $1::int, $2::text"
                " WHERE fencegate.fence('sweeper', $3::bigint) IS NOT NULL")
MULTI = ("BEGIN; SELECT fencegate.fence('sweeper', 42);"
         " UPDATE sweep_state SET note = 'multi-1' WHERE id = 1; COMMIT;"
         " UPDATE sweep_state SET note = 'multi-2' WHERE id = 1")
STALE_DETAIL = "resource=sweeper presented=41 highest=42"
BLOB = bytes(range(256)) * (16 * 1024 * 1024 // 256)  # 16 MiB, every byte value
TOKEN_42 = {"fencegate.token": "42"}

checks = 0


class Mismatch(Exception):
    pass


def check(name, got, want):
    global checks
    if got != want:
        raise Mismatch(f"{name}: expected {want!r}, got {got!r}")
    checks += 1
    print(f"ok {name}", flush=True)


@contextlib.asynccontextmanager
async def connect(server_settings=None):
    conn = await asyncpg.connect(DSN, timeout=10, server_settings=server_settings)
    try:
        yield conn
    finally:
        await conn.close(timeout=5)


async def error_of(awaitable):
    """Awaits; returns the asyncpg.PostgresError raised, or None."""
    try:
        await awaitable
    except asyncpg.PostgresError as e:
        return e
    return None


def check_error(name, err, sqlstate, detail=None):
    check(f"{name}: SQLSTATE", err and err.sqlstate, sqlstate)
    if detail is not None:
        fields, _, proof = (err.detail or "").partition(" proof=")
        check(f"{name}: DETAIL", fields, detail)
        check(f"{name}: DETAIL proof", bool(re.fullmatch("[0-9a-f]{64}", proof)), True)
        check(f"{name}: HINT non-empty", bool(err.hint), True)


async def note(conn):
    return await conn.fetchval("SELECT note FROM sweep_state WHERE id = 1")


def digest(data):
    """What a check prints of a large value: its length and hash."""
    return len(data), hashlib.sha256(data).hexdigest()


async def seed():
    async with connect() as b, connect() as a:
        async with b.transaction():  # node-b, term 42, literal SQL (simple query)
            await b.execute("SELECT fencegate.fence('sweeper', 42)")
            await b.execute("UPDATE sweep_state SET note = 'node-b' WHERE id = 1")

        async def node_a():  # the delayed term-41 transaction, bind parameters
            async with a.transaction():
                await a.fetchval("SELECT fencegate.fence($1, $2)", "sweeper", 41)
                await a.execute(UPDATE, "node-a")

        check_error("seed: node-a (41) after node-b (42)", await error_of(node_a()), "ZF001", STALE_DETAIL)
        check("seed: row still reads node-b", await note(a), "node-b")


async def startup_options():
    async with connect(TOKEN_42) as c:
        check("options 42: UPDATE outside a transaction", await c.execute(UPDATE, "options-42"), "UPDATE 1")
    async with connect({"fencegate.token": "41"}) as c:
        check_error("options 41: UPDATE", await error_of(c.execute(UPDATE, "options-41")), "ZF001", STALE_DETAIL)
        check("options 41: row reads options-42", await note(c), "options-42")


async def no_token():
    async with connect() as c:
        check_error("no token: UPDATE", await error_of(c.execute(UPDATE, "no-token")), "ZF002")


async def aborted_transaction():
    async with connect() as c:
        await c.execute("BEGIN")
        err = await error_of(c.fetchval("SELECT fencegate.fence($1, $2)", "sweeper", 41))
        check_error("aborted tx: stale fence()", err, "ZF001")
        check_error("aborted tx: next statement", await error_of(c.fetchval("SELECT 1")), "25P02")
        await c.execute("ROLLBACK")
        check("aborted tx: usable after ROLLBACK", await c.fetchval("SELECT 1"), 1)


async def executemany():
    async with connect(TOKEN_42) as c:
        # One Bind/Execute per row, then a single Sync: one implicit transaction.
        rows = [(10, "batch", 42), (11, "batch", 41), (12, "batch", 42)]
        check_error("executemany: stale second row", await error_of(c.executemany(BATCH_INSERT, rows)),
                    "ZF001", STALE_DETAIL)
        check("executemany: nothing landed", await c.fetchval("SELECT count(*) FROM sweep_state WHERE id >= 10"), 0)


async def multi_statement():
    async with connect() as c:
        check_error("multi-statement: UPDATE after COMMIT", await error_of(c.execute(MULTI)), "ZF002")
        check("multi-statement: part before COMMIT committed", await note(c), "multi-1")


async def copy():
    async with connect() as c:
        async with c.transaction():
            check("copy: fence term 43", await c.fetchval("SELECT fencegate.fence($1, $2)", "sweeper", 43), 43)
            await c.copy_records_to_table("sweep_state", records=[(20, "copy-20"), (21, "copy-21")])
        err = await error_of(c.copy_records_to_table("sweep_state", records=[(22, "copy-22")]))
        check_error("copy: COPY FROM without a token", err, "ZF002")
        out = bytearray()

        async def sink(chunk):
            out.extend(chunk)

        await c.copy_from_query("SELECT id, note FROM sweep_state WHERE id >= 20 ORDER BY id", output=sink)
        check("copy: COPY TO reads the rows", bytes(out), b"20\tcopy-20\n21\tcopy-21\n")


async def cancel():
    async with connect() as victim, connect() as bystander:
        beside = asyncio.create_task(bystander.fetchval("SELECT 'unaffected' FROM pg_sleep(1.5)"))
        start = time.monotonic()
        # On timeout asyncpg sends a CancelRequest and raises TimeoutError itself; the
        # server's 57014 is swallowed, but the next query waits for it, so a prompt
        # answer to that query shows the cancel reached the backend.
        try:
            await victim.fetchval("SELECT pg_sleep(10)", timeout=0.5)
            outcome = "completed"
        except asyncio.TimeoutError:
            outcome = "timed out"
        check("cancel: pg_sleep(10) with timeout=0.5", outcome, "timed out")
        check("cancel: connection usable", await victim.fetchval("SELECT 1"), 1)
        check("cancel: cancelled on the server within 2 s", time.monotonic() - start < 2, True)
        check("cancel: concurrent query on another connection", await beside, "unaffected")


async def listen_notify():
    async with connect() as listener, connect() as sender:
        received = asyncio.get_running_loop().create_future()
        await listener.add_listener("fencegate_clients", lambda _conn, _pid, channel, payload:
                                    received.done() or received.set_result((channel, payload)))
        await sender.execute("SELECT pg_notify('fencegate_clients', 'from-sender')")
        got = await asyncio.wait_for(received, 5)
        check("notify: delivered to the idle listener", got, ("fencegate_clients", "from-sender"))


async def bytea():
    async with connect() as c:
        check("bytea: 16 MiB round trip", digest(await c.fetchval("SELECT $1::bytea", BLOB)), digest(BLOB))


SCENARIOS = [seed, startup_options, no_token, aborted_transaction, executemany,
             multi_statement, copy, cancel, listen_notify, bytea]


async def main():
    for scenario in SCENARIOS:
        try:
            await asyncio.wait_for(scenario(), SCENARIO_TIMEOUT_S)
        except Mismatch as e:
            print(f"FAIL {scenario.__name__}: {e}", flush=True)
            return 1
        except Exception as e:  # a timeout or an unexpected error
            print(f"FAIL {scenario.__name__}: {e!r}", flush=True)
            return 1
    print(f"ok {checks} checks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
