//! What a run measured: rows, ratios, the targets, and their table and JSON forms.
//!
//! Ratios compare rows of one run only: `vs direct` is throughput over the `direct` row
//! of the same concurrency, resource count and value size; `vs bare-http` is over the
//! `bare-http` row of the same concurrency and value size.

use std::path::Path;

use serde::Serialize;

use super::load::Measured;
use super::{Args, Kind};
use fencegate_tests::db::TestDb;

/// The targets, checked on every run.
const ACCEPT_VS_DIRECT: f64 = 0.90;
const REJECT_VS_BARE: f64 = 0.80;
const ADDED_P50_MS: f64 = 0.3;
const ADDED_P99_MS: f64 = 1.0;
/// The concurrency the latency targets are stated for.
const LATENCY_TARGET_CONCURRENCY: usize = 16;
const CACHE_BYTES_PER_ENTRY: f64 = 128.0;

#[derive(Debug, Serialize)]
pub struct Report {
    pub machine: Machine,
    pub settings: Settings,
    pub startup: Option<Startup>,
    pub memory: Option<Memory>,
    pub rows: Vec<Row>,
    /// One line per missed target; empty when every target holds.
    pub missed_targets: Vec<String>,
}

#[derive(Debug, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub memory_gib: f64,
    pub kernel: String,
    pub postgres: String,
    pub commit: String,
}

#[derive(Debug, Serialize)]
pub struct Settings {
    pub duration_ms: u128,
    pub rounds: usize,
    pub warmup_ms: u128,
    pub open_loop_rate: Option<f64>,
    pub pool_size: usize,
    pub gateway_args: Vec<String>,
    pub smoke: bool,
}

#[derive(Debug, Serialize)]
pub struct Startup {
    pub fresh_database_ms: f64,
    pub migrated_database_ms: f64,
}

#[derive(Debug, Serialize)]
pub struct Memory {
    pub resources: usize,
    pub cache_entries: usize,
    pub rss_before_bytes: u64,
    pub rss_after_bytes: u64,
    pub bytes_per_entry: f64,
    /// `bytes_per_entry` less the average length of the resource names.
    pub bytes_per_entry_excluding_key_text: f64,
    pub fill_seconds: f64,
}

