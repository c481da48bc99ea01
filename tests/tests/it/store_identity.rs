//! The embedded store's identity: a data directory that held a store never starts empty
//! over a lost or emptied file, nor on another store's file; `--init-store` starts an
//! empty store deliberately and never over a file with content; a store made by an older
//! gateway is adopted; fences survive a normal restart.

use std::path::Path;

use fencegate_tests::deployment::DataDir;
use fencegate_tests::gateway::{Gateway, GatewayBuilder, StartFailure};
use redb::{ReadableDatabase, TableDefinition};

const STORE: &str = "fencegate.redb";
const ID_FILE: &str = "fencegate.store-id";

fn builder(dir: &Path) -> GatewayBuilder {
    Gateway::builder()
        .arg("--data-dir")
        .arg(dir.display().to_string())
}

async fn refused(builder: GatewayBuilder, says: &[&str]) -> StartFailure {
    let failure = builder
        .try_spawn()
        .await
        .err()
        .expect("the gateway must refuse to start");
    assert!(
        failure.status.is_some_and(|status| !status.success()),
        "{failure}"
    );
    for words in says {
        assert!(failure.logs.contains(words), "{words:?} not in: {failure}");
    }
    failure
}

fn store_id(dir: &Path) -> String {
    let id = std::fs::read_to_string(dir.join(ID_FILE)).expect("the identity file exists");
    let id = id.trim().to_owned();
    assert!(
        id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id:?}"
    );
    id
}

/// A store with resource `orders` at fence 7, stopped; returns its identity.
async fn store_with_a_fence(dir: &Path) -> String {
    let mut gateway = builder(dir).spawn().await;
    assert_eq!(gateway.client().advance("orders", 7).await.status, 200);
    assert!(gateway.terminate().await.success());
    store_id(dir)
}

async fn fence(gateway: &Gateway) -> Option<u64> {
    gateway.client().read_highest("orders").await
}

#[tokio::test]
async fn a_zero_length_file_is_refused() {
    let dir = DataDir::create();
    std::fs::write(dir.0.join(STORE), b"").unwrap();
    refused(
        builder(&dir.0),
        &["fencegate.redb is empty (zero bytes)", "--init-store"],
    )
    .await;
    // Refused means untouched.
    assert_eq!(std::fs::metadata(dir.0.join(STORE)).unwrap().len(), 0);
    assert!(!dir.0.join(ID_FILE).exists());
}

#[tokio::test]
async fn a_lost_store_is_refused_until_init_store() {
    let dir = DataDir::create();
    let first = store_with_a_fence(&dir.0).await;

    std::fs::remove_file(dir.0.join(STORE)).unwrap();
    refused(
        builder(&dir.0),
        &[
            "fencegate.redb is missing",
            &format!("says store {first} was kept here"),
            "would lose its fences",
            "--init-store",
        ],
    )
    .await;
    assert!(!dir.0.join(STORE).exists(), "nothing created");
    std::fs::write(dir.0.join(STORE), b"").unwrap();
    refused(
        builder(&dir.0),
        &["fencegate.redb is empty (zero bytes)", &first],
    )
    .await;

    // Deliberately: a new, empty store with a new identity.
    let mut fresh = builder(&dir.0).arg("--init-store").spawn().await;
    assert_eq!(fence(&fresh).await, None, "an empty store");
    let second = store_id(&dir.0);
    assert_ne!(first, second);
    assert_eq!(
        fresh
            .events("started a new, empty store deliberately (--init-store)")
            .len(),
        1
    );
    assert_eq!(fresh.client().advance("orders", 3).await.status, 200);
    assert!(fresh.terminate().await.success());

    // --init-store never starts over a store file with content.
    refused(
        builder(&dir.0).arg("--init-store"),
        &["--init-store refuses to start", "Move it away"],
    )
    .await;
    let again = builder(&dir.0).spawn().await;
    assert_eq!(fence(&again).await, Some(3));
    assert_eq!(store_id(&dir.0), second);
}

#[tokio::test]
async fn another_stores_file_is_refused() {
    let (one, two) = (DataDir::create(), DataDir::create());
    let first = store_with_a_fence(&one.0).await;
    let second = store_with_a_fence(&two.0).await;
    std::fs::copy(one.0.join(STORE), two.0.join(STORE)).unwrap();
    refused(
        builder(&two.0),
        &[
            &format!("is the file of store {first}"),
            &format!("belongs to store {second}"),
            "another store's file",
        ],
    )
    .await;
}

/// A store an older gateway made has no identity, in its file or next to it: it is
/// adopted, and keeps its fences.
#[tokio::test]
async fn a_store_without_identity_is_adopted() {
    let dir = DataDir::create();
    let before = store_with_a_fence(&dir.0).await;
    // Make it as an older gateway left it: no identity table, no identity file.
    {
        let db = redb::Database::open(dir.0.join(STORE)).unwrap();
        let txn = db.begin_write().unwrap();
        let table: TableDefinition<&str, &str> = TableDefinition::new("fencegate_identity");
        assert!(txn.delete_table(table).unwrap(), "the file had an identity");
        txn.commit().unwrap();
        let txn = db.begin_read().unwrap();
        assert!(txn.open_table(table).is_err());
    }
    std::fs::remove_file(dir.0.join(ID_FILE)).unwrap();

    let mut gateway = builder(&dir.0).spawn().await;
    assert_eq!(fence(&gateway).await, Some(7));
    let adopted = store_id(&dir.0);
    assert_ne!(adopted, before);
    let logged =
        gateway.events("the store had no identity (made by an older gateway); it has one now");
    assert_eq!(logged.len(), 1, "{:?}", gateway.logs());
    assert_eq!(logged[0]["fields"]["store_id"], adopted.as_str());
    // Both places hold it now: a restart finds them equal.
    gateway.restart().await;
    assert_eq!(fence(&gateway).await, Some(7));
    assert_eq!(store_id(&dir.0), adopted);
}

#[tokio::test]
async fn fences_and_identity_survive_a_normal_restart() {
    let dir = DataDir::create();
    let mut gateway = builder(&dir.0).spawn().await;
    let id = store_id(&dir.0);
    let backend = gateway.events("fencegate ready")[0]["fields"]["backend"].clone();
    assert!(
        backend.as_str().unwrap().contains(&format!("(store {id})")),
        "{backend}"
    );
    assert_eq!(gateway.client().advance("orders", 7).await.status, 200);
    gateway.restart().await;
    assert_eq!(fence(&gateway).await, Some(7));
    assert_eq!(store_id(&dir.0), id);
    assert!(
        gateway.events("created a new store").is_empty(),
        "a restart creates nothing"
    );
}
