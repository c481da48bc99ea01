//! One fresh Postgres database per test.
//!
//! The server is the machine's Postgres (`FENCEGATE_TEST_PG`, default
//! `postgres://postgres@127.0.0.1:5432`). Each [`TestDb`] creates a uniquely named
//! database and drops it when the value is dropped, so tests never see each other's
//! fences and can run in parallel. Roles belong to the whole server, so the roles a
//! test creates ([`TestDb::create_role`]) carry the database's name and are dropped
//! with it.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;

use tokio_postgres::{Client, NoTls};

const DEFAULT_SERVER: &str = "postgres://postgres@127.0.0.1:5432";

/// The Postgres server tests run against.
pub fn server_url() -> String {
    std::env::var("FENCEGATE_TEST_PG").unwrap_or_else(|_| DEFAULT_SERVER.to_owned())
}

/// The test server's socket address, for putting a proxy in front of it.
pub async fn server_addr() -> SocketAddr {
    let server = server_url();
    let authority = server
        .split_once("://")
        .map_or(server.as_str(), |(_, rest)| rest);
    let host_port = authority
        .rsplit_once('@')
        .map_or(authority, |(_, host)| host);
    let host_port = host_port.split('/').next().unwrap_or_default();
    let host_port = if host_port.contains(':') {
        host_port.to_owned()
    } else {
        format!("{host_port}:5432")
    };
    let mut addrs = tokio::net::lookup_host(&host_port)
        .await
        .unwrap_or_else(|e| panic!("cannot resolve the test Postgres server {host_port}: {e}"));
    addrs
        .next()
        .expect("the test Postgres server has an address")
}

/// `url` with its host and port replaced by `addr` (user and database kept): the same
/// database reached through a proxy.
pub fn via(url: &str, addr: SocketAddr) -> String {
    let (scheme, rest) = url.split_once("://").expect("a database URL has a scheme");
    let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
    let user = authority
        .rsplit_once('@')
        .map(|(user, _)| format!("{user}@"))
        .unwrap_or_default();
    format!("{scheme}://{user}{addr}{path}")
}

/// A database that exists for the life of this value.
pub struct TestDb {
    name: String,
    server: String,
    /// Roles created for this test, dropped after the database.
    roles: Mutex<Vec<String>>,
}

/// The privileges of the writer role of [`TestDb::writer`]: the data of schema
/// `public`, now and for tables created later by `postgres`.
const WRITER_GRANTS: &str = "
    GRANT USAGE ON SCHEMA public TO {role};
    GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public TO {role};
    GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO {role};
    ALTER DEFAULT PRIVILEGES FOR ROLE postgres IN SCHEMA public
        GRANT SELECT, INSERT, UPDATE, DELETE, TRUNCATE ON TABLES TO {role};
    ALTER DEFAULT PRIVILEGES FOR ROLE postgres IN SCHEMA public
        GRANT USAGE, SELECT ON SEQUENCES TO {role};";

