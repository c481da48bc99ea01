//! The benchmark: fencegate against the same fenced write sent straight to Postgres,
//! and against a bare HTTP server, in one run on one database, so that the figures
//! can be read as ratios on a noisy machine.
//!
//! # Layout
//!
//! - this module: the flags, and the order of the run.
//! - [`clients`]: the writers (direct SQL, HTTP/1.1 keep-alive, HTTP/2 streams).
//! - [`load`]: closed- and open-loop load, latency histograms.
//! - [`servers`]: the gateway and bare HTTP processes, RSS, time to ready.
//! - [`report`]: the rows, the ratios, the table and the JSON.
//!
//! # The run
//!
//! 1. Start-up time to ready, on a fresh database and on a migrated one.
//! 2. Every resource of the matrix gets its fence raised to [`ACCEPT_TOKEN`] through
//!    the gateway, so its fence cache knows them all before anything is measured.
//! 3. For each value size and concurrency, its cells take turns for `--rounds` rounds:
//!    `bare-http`, then for each resource count `direct`, `gateway-accept`,
//!    `gateway-reject`, `gateway-h2`. Each turn makes its connections, warms up, then
//!    measures. Accepted writes present [`ACCEPT_TOKEN`] (equal to the fence: accepted,
//!    no fence change); rejected ones present [`STALE_TOKEN`].
//! 4. Memory: a second gateway tracks a million distinct resources; its RSS before and
//!    after gives the fence cache's bytes per entry.

mod clients;
mod load;
mod report;
mod servers;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use clap::{Parser, Subcommand, ValueEnum};
use http::StatusCode;

use clients::Writer;
use fencegate_tests::db::TestDb;
use load::{Measured, Pace, Workload};
use report::{Memory, Report, Row, Startup};

/// The token every accepted write presents; the fences are raised to it first.
pub const ACCEPT_TOKEN: u64 = 1000;
/// Below [`ACCEPT_TOKEN`]: rejected from the fence cache.
pub const STALE_TOKEN: u64 = 1;

/// fencegate-bench: the gateway against direct Postgres and bare HTTP, as ratios.
///
/// Needs Postgres (FENCEGATE_TEST_PG, default postgres://postgres@127.0.0.1:5432) and
/// the built gateway: `cargo build --release` builds both this and `fencegate`.
#[derive(Debug, Parser)]
#[command(name = "fencegate-bench", args_conflicts_with_subcommands = true)]
pub struct Args {
    #[command(subcommand)]
    pub command: Option<Command>,

