#!/usr/bin/env python3
"""The fencing scenarios through psycopg 3 (libpq), against FENCEGATE_CLIENT_DSN.

Starts from the state tests/clients/fixture.sh leaves (sweep_state row 1 'initial',
resource `sweeper` with no token yet) and moves `sweeper` through terms 42 and 43,
so it runs once per fresh fixture. Prints one line per check and `ok <n> checks`,
or `FAIL <scenario>: <what differed>` and exits 1. See ../README.md.

Every connection is in autocommit, so that the SQL written here (BEGIN, COMMIT) is
exactly what goes over the wire: psycopg's own implicit BEGIN would hide it.
"""

import hashlib
import os
import re
import signal
import sys
import threading
import time
from concurrent.futures import Future

import psycopg

DSN = os.environ["FENCEGATE_CLIENT_DSN"]
TLS_ROOT = os.environ.get("FENCEGATE_CLIENT_TLS_ROOT")
SCENARIO_TIMEOUT_S = 20

UPDATE = "UPDATE sweep_state SET note = %s WHERE id = 1"
# One statement that presents its own token: with the connection's token (42) the
# trigger lets the INSERT start, and fence() then checks this row's token.
BATCH_INSERT = ("INSERT INTO sweep_state (id, note) SELECT %s::int, %s::text"
                " WHERE fencegate.fence('sweeper', %s::bigint) IS NOT NULL")
MULTI = ("BEGIN; SELECT fencegate.fence('sweeper', 42);"
         " UPDATE sweep_state SET note = 'multi-1' WHERE id = 1; COMMIT;"
         " UPDATE sweep_state SET note = 'multi-2' WHERE id = 1")