impl TestDb {
    /// Creates an empty database. Panics, with instructions, if Postgres is unreachable.
    pub async fn create() -> TestDb {
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "fg_test_{}_{}_{:08x}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed),
            rand::random::<u32>()
        );
        let server = server_url();
        let admin = connect(&format!("{server}/postgres")).await;
        admin
            .batch_execute(&format!("CREATE DATABASE {name}"))
            .await
            .unwrap_or_else(|e| panic!("could not create test database {name}: {e}"));
        TestDb {
            name,
            server,
            roles: Mutex::new(Vec::new()),
        }
    }

    /// The database's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Creates a role named `<database>_<suffix>` with `attributes` (e.g. `LOGIN`,
    /// `LOGIN CREATEROLE`, `NOLOGIN`); dropped with the database. Returns its name.
    pub async fn create_role(&self, suffix: &str, attributes: &str) -> String {
        let role = format!("{}_{suffix}", self.name);
        self.execute(&format!("CREATE ROLE {role} {attributes}"))
            .await;
        self.roles.lock().unwrap().push(role.clone());
        role
    }

    /// Drops `role` with the database: for roles a test creates itself.
    pub fn drop_role_later(&self, role: &str) {
        self.roles.lock().unwrap().push(role.to_owned());
    }

    /// The writer-only role for fenced SQL, `<database>_writer`, created on first use:
    /// it may read and write the tables of schema `public` (also those created later),
    /// and nothing of the gateway's. Returns its connection string.
    pub async fn writer(&self) -> String {
        let role = self.writer_role();
        if !self.roles.lock().unwrap().contains(&role) {
            self.create_role("writer", "LOGIN").await;
            self.execute(&WRITER_GRANTS.replace("{role}", &role)).await;
        }
        self.url_as(&role)
    }

    /// The name of [`TestDb::writer`]'s role.
    pub fn writer_role(&self) -> String {
        format!("{}_writer", self.name)
    }

    /// This database's URL, logging in as `role` (trust auth).
    pub fn url_as(&self, role: &str) -> String {
        let server = self
            .server
            .split_once("://")
            .map_or(self.server.as_str(), |(_, rest)| rest);
        let host = server.rsplit_once('@').map_or(server, |(_, host)| host);
        format!("postgres://{role}@{host}/{}", self.name)
    }

    /// The connection string of this database.
    pub fn url(&self) -> String {
        format!("{}/{}", self.server, self.name)
    }

    /// This database's URL through `addr` (a proxy in front of the server).
    pub fn url_via(&self, addr: SocketAddr) -> String {
        via(&self.url(), addr)
    }

    /// A direct connection to this database, for checking what the gateway stored.
    pub async fn client(&self) -> Client {
        connect(&self.url()).await
    }

    /// Runs `sql` (one or more statements) on a new connection; panics with the SQL if
    /// it fails. For setting up what a test needs next to the gateway's tables.
    pub async fn execute(&self, sql: &str) {
        self.client()
            .await
            .batch_execute(sql)
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"));
    }

    /// Locks `resource`'s fence row in an open transaction, as a long fenced SQL
    /// transaction would; the lock is held until the returned connection commits, rolls
    /// back or is dropped.
    pub async fn lock_fence(&self, resource: &str) -> Client {
        let holder = self.client().await;
        holder
            .execute("BEGIN", &[])
            .await
            .expect("a transaction starts");
        holder
            .execute(
                "SELECT highest FROM fencegate.fences WHERE resource = $1 FOR UPDATE",
                &[&resource],
            )
            .await
            .unwrap_or_else(|e| panic!("locking the fence of {resource}: {e:?}"));
        holder
    }

    /// The single value `sql` selects, on a new connection; panics with the SQL if it
    /// fails or selects no row.
    pub async fn value<T>(&self, sql: &str) -> T
    where
        T: for<'a> tokio_postgres::types::FromSql<'a>,
    {
        self.client()
            .await
            .query_one(sql, &[])
            .await
            .unwrap_or_else(|e| panic!("{sql}: {e:?}"))
            .get(0)
    }

    /// How many sessions of this database are waiting for a lock now.
    pub async fn lock_waiters(&self) -> i64 {
        self.value(
            "SELECT count(*) FROM pg_stat_activity
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .await
    }

    /// The durable highest token of `resource`, read straight from the gateway's table.
    pub async fn highest(&self, resource: &str) -> Option<i64> {
        self.client()
            .await
            .query_opt(
                "SELECT highest FROM fencegate.fences WHERE resource = $1",
                &[&resource],
            )
            .await
            .expect("fencegate.fences is readable")
            .map(|row| row.get(0))
    }

    /// The stored object `(value, token, version)`, `None` if absent or deleted.
    pub async fn object(&self, resource: &str, key: &str) -> Option<(Vec<u8>, i64, i64)> {
        self.client()
            .await
            .query_opt(
                "SELECT value, token, version FROM fencegate.objects
                 WHERE resource = $1 AND key = $2 AND value IS NOT NULL",
                &[&resource, &key],
            )
            .await
            .expect("fencegate.objects is readable")
            .map(|row| (row.get(0), row.get(1), row.get(2)))
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        // Drop runs outside any runtime we may use, so clean up on a thread of its own.
        let (server, name) = (self.server.clone(), self.name.clone());
        let roles = std::mem::take(&mut *self.roles.lock().unwrap());
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async move {
                let (client, connection) =
                    tokio_postgres::connect(&format!("{server}/postgres"), NoTls)
                        .await
                        .ok()?;
                tokio::spawn(connection);
                let dropped = client
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .await
                    .ok();
                for role in roles {
                    let _ = client
                        .batch_execute(&format!("DROP ROLE IF EXISTS {role}"))
                        .await;
                }
                dropped
            })
        });
        let _ = cleanup.join();
    }
}

/// Connects or panics with a message that says how to start Postgres.
pub async fn connect(url: &str) -> Client {
    match tokio_postgres::connect(url, NoTls).await {
        Ok((client, connection)) => {
            tokio::spawn(async move {
                let _ = connection.await;
            });
            client
        }
        Err(error) => panic!(
            "cannot reach Postgres at {url}: {error}\n\
             These tests need a real Postgres server. Start the machine's cluster with\n  \
             pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start\n\
             or point FENCEGATE_TEST_PG at another server (trust auth, user postgres)."
        ),
    }
}