impl Memory {
    pub fn new(
        resources: usize,
        cache_entries: usize,
        before: u64,
        after: u64,
        key_text: usize,
        fill_seconds: f64,
    ) -> Memory {
        let per_entry = after.saturating_sub(before) as f64 / resources as f64;
        Memory {
            resources,
            cache_entries,
            rss_before_bytes: before,
            rss_after_bytes: after,
            bytes_per_entry: per_entry,
            bytes_per_entry_excluding_key_text: per_entry - key_text as f64 / resources as f64,
            fill_seconds,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Row {
    pub workload: &'static str,
    pub concurrency: usize,
    /// `None` for `bare-http`, which has no resources.
    pub resources: Option<usize>,
    pub value_bytes: usize,
    pub ops: u64,
    pub errors: u64,
    pub first_error: Option<String>,
    pub ops_per_second: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
    pub vs_direct: Option<f64>,
    pub vs_bare_http: Option<f64>,
    pub added_p50_ms: Option<f64>,
    pub added_p99_ms: Option<f64>,
}

impl Row {
    pub fn new(
        kind: Kind,
        concurrency: usize,
        resources: Option<usize>,
        value_bytes: usize,
        measured: &Measured,
    ) -> Row {
        Row {
            workload: kind.name(),
            concurrency,
            resources,
            value_bytes,
            ops: measured.ops,
            errors: measured.errors,
            first_error: measured.first_error.clone(),
            ops_per_second: measured.throughput(),
            p50_ms: measured.ms(0.5),
            p99_ms: measured.ms(0.99),
            p999_ms: measured.ms(0.999),
            max_ms: measured.max_ms(),
            vs_direct: None,
            vs_bare_http: None,
            added_p50_ms: None,
            added_p99_ms: None,
        }
    }

    /// One progress line.
    pub fn brief(&self) -> String {
        format!(
            "{:<15} c={:<3} r={:<6} v={:<6} {:>9.0} ops/s  p50 {:.3} ms  p99 {:.3} ms  errors {}",
            self.workload,
            self.concurrency,
            self.resources.map_or("-".to_owned(), |r| r.to_string()),
            self.value_bytes,
            self.ops_per_second,
            self.p50_ms,
            self.p99_ms,
            self.errors
        )
    }
}

impl Report {
    pub async fn new(args: &Args, db: &TestDb) -> Report {
        let postgres: String = db
            .client()
            .await
            .query_one("SHOW server_version", &[])
            .await
            .map(|row| row.get(0))
            .unwrap_or_default();
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let field = |text: &str, name: &str| {
            text.lines()
                .find(|line| line.starts_with(name))
                .and_then(|line| line.split(':').nth(1))
                .map(|value| value.trim().to_owned())
                .unwrap_or_default()
        };
        let memory_kib: f64 = field(&meminfo, "MemTotal")
            .trim_end_matches("kB")
            .trim()
            .parse()
            .unwrap_or(0.0);
        let commit = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|out| out.status.success())
            .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
            .unwrap_or_default();
        Report {
            machine: Machine {
                cpu: field(&cpuinfo, "model name"),
                cores: std::thread::available_parallelism().map_or(0, |n| n.get()),
                memory_gib: (memory_kib / (1024.0 * 1024.0) * 10.0).round() / 10.0,
                kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                    .unwrap_or_default()
                    .trim()
                    .to_owned(),
                postgres,
                commit,
            },
            settings: Settings {
                duration_ms: args.duration.as_millis(),
                rounds: args.rounds,
                warmup_ms: args.warmup.as_millis(),
                open_loop_rate: args.rate,
                pool_size: args.pool_size,
                gateway_args: args.gateway_args.clone(),
                smoke: args.smoke,
            },
            startup: None,
            memory: None,
            rows: Vec::new(),
            missed_targets: Vec::new(),
        }
    }

    pub fn push(&mut self, row: Row) {
        self.rows.push(row);
    }

    /// Fills in the ratios and checks the targets.
    pub fn finish(&mut self) {
        let find = |rows: &[Row], kind: Kind, c: usize, r: Option<usize>, v: usize| {
            rows.iter().position(|row| {
                row.workload == kind.name()
                    && row.concurrency == c
                    && row.resources == r
                    && row.value_bytes == v
            })
        };
        let mut missed = Vec::new();
        for i in 0..self.rows.len() {
            let row = &self.rows[i];
            let (c, r, v) = (row.concurrency, row.resources, row.value_bytes);
            let direct = find(&self.rows, Kind::Direct, c, r, v).map(|d| {
                let d = &self.rows[d];
                (d.ops_per_second, d.p50_ms, d.p99_ms)
            });
            let bare = find(&self.rows, Kind::BareHttp, c, None, v)
                .map(|b| (self.rows[b].ops_per_second, self.rows[b].p50_ms));
            let row = &mut self.rows[i];
            if row.workload != Kind::Direct.name() {
                if let Some((ops, p50, p99)) = direct {
                    row.vs_direct = Some(row.ops_per_second / ops);
                    if row.workload != Kind::GatewayReject.name() {
                        row.added_p50_ms = Some(row.p50_ms - p50);
                        row.added_p99_ms = Some(row.p99_ms - p99);
                    }
                }
                if let Some((bare, _)) = bare {
                    row.vs_bare_http = Some(row.ops_per_second / bare);
                }
            }
            let at = format!(
                "c={c} r={} v={v}",
                r.map_or("-".to_owned(), |r| r.to_string())
            );
            if row.workload == Kind::GatewayAccept.name() {
                if let Some(ratio) = row.vs_direct.filter(|&x| x < ACCEPT_VS_DIRECT) {
                    // One closed-loop writer is bound by latency: no HTTP gateway can beat
                    // direct latency plus one bare HTTP round trip.
                    let ceiling = match (c, direct, bare) {
                        (1, Some((_, direct_p50, _)), Some((_, bare_p50))) => format!(
                            "; any HTTP hop here allows about {:.2}",
                            direct_p50 / (direct_p50 + bare_p50)
                        ),
                        _ => String::new(),
                    };
                    missed.push(format!(
                        "gateway-accept {at}: {ratio:.2} x direct (target >= {ACCEPT_VS_DIRECT}{ceiling})"
                    ));
                }
                if c == LATENCY_TARGET_CONCURRENCY {
                    if let Some(added) = row.added_p50_ms.filter(|&x| x > ADDED_P50_MS) {
                        missed.push(format!("gateway-accept {at}: added p50 {added:.3} ms (target <= {ADDED_P50_MS})"));
                    }
                    if let Some(added) = row.added_p99_ms.filter(|&x| x > ADDED_P99_MS) {
                        missed.push(format!("gateway-accept {at}: added p99 {added:.3} ms (target <= {ADDED_P99_MS})"));
                    }
                }
            }
            if row.workload == Kind::GatewayReject.name() {
                if let Some(ratio) = row.vs_bare_http.filter(|&x| x < REJECT_VS_BARE) {
                    missed.push(format!(
                        "gateway-reject {at}: {ratio:.2} x bare-http (target >= {REJECT_VS_BARE})"
                    ));
                }
            }
            if row.errors > 0 {
                missed.push(format!(
                    "{} {at}: {} unexpected answers, first: {}",
                    row.workload,
                    row.errors,
                    row.first_error.as_deref().unwrap_or("?")
                ));
            }
        }
        if let Some(memory) = &self.memory {
            if memory.bytes_per_entry_excluding_key_text > CACHE_BYTES_PER_ENTRY {
                missed.push(format!(
                    "fence cache: {:.0} bytes per entry excluding key text (target <= {CACHE_BYTES_PER_ENTRY})",
                    memory.bytes_per_entry_excluding_key_text
                ));
            }
        }
        self.missed_targets = missed;
    }

    /// The results as Markdown, ready to paste into BENCHMARKS.md.
    pub fn markdown(&self) -> String {
        let m = &self.machine;
        let s = &self.settings;
        let mut out = format!(
            "Machine: {} ({} cores), {} GiB, Linux {}, PostgreSQL {}; commit {}.\n\
             Per cell: {} ms measured in {} turns, each after {} ms warm-up, {}; pool size {}{}.\n\n",
            m.cpu,
            m.cores,
            m.memory_gib,
            m.kernel,
            m.postgres,
            m.commit,
            s.duration_ms,
            s.rounds,
            s.warmup_ms,
            s.open_loop_rate
                .map_or("closed loop".to_owned(), |r| format!(
                    "open loop at {r} writes/s"
                )),
            s.pool_size,
            if s.gateway_args.is_empty() {
                String::new()
            } else {
                format!("; gateway flags `{}`", s.gateway_args.join(" "))
            }
        );
        out.push_str(
            "| workload | conc | resources | value B | ops/s | p50 ms | p99 ms | p99.9 ms | max ms | vs direct | vs bare-http | errors |\n\
             |---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n",
        );
        let ratio = |x: Option<f64>| x.map_or("".to_owned(), |x| format!("{x:.2}"));
        for row in &self.rows {
            out.push_str(&format!(
                "| {} | {} | {} | {} | {:.0} | {:.3} | {:.3} | {:.3} | {:.3} | {} | {} | {} |\n",
                row.workload,
                row.concurrency,
                row.resources.map_or("-".to_owned(), |r| r.to_string()),
                row.value_bytes,
                row.ops_per_second,
                row.p50_ms,
                row.p99_ms,
                row.p999_ms,
                row.max_ms,
                ratio(row.vs_direct),
                ratio(row.vs_bare_http),
                row.errors
            ));
        }
        if let Some(startup) = &self.startup {
            out.push_str(&format!(
                "\nStart-up to ready: {:.0} ms on a fresh database (schema created), {:.0} ms on a migrated one.\n",
                startup.fresh_database_ms, startup.migrated_database_ms
            ));
        }
        if let Some(memory) = &self.memory {
            out.push_str(&format!(
                "Fence cache: RSS {:.1} MiB -> {:.1} MiB for {} more resources ({} entries): \
                 {:.0} bytes per entry, {:.0} excluding the key text.\n",
                memory.rss_before_bytes as f64 / 1048576.0,
                memory.rss_after_bytes as f64 / 1048576.0,
                memory.resources,
                memory.cache_entries,
                memory.bytes_per_entry,
                memory.bytes_per_entry_excluding_key_text
            ));
        }
        if self.missed_targets.is_empty() {
            out.push_str("\nEvery target holds.\n");
        } else {
            out.push_str("\nMissed targets:\n");
            for line in &self.missed_targets {
                out.push_str(&format!("- {line}\n"));
            }
        }
        out
    }

    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).expect("a report serializes");
        std::fs::write(path, text + "\n")
    }
}
