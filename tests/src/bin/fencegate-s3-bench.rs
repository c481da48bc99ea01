//! The S3 door against its unguarded twin, in one run: the same PUTs and GETs sent
//! straight to radosgw and through the door, in interleaved rounds, with the CPU each
//! process spent per request.
//!
//!   cargo build --release -p fencegate-gateway
//!   FENCEGATE_BIN=target/release/fencegate \
//!     cargo run --release -p fencegate-tests --bin fencegate-s3-bench -- [ROUNDS] [SECONDS] [CLIENTS...]
//!
//! (`tests/bench/s3-door.sh` does both.) A throwaway single-node Ceph with radosgw, a
//! database of its own on the local Postgres, and one gateway on it (Postgres store,
//! default flags). Objects are 4 KiB; each client writes its own keys. Direct PUTs are
//! plain PUTs of the key; door PUTs carry a token and go through the mapped layout
//! (intent, write-once upload, fenced commit). GETs read keys written before. CPU per
//! request: utime + stime from `/proc/<pid>/stat` of the gateway, of every `postgres`
//! process (the store's server and backends; the pool's backends live through a cell),
//! and of the Ceph daemons (radosgw, monitor, OSD), over each cell. Results: the median of the rounds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fencegate_tests::db::TestDb;
use fencegate_tests::gateway::Gateway;
use fencegate_tests::s3::door::{DoorFiles, BUCKET, WRITER};
use fencegate_tests::s3::{Radosgw, S3Client};

/// Bytes of every object.
const OBJECT: usize = 4096;

/// Clock ticks per second of `/proc/<pid>/stat`'s times.
const TICKS: f64 = 100.0;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Target {
    Direct,
    Door,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Put,
    Get,
}

/// utime + stime of `pid`, in seconds.
fn cpu_seconds(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // The fields after the command, which is in parentheses and may hold spaces.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks = |at: usize| {
        fields
            .get(at)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // utime and stime are fields 14 and 15 of the whole line: 11 and 12 after it.
    (ticks(11) + ticks(12)) / TICKS
}

fn cpu_of(pids: &[u32]) -> f64 {
    pids.iter().map(|pid| cpu_seconds(*pid)).sum()
}

/// Every process of the machine named `postgres` (the server and its backends).
fn postgres_pids() -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .is_ok_and(|comm| comm.trim() == "postgres")
        })
        .collect()
}

struct Cell {
    per_second: f64,
    gateway_us: f64,
    postgres_us: f64,
    ceph_us: f64,
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = args.first().and_then(|a| a.parse().ok()).unwrap_or(3);
    let seconds: u64 = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(5);
    let clients: Vec<usize> = match args.get(2..) {
        Some(rest) if !rest.is_empty() => rest.iter().filter_map(|a| a.parse().ok()).collect(),
        _ => vec![1, 16],
    };
    let rgw = Radosgw::start().await;
    rgw.client().create_bucket(BUCKET).await;
    let db = TestDb::create().await;
    let files = DoorFiles::new(rgw.access_key(), rgw.secret_key());
    let gateway: Gateway = files
        .builder(&db, &rgw.endpoint())
        .args(&["--pool-size", "16"])
        .spawn()
        .await;
    let door = S3Client::new(format!("http://{}", gateway.s3_addr()), WRITER.0, WRITER.1);
    let direct = rgw.client();
    let ceph = rgw.pids();
    let duration = Duration::from_secs(seconds);
    println!(
        "S3 door vs radosgw direct: {rounds} rounds x {seconds} s per cell, {OBJECT}-byte objects"
    );
    println!("| op | clients | direct req/s | door req/s | door / direct | gateway CPU µs/req (door) | Postgres CPU µs/req (door) | Ceph CPU µs/req direct | Ceph CPU µs/req door |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for kind in [Kind::Put, Kind::Get] {
        for &count in &clients {
            let mut cells: Vec<(Cell, Cell)> = Vec::new();
            for round in 0..rounds {
                let spec = |target| Spec {
                    target,
                    kind,
                    clients: count,
                    duration,
                    round,
                };
                let direct_watch = Watched {
                    gateway: &[],
                    ceph: &ceph,
                };
                let door_watch = Watched {
                    gateway: &[gateway.pid()],
                    ceph: &ceph,
                };
                let direct_cell = measure(spec(Target::Direct), &direct, &direct_watch).await;
                let door_cell = measure(spec(Target::Door), &door, &door_watch).await;
                cells.push((direct_cell, door_cell));
            }
            let median = |pick: &dyn Fn(&(Cell, Cell)) -> f64| {
                let mut values: Vec<f64> = cells.iter().map(pick).collect();
                values.sort_by(f64::total_cmp);
                values[values.len() / 2]
            };
            let (d, g) = (median(&|c| c.0.per_second), median(&|c| c.1.per_second));
            println!(
                "| {} | {count} | {d:.0} | {g:.0} | {:.2} | {:.0} | {:.0} | {:.0} | {:.0} |",
                if kind == Kind::Put { "PUT" } else { "GET" },
                g / d,
                median(&|c| c.1.gateway_us),
                median(&|c| c.1.postgres_us),
                median(&|c| c.0.ceph_us),
                median(&|c| c.1.ceph_us),
            );
        }
    }
}