STALE_DETAIL = "resource=sweeper presented=41 highest=42"
BLOB = bytes(range(256)) * (16 * 1024 * 1024 // 256)  # 16 MiB, every byte value

checks = 0


class Mismatch(Exception):
    pass


def check(name, got, want):
    global checks
    if got != want:
        raise Mismatch(f"{name}: expected {want!r}, got {got!r}")
    checks += 1
    print(f"ok {name}", flush=True)


def connect(**params):
    return psycopg.connect(DSN, autocommit=True, connect_timeout=10, **params)


def error_of(fn):
    """Runs fn; returns the psycopg.Error it raised, or None."""
    try:
        fn()
    except psycopg.Error as e:
        return e
    return None


def check_error(name, err, sqlstate, detail=None):
    check(f"{name}: SQLSTATE", err and err.sqlstate, sqlstate)
    if detail is not None:
        fields, _, proof = (err.diag.message_detail or "").partition(" proof=")
        check(f"{name}: DETAIL", fields, detail)
        check(f"{name}: DETAIL proof", bool(re.fullmatch("[0-9a-f]{64}", proof)), True)
        check(f"{name}: HINT non-empty", bool(err.diag.message_hint), True)


def scalar(conn, sql, params=None):
    return conn.execute(sql, params).fetchone()[0]


def note(conn):
    return scalar(conn, "SELECT note FROM sweep_state WHERE id = 1")


def digest(data):
    """What a check prints of a large value: its length and hash."""
    return len(data), hashlib.sha256(data).hexdigest()


def in_background(fn):
    """Runs fn on a daemon thread (a stuck call cannot hold the exit); returns a Future."""
    fut = Future()

    def run():
        try:
            fut.set_result(fn())
        except BaseException as e:  # handed to whoever reads the future
            fut.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return fut


def seed():
    with connect() as b, connect() as a:
        with b.transaction():  # node-b, term 42, literal SQL (simple query)
            b.execute("SELECT fencegate.fence('sweeper', 42)")
            b.execute("UPDATE sweep_state SET note = 'node-b' WHERE id = 1")

        def node_a():  # the delayed term-41 transaction, bind parameters
            with a.transaction():
                a.execute("SELECT fencegate.fence(%s, %s)", ("sweeper", 41))
                a.execute(UPDATE, ("node-a",))

        check_error("seed: node-a (41) after node-b (42)", error_of(node_a), "ZF001", STALE_DETAIL)
        check("seed: row still reads node-b", note(a), "node-b")


def startup_options():
    with connect(options="-c fencegate.token=42") as c:
        check("options 42: UPDATE outside a transaction", c.execute(UPDATE, ("options-42",)).rowcount, 1)
    with connect(options="-c fencegate.token=41") as c:
        check_error("options 41: UPDATE", error_of(lambda: c.execute(UPDATE, ("options-41",))),
                    "ZF001", STALE_DETAIL)
        check("options 41: row reads options-42", note(c), "options-42")


def no_token():
    with connect() as c:
        check_error("no token: UPDATE", error_of(lambda: c.execute(UPDATE, ("no-token",))), "ZF002")


def aborted_transaction():
    with connect() as c:
        c.execute("BEGIN")
        err = error_of(lambda: c.execute("SELECT fencegate.fence(%s, %s)", ("sweeper", 41)))
        check_error("aborted tx: stale fence()", err, "ZF001")
        check_error("aborted tx: next statement", error_of(lambda: c.execute("SELECT 1")), "25P02")
        c.execute("ROLLBACK")
        check("aborted tx: usable after ROLLBACK", scalar(c, "SELECT 1"), 1)


def pipeline():
    with connect(options="-c fencegate.token=42") as c:
        def run():
            with c.pipeline():  # one Sync at the end: one implicit transaction
                c.execute(BATCH_INSERT, (10, "pipeline", 42))
                c.execute(BATCH_INSERT, (11, "pipeline", 41))
                c.execute(BATCH_INSERT, (12, "pipeline", 42))

        check_error("pipeline: stale second statement", error_of(run), "ZF001", STALE_DETAIL)
        check("pipeline: nothing landed", scalar(c, "SELECT count(*) FROM sweep_state WHERE id >= 10"), 0)


def multi_statement():
    with connect() as c:
        check_error("multi-statement: UPDATE after COMMIT", error_of(lambda: c.execute(MULTI)), "ZF002")
        check("multi-statement: part before COMMIT committed", note(c), "multi-1")


def copy():
    def copy_in(conn, rows):
        with conn.cursor().copy("COPY sweep_state (id, note) FROM STDIN") as cp:
            for row in rows:
                cp.write_row(row)

    with connect() as c:
        with c.transaction():
            check("copy: fence term 43", scalar(c, "SELECT fencegate.fence(%s, %s)", ("sweeper", 43)), 43)
            copy_in(c, [(20, "copy-20"), (21, "copy-21")])
        check_error("copy: COPY FROM without a token", error_of(lambda: copy_in(c, [(22, "copy-22")])), "ZF002")
        with c.cursor().copy("COPY (SELECT id, note FROM sweep_state WHERE id >= 20 ORDER BY id) TO STDOUT") as cp:
            check("copy: COPY TO reads the rows", b"".join(cp), b"20\tcopy-20\n21\tcopy-21\n")


def cancel():
    with connect() as victim, connect() as bystander, connect() as watcher:
        # The server's pid, not info.backend_pid: the door hands out cancel keys of its own.
        pid = scalar(victim, "SELECT pg_backend_pid()")
        # libpq's two cancel paths: PQcancel (plain socket) and PQcancelConn (libpq 17,
        # which honours sslmode).
        for method in ("cancel", "cancel_safe"):
            beside = in_background(lambda: scalar(bystander, "SELECT 'unaffected' FROM pg_sleep(1.5)"))

            def cancel_when_running():
                while not scalar(watcher, "SELECT count(*) FROM pg_stat_activity"
                                          " WHERE pid = %s AND state = 'active'", (pid,)):
                    time.sleep(0.02)
                getattr(victim, method)()

            canceller = in_background(cancel_when_running)
            start = time.monotonic()
            err = error_of(lambda: victim.execute("SELECT pg_sleep(10)"))
            elapsed = time.monotonic() - start
            canceller.result(timeout=5)
            check_error(f"cancel ({method}): pg_sleep(10)", err, "57014")
            check(f"cancel ({method}): within 2 s", elapsed < 2, True)
            check(f"cancel ({method}): concurrent query on another connection", beside.result(timeout=5), "unaffected")
            check(f"cancel ({method}): connection usable", scalar(victim, "SELECT 1"), 1)


def listen_notify():
    with connect() as listener, connect() as sender:
        listener.execute("LISTEN fencegate_clients")
        sender.execute("SELECT pg_notify('fencegate_clients', 'from-sender')")
        got = [(n.channel, n.payload) for n in listener.notifies(timeout=5, stop_after=1)]
        check("notify: delivered to the idle listener", got, [("fencegate_clients", "from-sender")])


def bytea():
    with connect() as c:
        got = bytes(scalar(c, "SELECT %b::bytea", (BLOB,)))
        check("bytea: 16 MiB round trip", digest(got), digest(BLOB))


def tls():
    if not TLS_ROOT:
        print("skip tls: FENCEGATE_CLIENT_TLS_ROOT is not set", flush=True)
        return
    for negotiation in ("postgres", "direct"):
        with connect(sslmode="verify-full", sslrootcert=TLS_ROOT, sslnegotiation=negotiation) as c:
            check(f"tls (sslnegotiation={negotiation}): ssl_in_use", c.pgconn.ssl_in_use, True)
            check(f"tls (sslnegotiation={negotiation}): query", scalar(c, "SELECT 1"), 1)


SCENARIOS = [seed, startup_options, no_token, aborted_transaction, pipeline,
             multi_statement, copy, cancel, listen_notify, bytea, tls]


def on_alarm(signum, frame):
    raise TimeoutError(f"did not finish within {SCENARIO_TIMEOUT_S} s")


def main():
    signal.signal(signal.SIGALRM, on_alarm)
    for scenario in SCENARIOS:
        signal.alarm(SCENARIO_TIMEOUT_S)
        try:
            scenario()
        except Mismatch as e:
            print(f"FAIL {scenario.__name__}: {e}", flush=True)
            return 1
        except Exception as e:  # a timeout or an unexpected error
            print(f"FAIL {scenario.__name__}: {e!r}", flush=True)
            return 1
        finally:
            signal.alarm(0)
    print(f"ok {checks} checks", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