    /// Concurrent writers per cell (comma-separated).
    #[arg(
        long,
        env = "FENCEGATE_BENCH_CONCURRENCY",
        value_delimiter = ',',
        default_value = "1,16,64"
    )]
    pub concurrency: Vec<usize>,

    /// Distinct resources the writes of a cell spread over (comma-separated); 1 makes
    /// every write contend on one fence row.
    #[arg(
        long,
        env = "FENCEGATE_BENCH_RESOURCES",
        value_delimiter = ',',
        default_value = "1,100,10000"
    )]
    pub resources: Vec<usize>,

    /// Value sizes in bytes (comma-separated).
    #[arg(
        long,
        env = "FENCEGATE_BENCH_VALUES",
        value_delimiter = ',',
        default_value = "100,10240"
    )]
    pub values: Vec<usize>,

    /// Workloads to run (comma-separated); all by default.
    #[arg(
        long,
        env = "FENCEGATE_BENCH_WORKLOADS",
        value_delimiter = ',',
        value_enum
    )]
    pub workloads: Vec<Kind>,

    /// Measured time per cell, split evenly over the rounds.
    #[arg(long, env = "FENCEGATE_BENCH_DURATION", default_value = "1500ms", value_parser = humantime::parse_duration)]
    pub duration: Duration,

    /// The cells of one concurrency and value size run in turn, this many times each.
    #[arg(long, env = "FENCEGATE_BENCH_ROUNDS", default_value_t = 3)]
    pub rounds: usize,

    /// Unmeasured time at the start of each turn of a cell.
    #[arg(long, env = "FENCEGATE_BENCH_WARMUP", default_value = "100ms", value_parser = humantime::parse_duration)]
    pub warmup: Duration,

    /// Open loop at this total rate (writes per second) instead of a closed loop.
    #[arg(long, env = "FENCEGATE_BENCH_RATE")]
    pub rate: Option<f64>,

    /// Postgres connections, for the gateway and for the direct baseline alike.
    #[arg(long, env = "FENCEGATE_BENCH_POOL_SIZE", default_value_t = fencegate_gateway::config::DEFAULT_POOL_SIZE)]
    pub pool_size: usize,

    /// Distinct resources the memory measurement tracks; 0 skips it.
    #[arg(
        long,
        env = "FENCEGATE_BENCH_MEMORY_RESOURCES",
        default_value_t = 1_000_000
    )]
    pub memory_resources: usize,

    /// An extra flag for the gateway under load, e.g. `--gateway-arg=--write-lanes=8`;
    /// repeat for several. Settings are compared by running the benchmark once per setting.
    #[arg(long = "gateway-arg", value_name = "FLAG", allow_hyphen_values = true)]
    pub gateway_args: Vec<String>,

    /// The `fencegate` binary; by default the one next to this benchmark.
    #[arg(long, env = "FENCEGATE_BIN")]
    pub gateway_bin: Option<PathBuf>,

    /// Also write the results as JSON to this file.
    #[arg(long, env = "FENCEGATE_BENCH_JSON")]
    pub json: Option<PathBuf>,

    /// A few seconds in all: every row, tiny durations, 20,000 resources for memory.
    /// Checks that the benchmark works; its figures mean nothing.
    #[arg(long)]
    pub smoke: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Serve the bare HTTP baseline (started by the benchmark itself).
    #[command(hide = true)]
    BareHttp {
        #[arg(long)]
        listen: SocketAddr,
    },
    /// Print the gateway's fenced write (FENCED_PUT) as a pgbench script: resource
    /// `r<:r>`, key `k<:k>`, token 1, value `:value` (set them with \set and -D).
    PgbenchScript,
}

/// The workloads, as named in the table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Kind {
    Direct,
    GatewayAccept,
    GatewayReject,
    BareHttp,
    GatewayH2,
}

impl Kind {
    pub const ALL: [Kind; 5] = [
        Kind::Direct,
        Kind::GatewayAccept,
        Kind::GatewayReject,
        Kind::BareHttp,
        Kind::GatewayH2,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Direct => "direct",
            Kind::GatewayAccept => "gateway-accept",
            Kind::GatewayReject => "gateway-reject",
            Kind::BareHttp => "bare-http",
            Kind::GatewayH2 => "gateway-h2",
        }
    }
}