/// One cell of the table, in one round.
#[derive(Clone, Copy)]
struct Spec {
    target: Target,
    kind: Kind,
    clients: usize,
    duration: Duration,
    round: usize,
}

/// The processes whose CPU a cell reports: the gateway's (none for a direct cell) and
/// the Ceph daemons.
struct Watched<'a> {
    gateway: &'a [u32],
    ceph: &'a [u32],
}

/// One cell: `spec.clients` tasks doing `spec.kind` against `spec.target` through
/// `s3` for `spec.duration`.
async fn measure(spec: Spec, s3: &S3Client, watched: &Watched<'_>) -> Cell {
    let Spec {
        target,
        kind,
        clients,
        duration,
        round,
    } = spec;
    let Watched { gateway, ceph } = *watched;
    let prefix = format!(
        "orders/bench/{}/{}-{round}",
        if target == Target::Door {
            "door"
        } else {
            "direct"
        },
        clients
    );
    let body = bytes::Bytes::from(vec![b'x'; OBJECT]);
    let write = |s3: S3Client, key: String, body: bytes::Bytes| async move {
        let headers: &[(&str, &str)] = match target {
            Target::Door => &[("x-amz-meta-fencing-token", "1")],
            Target::Direct => &[],
        };
        s3.try_put(BUCKET, &key, headers, body).await
    };
    if kind == Kind::Get {
        for client in 0..clients {
            let reply = write(s3.clone(), format!("{prefix}/get-{client}"), body.clone()).await;
            assert!(
                reply.is_ok_and(|r| r.status == 200),
                "a GET cell's object is written"
            );
        }
    }
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let postgres = postgres_pids();
    let (gateway_before, ceph_before) = (cpu_of(gateway), cpu_of(ceph));
    let postgres_before = cpu_of(&postgres);
    let started = Instant::now();
    let tasks: Vec<_> = (0..clients)
        .map(|client| {
            let (s3, done, stop, body, prefix) = (
                s3.clone(),
                Arc::clone(&done),
                Arc::clone(&stop),
                body.clone(),
                prefix.clone(),
            );
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let ok = match kind {
                        Kind::Put => {
                            let key = format!("{prefix}/put-{client}-{n}");
                            let headers: &[(&str, &str)] = match target {
                                Target::Door => &[("x-amz-meta-fencing-token", "1")],
                                Target::Direct => &[],
                            };
                            answered(s3.try_put(BUCKET, &key, headers, body.clone()).await)
                        }
                        Kind::Get => answered(
                            s3.try_request_path(
                                http::Method::GET,
                                &fencegate_tests::s3::client::object_path(
                                    BUCKET,
                                    &format!("{prefix}/get-{client}"),
                                ),
                                &[],
                                "",
                            )
                            .await,
                        ),
                    };
                    if let Err(failed) = ok {
                        panic!("a request of the benchmark failed: {failed}");
                    }
                    n += 1;
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    tokio::time::sleep(duration).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.expect("a client task");
    }
    let elapsed = started.elapsed().as_secs_f64();
    let requests = done.load(Ordering::Relaxed).max(1) as f64;
    Cell {
        per_second: requests / elapsed,
        gateway_us: (cpu_of(gateway) - gateway_before) / requests * 1e6,
        postgres_us: (cpu_of(&postgres) - postgres_before) / requests * 1e6,
        ceph_us: (cpu_of(ceph) - ceph_before) / requests * 1e6,
    }
}

/// Ok for a 200, else what came back.
fn answered(reply: Result<fencegate_tests::http::Reply, String>) -> Result<(), String> {
    match reply {
        Ok(reply) if reply.status == 200 => Ok(()),
        Ok(reply) => Err(format!(
            "{} {}",
            reply.status,
            String::from_utf8_lossy(&reply.body)
        )),
        Err(error) => Err(error),
    }
}
