//! A measurement, not a test: the median latency of a one-statement fenced SQL
//! transaction through the gateway against the same statement sent straight to
//! Postgres, in one run. Ignored by default; run it on a release build:
//!
//! ```sh
//! cargo build --release -p fencegate-gateway
//! cargo test --release -p fencegate-tests --test it sql_latency:: -- --ignored --nocapture
//! ```

use std::time::{Duration, Instant};

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use http::Method;
use serde_json::json;

const WARMUP: usize = 200;
const SAMPLES: usize = 2000;

const UPDATE: &str = "UPDATE sweep_state SET last_epoch = $1, note = $2 WHERE id = 1";

fn median(mut samples: Vec<Duration>) -> Duration {
    samples.sort();
    samples[samples.len() / 2]
}

fn percentile(samples: &[Duration], p: f64) -> Duration {
    let mut sorted = samples.to_vec();
    sorted.sort();
    sorted[((sorted.len() as f64 * p) as usize).min(sorted.len() - 1)]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a measurement: run with --ignored --nocapture on a release build"]
async fn one_statement_latency_gateway_vs_direct() {
    let db = TestDb::create().await;
    let postgres = db.client().await;
    postgres
        .batch_execute(
            "CREATE TABLE sweep_state (id int PRIMARY KEY, last_epoch bigint NOT NULL, note text);
             INSERT INTO sweep_state VALUES (1, 0, 'never swept');",
        )
        .await
        .unwrap();
    let gateway = Gateway::with_sql(&db).await;
    let client = gateway.client();
    let body =
        json!({"statements": [{"sql": UPDATE, "params": [2, "sweep by node-b"]}]}).to_string();
    let prepared = postgres.prepare(UPDATE).await.unwrap();

    let mut through_gateway = Vec::with_capacity(SAMPLES);
    let mut direct_prepared = Vec::with_capacity(SAMPLES);
    let mut direct_unprepared = Vec::with_capacity(SAMPLES);
    // Interleaved, so that both see the same machine load.
    for i in 0..WARMUP + SAMPLES {
        let started = Instant::now();
        let reply = client
            .request(
                Method::POST,
                "/v1/sql/sweeper",
                &[("fencing-token", "2")],
                body.clone(),
            )
            .await;
        let gateway_time = started.elapsed();
        assert_eq!(reply.status, 200, "{:?}", reply.body);

        let started = Instant::now();
        postgres
            .execute(&prepared, &[&2i64, &"sweep by node-b"])
            .await
            .unwrap();
        let prepared_time = started.elapsed();

        let started = Instant::now();
        postgres
            .execute(UPDATE, &[&2i64, &"sweep by node-b"])
            .await
            .unwrap();
        let unprepared_time = started.elapsed();

        if i >= WARMUP {
            through_gateway.push(gateway_time);
            direct_prepared.push(prepared_time);
            direct_unprepared.push(unprepared_time);
        }
    }
    for (name, samples) in [
        (
            "gateway POST /v1/sql (fenced transaction)",
            &through_gateway,
        ),
        ("direct, prepared once", &direct_prepared),
        ("direct, prepared per call", &direct_unprepared),
    ] {
        println!(
            "{name:45} median {:>8.1?}  p90 {:>8.1?}  p99 {:>8.1?}  (n={})",
            median(samples.clone()),
            percentile(samples, 0.90),
            percentile(samples, 0.99),
            samples.len()
        );
    }
}