/// Runs the benchmark (or the bare server) as `args` say.
pub async fn main(mut args: Args) -> Result<(), String> {
    match args.command {
        Some(Command::BareHttp { listen }) => {
            return servers::serve_bare(listen).await.map_err(|e| e.to_string())
        }
        Some(Command::PgbenchScript) => {
            println!("{}", pgbench_statement());
            return Ok(());
        }
        None => {}
    }
    if args.smoke {
        args.duration = Duration::from_millis(200);
        args.rounds = 1;
        args.warmup = Duration::from_millis(50);
        args.memory_resources = args.memory_resources.min(20_000);
    }
    if args.workloads.is_empty() {
        args.workloads = Kind::ALL.to_vec();
    }
    let bin = match &args.gateway_bin {
        Some(bin) => bin.clone(),
        None => std::env::current_exe()
            .map_err(|e| e.to_string())?
            .with_file_name("fencegate"),
    };
    if !bin.exists() {
        return Err(format!(
            "{} does not exist: build it with `cargo build --release` (or pass --gateway-bin)",
            bin.display()
        ));
    }

    let db = TestDb::create().await;
    let mut report = Report::new(&args, &db).await;
    eprintln!("start-up time ...");
    report.startup = Some(startup(&bin).await?);

    let mut extra = vec!["--pool-size".to_owned(), args.pool_size.to_string()];
    extra.extend(args.gateway_args.iter().cloned());
    let gateway = servers::gateway(&bin, &db.url(), &extra).await?;
    let bare = servers::bare_http().await?;
    let pool = clients::direct_pool(&db.url(), args.pool_size)?;
    let most = args.resources.iter().copied().max().unwrap_or(1);
    eprintln!("raising the fences of {most} resources ...");
    raise_fences(gateway.addr, "r", 0..most, 64).await?;

    let pace = Pace {
        warmup: args.warmup,
        duration: args.duration / args.rounds.max(1) as u32,
        rate: args.rate,
        min_ops: u64::from(args.smoke),
    };
    let servers = Servers {
        gateway: gateway.addr,
        bare: bare.addr,
        pool: &pool,
    };
    let wants = |w: &Kind| args.workloads.contains(w);
    for &size in &args.values {
        let value = Bytes::from(vec![b'v'; size]);
        for &concurrency in &args.concurrency {
            // The cells of one concurrency and value size take turns, round after
            // round, so that a slow phase of the machine is shared between them and
            // the ratios hold.
            let mut cells: Vec<(Kind, Option<usize>, Option<Measured>)> = Vec::new();
            if wants(&Kind::BareHttp) {
                cells.push((Kind::BareHttp, None, None));
            }
            for &resources in &args.resources {
                for kind in Kind::ALL
                    .iter()
                    .filter(|k| **k != Kind::BareHttp && wants(k))
                {
                    cells.push((*kind, Some(resources), None));
                }
            }
            for _ in 0..args.rounds.max(1) {
                for (kind, resources, total) in &mut cells {
                    let measured = servers
                        .run(*kind, concurrency, resources.unwrap_or(1), &value, pace)
                        .await?;
                    match total {
                        Some(total) => total.merge(measured),
                        None => *total = Some(measured),
                    }
                }
            }
            for (kind, resources, measured) in cells {
                let measured = measured.expect("every cell ran at least once");
                let row = Row::new(kind, concurrency, resources, size, &measured);
                eprintln!("{}", row.brief());
                report.push(row);
            }
        }
    }
    drop((gateway, bare));

    if args.memory_resources > 0 {
        eprintln!(
            "fence cache memory, {} resources ...",
            args.memory_resources
        );
        report.memory = Some(memory(&bin, &db.url(), args.memory_resources).await?);
    }

    report.finish();
    println!("{}", report.markdown());
    if let Some(path) = &args.json {
        report
            .write_json(path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(())
}

fn workload(resources: usize, token: u64, value: &Bytes, expect: &[StatusCode]) -> Arc<Workload> {
    Arc::new(Workload {
        prefix: "r".to_owned(),
        resources,
        token,
        value: value.clone(),
        expect: expect.to_vec(),
    })
}

/// Where each workload is sent.
struct Servers<'a> {
    gateway: SocketAddr,
    bare: SocketAddr,
    pool: &'a deadpool_postgres::Pool,
}

impl Servers<'_> {
    /// One turn of one cell: new writers (connections are made before the clock
    /// starts), then the load.
    async fn run(
        &self,
        kind: Kind,
        concurrency: usize,
        resources: usize,
        value: &Bytes,
        pace: Pace,
    ) -> Result<Measured, String> {
        let accepted = [StatusCode::OK, StatusCode::CREATED];
        let (writers, workload) = match kind {
            Kind::Direct => (
                (0..concurrency)
                    .map(|_| Writer::Direct(self.pool.clone()))
                    .collect(),
                workload(resources, ACCEPT_TOKEN, value, &accepted),
            ),
            Kind::GatewayAccept => (
                http1_writers(self.gateway, concurrency).await?,
                workload(resources, ACCEPT_TOKEN, value, &accepted),
            ),
            Kind::GatewayReject => (
                http1_writers(self.gateway, concurrency).await?,
                workload(resources, STALE_TOKEN, value, &[StatusCode::CONFLICT]),
            ),
            Kind::BareHttp => (
                http1_writers(self.bare, concurrency).await?,
                workload(resources, ACCEPT_TOKEN, value, &[StatusCode::OK]),
            ),
            Kind::GatewayH2 => (
                Writer::h2(self.gateway, concurrency).await?,
                workload(resources, ACCEPT_TOKEN, value, &accepted),
            ),
        };
        Ok(load::run(writers, workload, pace).await)
    }
}

