//! The Postgres door in front of a fenced table: the fixture of the door's suites and
//! of the driver scripts in `tests/clients/`.

use std::net::SocketAddr;

use tokio_postgres::Client;

use crate::db::via;
use crate::fenced::{connect_with, FencedDb};
use crate::gateway::Gateway;

/// A fresh database with table `sweep_state (id int PRIMARY KEY, note text)` holding
/// `(1, 'initial')`, fenced under resource `sweeper` with no token presented yet, its
/// writer role, and a gateway whose Postgres door leads to it.
pub struct SweeperDoor {
    pub db: FencedDb,
    pub gateway: Gateway,
}

impl SweeperDoor {
    pub async fn start() -> SweeperDoor {
        SweeperDoor::start_with(&[]).await
    }

    /// With further gateway flags.
    pub async fn start_with(args: &[&str]) -> SweeperDoor {
        let db = FencedDb::create().await;
        db.execute(
            "CREATE TABLE sweep_state (id int PRIMARY KEY, note text NOT NULL);
             INSERT INTO sweep_state VALUES (1, 'initial');",
        )
        .await;
        db.protect("sweep_state", "sweeper").await;
        let gateway = Gateway::builder()
            .database(&db.db.url())
            .args(args)
            .spawn()
            .await;
        SweeperDoor { db, gateway }
    }

    /// The door's address.
    pub fn addr(&self) -> SocketAddr {
        self.gateway.pg_addr()
    }

    /// The writer role's connection string, through the door.
    pub fn writer_url(&self) -> String {
        via(self.db.writer_url(), self.addr())
    }

    /// A writer connected through the door, with start-up `options` (or none).
    pub async fn writer(&self, options: &str) -> Client {
        connect_with(&self.writer_url(), options).await
    }

    /// The note of row 1.
    pub async fn note(&self) -> String {
        self.db
            .admin
            .query_one("SELECT note FROM sweep_state WHERE id = 1", &[])
            .await
            .expect("sweep_state can be read")
            .get(0)
    }

    /// A series of the gateway's metrics; 0 if it is absent.
    pub async fn metric(&self, series: &str) -> f64 {
        self.gateway.client().metric(series).await.unwrap_or(0.0)
    }
}
