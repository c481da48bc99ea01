"""Fixtures: gateways on both backends, and the one place that sets up databases.

Every test runs against the real ``fencegate`` binary and a real Postgres at
127.0.0.1:5432 (user ``postgres``, trust). If that Postgres cannot be reached the run
stops at once with an error: these tests are never skipped.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import psycopg
import pytest
from psycopg import sql

import fencegate

from harness import BINARY, GatewayProcess, Hop

PG_HOST = os.environ.get("PGHOST", "127.0.0.1")
PG_PORT = int(os.environ.get("PGPORT", "5432"))
PG_SUPERUSER = "postgres"


def admin_url(database: str = "postgres") -> str:
    return f"postgresql://{PG_SUPERUSER}@{PG_HOST}:{PG_PORT}/{database}"


def pytest_sessionstart(session: pytest.Session) -> None:
    try:
        with psycopg.connect(admin_url(), connect_timeout=5) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as error:
        pytest.exit(
            f"Postgres at {PG_HOST}:{PG_PORT} (user {PG_SUPERUSER}, trust) is not reachable: {error}",
            returncode=1,
        )
    if not BINARY.exists():
        pytest.exit(f"{BINARY} is missing: cargo build -p fencegate-gateway --bin fencegate", returncode=1)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


# ---------------------------------------------------------------- databases


@dataclass(frozen=True)
class FencedDatabase:
    """A fresh database with table ``sweep_state`` (row ``1, 'initial'``) fenced under
    resource ``sweeper``; a login role ``writer`` that may write it and present the
    resource's tokens (through the door, or straight to Postgres); and a login role
    ``sql_login`` that may write it and nothing of fencegate's, for the statements of
    ``/v1/sql`` (``--sql-database-url``). No token has been presented yet."""

    name: str
    writer: str
    sql_login: str
    resource: str = "sweeper"

    @property
    def admin_url(self) -> str:
        return admin_url(self.name)

    def writer_url(self, addr: str = f"{PG_HOST}:{PG_PORT}") -> str:
        """The writer's URL, straight to Postgres or (``addr``) through the door."""
        return f"postgresql://{self.writer}@{addr}/{self.name}"

    @property
    def sql_url(self) -> str:
        """The URL of ``/v1/sql``'s login (``--sql-database-url``)."""
        return f"postgresql://{self.sql_login}@{PG_HOST}:{PG_PORT}/{self.name}"

    def note(self) -> str:
        """Row 1's note, read as the superuser."""
        with psycopg.connect(self.admin_url, autocommit=True) as conn:
            row = conn.execute("SELECT note FROM sweep_state WHERE id = 1").fetchone()
        assert row is not None
        return str(row[0])


def run_fencegate(*args: str) -> None:
    """Runs a command of the gateway binary; fails with what it said."""
    done = subprocess.run([str(BINARY), *args], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    if done.returncode != 0:
        raise RuntimeError(f"fencegate {' '.join(args)} failed:\n{done.stderr}")


@pytest.fixture
def fenced_database() -> Iterator[FencedDatabase]:
    """All database setup of these tests, in one place: the database, the fenced table,
    the roles and their grants. The rights a role needs to fence a resource are granted
    here and nowhere else."""
    suffix = uuid.uuid4().hex[:12]
    db = FencedDatabase(name=f"fg_py_{suffix}", writer=f"fg_py_{suffix}_writer", sql_login=f"fg_py_{suffix}_sql")
    name = sql.Identifier(db.name)
    roles = [sql.Identifier(db.writer), sql.Identifier(db.sql_login)]
    try:
        with psycopg.connect(admin_url(), autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(name))
            for role in roles:
                conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(role))
        with psycopg.connect(db.admin_url, autocommit=True) as conn:
            conn.execute("CREATE TABLE sweep_state (id int PRIMARY KEY, note text NOT NULL)")
            conn.execute("INSERT INTO sweep_state VALUES (1, 'initial')")
        run_fencegate("protect", "sweep_state", "--resource", db.resource, "--database-url", db.admin_url)
        with psycopg.connect(db.admin_url, autocommit=True) as conn:
            for role in roles:
                conn.execute(sql.SQL("GRANT USAGE ON SCHEMA public TO {}").format(role))
                conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON sweep_state TO {}").format(role))
        # The writer's right to present and raise the fence of the resource, and of no
        # other. (The gateway gives /v1/sql's login what that needs itself.)
        run_fencegate("grant", db.writer, "--resource", db.resource, "--database-url", db.admin_url)
        yield db
    finally:
        with psycopg.connect(admin_url(), autocommit=True) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(name))
            for role in roles:
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(role))


# ---------------------------------------------------------------- gateways


class GatewayFactory:
    """Starts gateways on one backend; stops them all at the end of the test."""

    def __init__(self, backend: str, store: str) -> None:
        self.backend = backend
        self.store = store
        self.started: list[GatewayProcess] = []

    def backend_args(self) -> list[str]:
        if self.backend == "postgres":
            return ["--database-url", self.store]
        return ["--data-dir", self.store]

    def start(self, *extra: str, scheme: str = "http") -> GatewayProcess:
        process = GatewayProcess([*self.backend_args(), *extra], scheme=scheme).start()
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in self.started:
            process.stop()


@pytest.fixture(params=["embedded", "postgres"])
def backend(request: pytest.FixtureRequest) -> str:
    """Each test that uses it runs on the embedded store and on Postgres."""
    return str(request.param)


@pytest.fixture
def gateways(request: pytest.FixtureRequest, backend: str, tmp_path: Path) -> Iterator[GatewayFactory]:
    if backend == "postgres":
        db: FencedDatabase = request.getfixturevalue("fenced_database")
        factory = GatewayFactory(backend, db.admin_url)
    else:
        factory = GatewayFactory(backend, str(tmp_path / "store"))
    try:
        yield factory
    finally:
        factory.stop_all()


@pytest.fixture
def gateway_process(gateways: GatewayFactory) -> GatewayProcess:
    return gateways.start()


@pytest.fixture
def gateway(gateway_process: GatewayProcess) -> Iterator[fencegate.Gateway]:
    with fencegate.Gateway(gateway_process.url) as client:
        yield client


@pytest.fixture
def door(fenced_database: FencedDatabase) -> Iterator[GatewayProcess]:
    """A gateway on the fenced database, with its Postgres door open."""
    process = GatewayProcess(["--database-url", fenced_database.admin_url]).start()
    try:
        assert process.pg_addr, "the ready line names no Postgres door"
        yield process
    finally:
        process.stop()


@pytest.fixture
def make_hop() -> Iterator[Callable[[str], Hop]]:
    """Makes TCP hops in front of addresses; closes them at the end of the test."""
    hops: list[Hop] = []

    def make(target: str) -> Hop:
        hop = Hop(target)
        hops.append(hop)
        return hop

    yield make
    for hop in hops:
        hop.close()