async fn http1_writers(addr: SocketAddr, count: usize) -> Result<Vec<Writer>, String> {
    let mut writers = Vec::with_capacity(count);
    for _ in 0..count {
        writers.push(Writer::http1(addr).await?);
    }
    Ok(writers)
}

/// Raises the fence of `{prefix}{i}` for every `i` in `range` to [`ACCEPT_TOKEN`],
/// through the gateway at `addr`, `streams` at a time on one HTTP/2 connection.
async fn raise_fences(
    addr: SocketAddr,
    prefix: &str,
    range: std::ops::Range<usize>,
    streams: usize,
) -> Result<(), String> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(range.start));
    let tasks: Vec<_> = Writer::h2(addr, streams)
        .await?
        .into_iter()
        .map(|mut writer| {
            let (next, prefix, end) = (Arc::clone(&next), prefix.to_owned(), range.end);
            tokio::spawn(async move {
                loop {
                    let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if i >= end {
                        return Ok::<(), String>(());
                    }
                    clients::advance(&mut writer, &format!("{prefix}{i}"), ACCEPT_TOKEN).await?;
                }
            })
        })
        .collect();
    for task in tasks {
        task.await.map_err(|e| e.to_string())??;
    }
    Ok(())
}

/// Time to ready on a fresh database (the schema is created) and on a migrated one.
async fn startup(bin: &std::path::Path) -> Result<Startup, String> {
    let fresh = TestDb::create().await;
    let cold = servers::time_to_ready(bin, &fresh.url()).await?;
    let mut warm = Vec::new();
    for _ in 0..3 {
        warm.push(servers::time_to_ready(bin, &fresh.url()).await?);
    }
    warm.sort();
    Ok(Startup {
        fresh_database_ms: cold.as_secs_f64() * 1e3,
        migrated_database_ms: warm[1].as_secs_f64() * 1e3,
    })
}

/// RSS of a gateway before and after its fence cache tracks `count` more resources.
async fn memory(bin: &std::path::Path, url: &str, count: usize) -> Result<Memory, String> {
    const WARM: usize = 10_000;
    // Room for every entry, so that nothing is evicted while measuring.
    let capacity = (count + 2 * WARM).to_string();
    // Commits need not wait for the disk here: what is measured is the cache, and the
    // fill then takes seconds instead of minutes.
    let url = format!("{url}?options=-c%20synchronous_commit%3Doff");
    let extra = [
        "--cache-size".to_owned(),
        capacity,
        "--pool-size".to_owned(),
        "32".to_owned(),
    ];
    let gateway = servers::gateway(bin, &url, &extra).await?;
    // Connections, buffers and statement caches settle during the warm-up.
    raise_fences(gateway.addr, "mw", 0..WARM, 128).await?;
    let before = gateway.rss();
    let started = std::time::Instant::now();
    raise_fences(gateway.addr, "m", 0..count, 128).await?;
    let fill_seconds = started.elapsed().as_secs_f64();
    let after = gateway.rss();
    let metrics = fencegate_tests::http::Client::new(format!("http://{}", gateway.addr))
        .try_request(http::Method::GET, "/metrics", &[], Bytes::new())
        .await?
        .body;
    let entries = fencegate_tests::http::metric_value(
        &String::from_utf8_lossy(&metrics),
        "fencegate_fence_cache_entries",
    )
    .unwrap_or(0.0) as usize;
    if entries < count {
        return Err(format!(
            "the fence cache holds {entries} entries after {count} resources were raised:\n{}",
            gateway.log_tail()
        ));
    }
    let key_text: usize = (0..count).map(|i| format!("m{i}").len()).sum();
    Ok(Memory::new(
        count,
        entries,
        before,
        after,
        key_text,
        fill_seconds,
    ))
}

/// The gateway's own fenced write with pgbench variables for its parameters, on one
/// line (pgbench reads a statement per line).
fn pgbench_statement() -> String {
    fencegate_gateway::store::postgres::statements::FENCED_PUT
        .replace("$1", "('r' || :r)")
        .replace("$2", "1")
        .replace("$3", "('k' || :k)")
        .replace("$4", ":value")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
}
