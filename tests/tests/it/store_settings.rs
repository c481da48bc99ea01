//! The Postgres store's connections pin the settings its guarantees rest on, over
//! whatever the database, its roles or the URL say: an acknowledged write is durable
//! (`synchronous_commit=on`), writes are allowed, statements run at read committed,
//! and the timeouts are the gateway's own.

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use serde_json::Value;

/// The settings a "store session settings" event logged, as `name=value` words.
fn settings(event: &Value) -> String {
    event["fields"]["settings"]
        .as_str()
        .unwrap_or_else(|| panic!("no settings in {event}"))
        .to_owned()
}

#[tokio::test]
async fn a_database_set_against_the_store_does_not_weaken_it() {
    let db = TestDb::create().await;
    for setting in [
        "synchronous_commit = off",
        "default_transaction_isolation = 'serializable'",
        "statement_timeout = '5ms'",
        "idle_in_transaction_session_timeout = '1ms'",
        // Last: from here on, sessions of the database cannot write.
        "default_transaction_read_only = on",
    ] {
        db.execute(&format!("ALTER DATABASE {} SET {setting}", db.name()))
            .await;
    }
    // Ordinary sessions of the database run with those settings.
    let plain = db.client().await;
    for (name, value) in [
        ("synchronous_commit", "off"),
        ("default_transaction_read_only", "on"),
    ] {
        let row = plain.query_one(&format!("SHOW {name}"), &[]).await.unwrap();
        assert_eq!(row.get::<_, String>(0), value, "{name}");
    }
    drop(plain);

    // The URL's own options cannot weaken them either.
    let url = format!("{}?options=-c%20synchronous_commit%3Dlocal", db.url());
    let gateway = Gateway::builder().database(&url).spawn().await;
    let client = gateway.client();
    assert_eq!(client.put("orders", "o-1", 1, "v").await.status, 201);
    assert_eq!(client.advance("orders", 2).await.status, 200);
    assert_eq!(client.put("orders", "o-1", 2, "w").await.status, 200);

    let events = gateway.events("store session settings");
    assert_eq!(events.len(), 2, "{events:?}");
    for event in &events {
        let settings = settings(event);
        for pinned in [
            "synchronous_commit=on",
            "default_transaction_read_only=off",
            "default_transaction_isolation=read committed",
            "statement_timeout=0",
            "idle_in_transaction_session_timeout=5000",
        ] {
            assert!(settings.contains(pinned), "{pinned} not in {event}");
        }
    }
    let lock_timeouts: Vec<(String, String)> = events
        .iter()
        .map(|event| {
            let pool = event["fields"]["pool"].as_str().unwrap().to_owned();
            let settings = settings(event);
            let lock = settings
                .split(' ')
                .find(|word| word.starts_with("lock_timeout="))
                .unwrap_or_else(|| panic!("no lock_timeout in {event}"))
                .to_owned();
            (pool, lock)
        })
        .collect();
    assert_eq!(
        lock_timeouts,
        [
            ("connections".to_owned(), "lock_timeout=0".to_owned()),
            ("write lanes".to_owned(), "lock_timeout=200".to_owned()),
        ]
    );
}
