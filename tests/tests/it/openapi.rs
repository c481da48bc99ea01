//! The API against its OpenAPI document (`gateway/openapi.json`): the gateway serves the
//! document, and schemathesis, generating requests from it, finds no answer that breaks
//! it — no server error, no undocumented status, header or body — with every check it
//! has (settings: `tests/schemathesis.toml`).

use std::process::Command;

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;

const DOCUMENT: &str = include_str!("../../../gateway/openapi.json");

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_nothing_that_breaks_the_document() {
    let db = TestDb::create().await;
    db.execute("CREATE TABLE notes (id int, note text)").await;
    // Fence resets need an administrator's credential; every request carries it.
    let admin = fencegate_gateway::auth::new_key();
    let key_file = std::env::temp_dir().join(format!(
        "fencegate-openapi-{}-{:08x}.key",
        std::process::id(),
        rand::random::<u32>()
    ));
    std::fs::write(&key_file, fencegate_gateway::auth::stored_hash(&admin)).unwrap();
    let gateway = Gateway::builder()
        .database(&db.url())
        .sql_as(&db.writer().await)
        .arg("--admin-key-file")
        .arg(key_file.display().to_string())
        .spawn()
        .await;
    std::fs::remove_file(&key_file).unwrap();
    let served = gateway.client().get_path("/v1/openapi.json").await;
    assert_eq!(served.status, 200);
    assert_eq!(served.header("content-type"), Some("application/json"));
    assert_eq!(&served.body[..], DOCUMENT.as_bytes());

    let url = format!("{}/v1/openapi.json", gateway.url());
    let output = tokio::task::spawn_blocking(move || {
        Command::new("schemathesis")
            .args([
                "run",
                &url,
                "--seed",
                "1",
                "--generation-database",
                "none",
                "--no-color",
                "--header",
                &format!("Authorization: Bearer {admin}"),
            ])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .output()
    })
    .await
    .unwrap()
    .unwrap_or_else(|e| {
        panic!(
            "schemathesis could not be run ({e}): install it with `pip install schemathesis` \
             (.ci/run does)"
        )
    });
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "schemathesis found failures:\n{report}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(report.contains("passed"), "{report}");
}
