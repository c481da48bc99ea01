//! The load generator: N writers, closed-loop or open-loop, into one latency histogram.
//!
//! # Loops
//!
//! - Closed loop (the default): each writer sends its next write as soon as the
//!   previous one is answered. Throughput is what the system sustains at that
//!   concurrency.
//! - Open loop (`rate`): writes are due at a fixed total rate, spread evenly over the
//!   writers. Latency is measured from when a write was *due*, not from when it was
//!   sent, so a stalled server is charged for the writes it held back (no coordinated
//!   omission).
//!
//! A write counts if it completes within the measured window (after the warm-up),
//! whenever it began.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use hdrhistogram::Histogram;
use http::StatusCode;
use tokio::time::Instant;

use super::clients::{Call, Writer};

/// Latencies are recorded in nanoseconds, up to a minute, to three significant digits.
const MAX_LATENCY_NS: u64 = 60_000_000_000;

/// What every writer of one cell sends.
pub struct Workload {
    /// Writes go to resources `{prefix}0 .. {prefix}{resources - 1}`, round-robin.
    pub prefix: String,
    pub resources: usize,
    pub token: u64,
    pub value: Bytes,
    pub expect: Vec<StatusCode>,
}

/// How long, and at what pace.
#[derive(Debug, Clone, Copy)]
pub struct Pace {
    pub warmup: Duration,
    pub duration: Duration,
    /// Total writes per second (open loop); `None` for a closed loop.
    pub rate: Option<f64>,
    /// Writes each writer completes even past the window (smoke runs: 1, so that a
    /// loaded machine still yields a row with writes in it; full runs: 0).
    pub min_ops: u64,
}

/// What one cell measured.
pub struct Measured {
    pub ops: u64,
    pub errors: u64,
    /// The first error message seen, for the report.
    pub first_error: Option<String>,
    pub seconds: f64,
    pub latency: Histogram<u64>,
}

impl Measured {
    /// Adds another turn of the same cell.
    pub fn merge(&mut self, other: Measured) {
        self.ops += other.ops;
        self.errors += other.errors;
        self.seconds += other.seconds;
        self.first_error = self.first_error.take().or(other.first_error);
        self.latency
            .add(&other.latency)
            .expect("histograms with equal bounds merge");
    }

    pub fn throughput(&self) -> f64 {
        self.ops as f64 / self.seconds
    }

    /// The latency at `quantile`, in milliseconds.
    pub fn ms(&self, quantile: f64) -> f64 {
        self.latency.value_at_quantile(quantile) as f64 / 1e6
    }

    pub fn max_ms(&self) -> f64 {
        self.latency.max() as f64 / 1e6
    }
}

/// Runs `writers` against `workload` for `pace`, and merges what they measured.
pub async fn run(writers: Vec<Writer>, workload: Arc<Workload>, pace: Pace) -> Measured {
    let count = writers.len();
    let start = Instant::now() + Duration::from_millis(5);
    let window = (start + pace.warmup, start + pace.warmup + pace.duration);
    let tasks: Vec<_> = writers
        .into_iter()
        .enumerate()
        .map(|(index, writer)| {
            let workload = Arc::clone(&workload);
            tokio::spawn(drive(writer, index, count, workload, pace, start, window))
        })
        .collect();
    let mut total = Measured {
        ops: 0,
        errors: 0,
        first_error: None,
        seconds: pace.duration.as_secs_f64(),
        latency: new_histogram(),
    };
    for task in tasks {
        let part = task.await.expect("a writer task does not panic");
        total.ops += part.ops;
        total.errors += part.errors;
        total.first_error = total.first_error.or(part.first_error);
        total
            .latency
            .add(&part.latency)
            .expect("histograms with equal bounds merge");
    }
    total
}

async fn drive(
    mut writer: Writer,
    index: usize,
    count: usize,
    workload: Arc<Workload>,
    pace: Pace,
    start: Instant,
    (measure_from, end): (Instant, Instant),
) -> Measured {
    let mut measured = Measured {
        ops: 0,
        errors: 0,
        first_error: None,
        seconds: pace.duration.as_secs_f64(),
        latency: new_histogram(),
    };
    // Each writer keeps to its own key, so that writers meet only on the fence row.
    let key = format!("w{index}");
    let resources: Vec<String> = (0..workload.resources)
        .map(|r| format!("{}{r}", workload.prefix))
        .collect();
    // Open loop: this writer's share of the rate, offset so writers interleave.
    let interval = pace
        .rate
        .map(|rate| Duration::from_secs_f64(count as f64 / rate));
    let mut due =
        start + interval.map_or(Duration::ZERO, |i| i.mul_f64(index as f64 / count as f64));
    tokio::time::sleep_until(start).await;
    for n in 0u64.. {
        let began = match interval {
            Some(interval) => {
                tokio::time::sleep_until(due).await;
                due += interval;
                due - interval
            }
            None => Instant::now(),
        };
        if Instant::now() >= end && measured.ops >= pace.min_ops {
            break;
        }
        let resource = &resources[(n as usize * count + index) % resources.len()];
        let call = Call {
            resource,
            key: &key,
            token: workload.token,
            value: &workload.value,
            expect: &workload.expect,
        };
        let result = writer.call(&call).await;
        let done = Instant::now();
        // Counted by completion: a write that began in the warm-up and ends in the
        // window is part of the window's throughput.
        if done < measure_from || (done > end && measured.ops >= pace.min_ops) {
            continue;
        }
        measured.ops += 1;
        let nanos = u64::try_from((done - began).as_nanos()).unwrap_or(MAX_LATENCY_NS);
        measured.latency.saturating_record(nanos.max(1));
        match result {
            Ok(true) => {}
            Ok(false) => {
                measured.errors += 1;
                measured
                    .first_error
                    .get_or_insert_with(|| "unexpected answer".to_owned());
            }
            Err(error) => {
                measured.errors += 1;
                measured.first_error.get_or_insert(error);
            }
        }
    }
    measured
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, MAX_LATENCY_NS, 3).expect("valid histogram bounds")
}
