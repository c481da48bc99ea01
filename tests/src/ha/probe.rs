//! How long a gateway took no writes: a few tasks write through it, each one write
//! after another, to a resource of their own with a token of their own, and note when
//! each write was acknowledged. The longest gap between acknowledgements after a fault
//! and its end say how long the outage lasted for that gateway, with its flags (e.g.
//! `--require-synchronous-replication`) — apart from any writer's lease turns.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::history;
use crate::http::{kv_path, Client};

/// Tasks per probe: a write that hangs until the backend deadline does not hide when
/// writes resumed.
const TASKS: usize = 2;

/// The pause after each write of a task.
const PAUSE: Duration = Duration::from_millis(50);

/// How long one write may take: well above a gateway's backend deadline.
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Writes through one gateway until stopped, noting when each was acknowledged.
pub struct Probe {
    /// What the gateway is, for the figures, e.g. `haproxy`.
    pub label: String,
    /// When each acknowledged write's answer came ([`history::now`]), in no order.
    acknowledged: Arc<Mutex<Vec<u64>>>,
    cancel: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
}

/// An outage one probe saw after a fault.
#[derive(Debug, Clone, Copy)]
pub struct Outage {
    /// The longest time without an acknowledged write, counted from the fault on.
    pub longest_gap: Duration,
    /// From the fault to the first acknowledged write that ended that gap.
    pub fault_to_write: Duration,
}

impl Probe {
    /// Starts writing through `gateway`: `PUT` with fencing token 1, which stays
    /// current since nothing else writes the probe's resource.
    pub fn start(label: &str, gateway: Client) -> Probe {
        let resource = format!("probe-{:08x}", rand::random::<u32>());
        let acknowledged = Arc::new(Mutex::new(Vec::new()));
        let cancel = CancellationToken::new();
        let tasks = (0..TASKS)
            .map(|task| {
                let path = kv_path(&resource, &format!("k{task}"));
                let gateway = gateway.clone();
                let acknowledged = Arc::clone(&acknowledged);
                let cancel = cancel.clone();
                tokio::spawn(async move {
                    let mut n = 0u64;
                    while !cancel.is_cancelled() {
                        n += 1;
                        let write = gateway.try_request(
                            http::Method::PUT,
                            &path,
                            &[("fencing-token", "1")],
                            n.to_string(),
                        );
                        let reply = tokio::select! {
                            reply = tokio::time::timeout(WRITE_TIMEOUT, write) => reply,
                            () = cancel.cancelled() => break,
                        };
                        if let Ok(Ok(reply)) = reply {
                            if reply.status / 100 == 2 {
                                acknowledged.lock().unwrap().push(history::now());
                            }
                        }
                        tokio::time::sleep(PAUSE).await;
                    }
                })
            })
            .collect();
        Probe {
            label: label.to_owned(),
            acknowledged,
            cancel,
            tasks,
        }
    }

    /// Whether a write was acknowledged after `instant`.
    pub fn acknowledged_after(&self, instant: u64) -> bool {
        self.acknowledged
            .lock()
            .unwrap()
            .iter()
            .any(|&at| at > instant)
    }

    /// The outage from `fault_at` until now.
    pub fn outage(&self, fault_at: u64) -> Outage {
        let answers = self.acknowledged.lock().unwrap().clone();
        let (longest_gap, end) = longest_gap(answers, fault_at);
        Outage {
            longest_gap,
            fault_to_write: Duration::from_nanos(end.saturating_sub(fault_at)),
        }
    }

    /// Stops the tasks.
    pub async fn stop(self) {
        self.cancel.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
    }
}

/// The longest time between two of `answers` (instants of [`history::now`], in any
/// order), counted from `from` — the last answer before it opens the first gap — and
/// when that gap closed; `from` itself if there is no gap.
pub fn longest_gap(mut answers: Vec<u64>, from: u64) -> (Duration, u64) {
    answers.sort_unstable();
    let first = answers.partition_point(|&at| at < from).saturating_sub(1);
    answers
        .get(first..)
        .unwrap_or_default()
        .windows(2)
        .map(|pair| (pair[1] - pair[0], pair[1]))
        .max()
        .map_or((Duration::ZERO, from), |(gap, end)| {
            (Duration::from_nanos(gap), end)
        })
}
