//! `fencegate-replay` against a deployment it did not start: the library runs through
//! the command's own delaying hop; steps that need process control are refused, and
//! the exit code says so.

use std::path::{Path, PathBuf};
use std::process::Output;

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;

fn scenarios() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("scenarios")
}

async fn replay(args: &[&str]) -> Output {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_fencegate-replay"))
        .args(args)
        .env_remove("FENCEGATE_REPLAY_GATEWAY")
        .output();
    tokio::time::timeout(std::time::Duration::from_secs(120), output)
        .await
        .expect("the replay finishes within 120 s")
        .expect("the replay command runs")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_library_runs_against_an_external_gateway() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    let dir = scenarios();
    let url = gateway.url();
    let database = db.url();
    let args = [
        dir.to_str().unwrap(),
        "--gateway",
        &url,
        "--lease-database-url",
        &database,
        "--control-database-url",
        &database,
    ];

    let strict = replay(&args).await;
    let text = stdout(&strict);
    assert_eq!(
        strict.status.code(),
        Some(1),
        "refusals fail by default:\n{text}"
    );
    for refused in [
        "09-gateway-restart",
        "10-two-replicas",
        "11-database-outage",
        "13-commit-reply-delayed",
        "14-keyed-retry",
        "16-etcd-pause",
        "17-zookeeper-pause",
    ] {
        assert!(
            text.contains(&format!("REFUSED {refused}")),
            "{refused} is refused:\n{text}"
        );
    }
    assert!(text.contains("10 passed, 0 failed, 7 refused"), "{text}");
    assert!(
        text.contains("(control: no fencing, straight to Postgres)"),
        "control runs were made:\n{text}"
    );
    assert!(
        !text.contains("restart_gateway"),
        "a refused step never runs:\n{text}"
    );

    let restart = dir.join("09-gateway-restart.toml");
    let lenient = replay(&[
        restart.to_str().unwrap(),
        "--gateway",
        &url,
        "--allow-refused",
    ])
    .await;
    let text = stdout(&lenient);
    assert_eq!(lenient.status.code(), Some(0), "{text}");
    assert!(text.contains("0 passed, 0 failed, 1 refused"), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mismatch_exits_non_zero_with_the_step() {
    let db = TestDb::create().await;
    let gateway = Gateway::builder().database(&db.url()).spawn().await;
    let original = std::fs::read_to_string(scenarios().join("01-delayed-request.toml")).unwrap();
    let broken = original.replace(
        "expect = { outcome = \"rejected\", presented = 7, highest = 8 }",
        "expect = { outcome = \"accepted\" }",
    );
    assert_ne!(broken, original);
    let file = std::env::temp_dir().join(format!("replay-broken-{}.toml", std::process::id()));
    std::fs::write(&file, broken).unwrap();

    let output = replay(&[file.to_str().unwrap(), "--gateway", &gateway.url()]).await;
    let _ = std::fs::remove_file(&file);
    let text = stdout(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(
        text.contains("FAILED 01-delayed-request: step 6 differs"),
        "{text}"
    );
    assert!(text.contains("expected: outcome=accepted"), "{text}");
    assert!(text.contains("observed: outcome=rejected"), "{text}");
    assert!(text.contains("0 passed, 1 failed, 0 refused"), "{text}");
}
