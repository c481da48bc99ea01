//! The benchmark in its smoke mode: it runs to the end against the real gateway and
//! Postgres and reports every row of the matrix. Its figures are not checked: speed is
//! judged by reading the benchmark's table, never by a test.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A liveness bound, not a speed target: the smoke run takes seconds.
const LIVENESS: Duration = Duration::from_secs(300);

#[test]
fn smoke_run_reports_every_row() {
    let json =
        std::env::temp_dir().join(format!("fencegate-bench-smoke-{}.json", std::process::id()));
    let mut child = Command::new(env!("CARGO_BIN_EXE_fencegate-bench"))
        .args(["--smoke", "--json"])
        .arg(&json)
        .stdout(Stdio::null())
        .spawn()
        .expect("the benchmark binary runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for the benchmark works") {
            break status;
        }
        if started.elapsed() > LIVENESS {
            let _ = child.kill();
            panic!("the smoke run did not finish within {LIVENESS:?}");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        status.success(),
        "the smoke run failed with {status} (its stderr is above)"
    );

    let report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("the JSON report was written"))
            .expect("the report is JSON");
    let _ = std::fs::remove_file(&json);
    let rows = report["rows"].as_array().expect("rows");
    let row = |workload: &str, concurrency: u64, resources: Option<u64>, value: u64| {
        rows.iter().find(|row| {
            row["workload"] == workload
                && row["concurrency"] == concurrency
                && row["resources"].as_u64() == resources
                && row["value_bytes"] == value
        })
    };
    let mut expected = 0;
    for value in [100, 10240] {
        for concurrency in [1, 16, 64] {
            let mut cells = vec![("bare-http", None)];
            for resources in [1, 100, 10_000] {
                for workload in ["direct", "gateway-accept", "gateway-reject", "gateway-h2"] {
                    cells.push((workload, Some(resources)));
                }
            }
            for (workload, resources) in cells {
                expected += 1;
                let found = row(workload, concurrency, resources, value).unwrap_or_else(|| {
                    panic!("no row for {workload} c={concurrency} r={resources:?} v={value}")
                });
                assert!(
                    found["ops"].as_u64() > Some(0),
                    "no writes measured: {found}"
                );
                assert_eq!(found["errors"], 0, "unexpected answers: {found}");
                if workload != "direct" {
                    assert!(
                        found["vs_bare_http"].as_f64().is_some(),
                        "no ratio to bare-http: {found}"
                    );
                }
                if workload.starts_with("gateway") {
                    assert!(
                        found["vs_direct"].as_f64().is_some(),
                        "no ratio to direct: {found}"
                    );
                }
            }
        }
    }
    assert_eq!(rows.len(), expected, "exactly one row per cell");

    let memory = &report["memory"];
    assert!(
        memory["cache_entries"].as_u64() >= memory["resources"].as_u64(),
        "the fence cache tracked every resource: {memory}"
    );
    assert!(memory["bytes_per_entry"].as_f64().is_some(), "{memory}");
    let startup = &report["startup"];
    assert!(
        startup["fresh_database_ms"].as_f64() > Some(0.0),
        "{startup}"
    );
    assert!(
        startup["migrated_database_ms"].as_f64() > Some(0.0),
        "{startup}"
    );
}
