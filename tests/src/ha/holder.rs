//! A lease holder through one gateway, as an application runs one: the Rust client's
//! elector (`fencegate-lease`) on a hosted lease of its own, with the client's default
//! timing scaled to a ttl (renew every ttl/3, retry a failed renewal every ttl/30, step
//! down ttl·13/15 after the last successful renewal was sent).
//!
//! `deploy/patroni/README.md` says which outages a ttl rides out; [`Held`] says whether
//! this holder did: it kept its term if the term it acquired before the fault never
//! ended and was renewed, same token, after the cluster had recovered.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use fencegate_lease::{
    Elector, FencedClient, GatewayStore, LeaseConfig, LossReason, Term, Transition,
};
use fencegate_proto::Token;
use tokio::sync::broadcast::error::RecvError;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::history;
use crate::lease::next_transition;

/// Holds a lease through one gateway until stopped, noting every transition.
pub struct Holder {
    /// What the gateway is, e.g. `haproxy`.
    pub label: String,
    config: LeaseConfig,
    /// Each transition, with when the harness saw it ([`history::now`]), in order.
    transitions: Arc<Mutex<Vec<(u64, Transition)>>>,
    shutdown: CancellationToken,
    elector: JoinHandle<()>,
    collector: JoinHandle<()>,
}

/// How a holder's first term fared through a fault.
#[derive(Debug)]
pub struct Held {
    pub label: String,
    pub term: Token,
    /// Why the term ended before the holder was stopped, and when, in seconds from
    /// the fault.
    pub lost: Option<(LossReason, f64)>,
    /// The terms the holder acquired after it lost the first.
    pub later_terms: Vec<Token>,
    /// Whether a renewal of the term succeeded after the cluster recovered.
    pub renewed_after_recovery: bool,
    /// The longest time from a successful renewal's send to the next one's, or to the
    /// loss: the holder steps down when it reaches `renew_deadline`.
    pub longest_unrenewed: Duration,
    pub renew_deadline: Duration,
}

impl Holder {
    /// Starts a holder of a new lease `lease` through the gateway at `url`, and waits
    /// until it has acquired it.
    /// It may take up to `patience` to acquire it: the gateway may still be waiting for
    /// a synchronous standby after the previous fault.
    pub async fn start(
        label: &str,
        url: &str,
        lease: &str,
        ttl: Duration,
        patience: Duration,
    ) -> Holder {
        let config = LeaseConfig::with_lease(ttl);
        let store = GatewayStore::new(FencedClient::new(url).expect("a gateway URL"));
        let elector = Elector::new(store, lease, &format!("holder-{lease}"), config)
            .expect("valid lease timing and names");
        let mut events = elector.subscribe();
        let mut first = elector.subscribe();
        let transitions = Arc::new(Mutex::new(Vec::new()));
        let collector = tokio::spawn({
            let transitions = Arc::clone(&transitions);
            async move {
                loop {
                    match events.recv().await {
                        Ok(event) => transitions.lock().unwrap().push((history::now(), event)),
                        Err(RecvError::Lagged(n)) => panic!("missed {n} transitions"),
                        Err(RecvError::Closed) => break,
                    }
                }
            }
        });
        let shutdown = CancellationToken::new();
        let elector = tokio::spawn({
            let shutdown = shutdown.clone();
            async move {
                elector
                    .run(shutdown, |term: Term| async move { term.cancelled().await })
                    .await;
            }
        });
        next_transition(&mut first, patience, |t| {
            matches!(t, Transition::Acquired { .. })
        })
        .await;
        Holder {
            label: label.to_owned(),
            config,
            transitions,
            shutdown,
            elector,
            collector,
        }
    }

    /// Whether the holder's fate is known after `instant`: its first term was renewed
    /// after it, or the term has ended.
    pub fn settled_after(&self, instant: u64) -> bool {
        let transitions = self.transitions.lock().unwrap();
        let term = transitions[0].1.epoch();
        transitions.iter().any(|(seen, t)| match t {
            Transition::Renewed { epoch, .. } => *epoch == term && *seen > instant,
            Transition::Lost { .. } => true,
            Transition::Acquired { .. } => false,
        })
    }

    /// How the first term fared, from `fault_at` on, until now; then stops the holder
    /// (it hands the lease back).
    pub async fn stop(self, fault_at: u64, recovered_at: u64) -> Held {
        let transitions = self.transitions.lock().unwrap().clone();
        self.shutdown.cancel();
        self.elector
            .await
            .expect("the elector finished without panicking");
        self.collector.await.expect("the collector finished");

        let term = transitions[0].1.epoch();
        // The send instant of each successful acquisition or renewal, then the loss.
        let mut instants = Vec::new();
        let mut lost = None;
        let mut later_terms = Vec::new();
        let mut renewed_after_recovery = false;
        for (seen, transition) in &transitions {
            match *transition {
                Transition::Acquired { epoch, .. } if epoch != term => later_terms.push(epoch),
                Transition::Acquired { deadline, .. } => {
                    instants.push(deadline - self.config.renew_deadline)
                }
                Transition::Renewed {
                    epoch, deadline, ..
                } if epoch == term => {
                    instants.push(deadline - self.config.renew_deadline);
                    renewed_after_recovery |= *seen > recovered_at;
                }
                Transition::Lost { epoch, reason, at } if epoch == term && lost.is_none() => {
                    instants.push(at);
                    lost = Some((reason, (*seen as f64 - fault_at as f64) / 1e9));
                }
                Transition::Renewed { .. } | Transition::Lost { .. } => {}
            }
        }
        let longest_unrenewed = instants
            .windows(2)
            .map(|pair| pair[1] - pair[0])
            .max()
            .unwrap_or_default();
        Held {
            label: self.label,
            term,
            lost,
            later_terms,
            renewed_after_recovery,
            longest_unrenewed,
            renew_deadline: self.config.renew_deadline,
        }
    }
}

impl Held {
    /// The term lasted through the fault and the recovery.
    pub fn kept(&self) -> bool {
        self.lost.is_none() && self.renewed_after_recovery
    }

    /// E.g. `haproxy kept term 41 (longest without a renewal 6.2 s; steps down at 13.0 s)`.
    pub fn describe(&self) -> String {
        let fate = match self.lost {
            None if self.renewed_after_recovery => format!("kept term {}", self.term),
            None => format!("term {} not renewed since the recovery", self.term),
            Some((reason, after)) => {
                let mut fate = format!(
                    "lost term {} ({reason}) {after:.1} s after the fault",
                    self.term
                );
                for term in &self.later_terms {
                    fate.push_str(&format!(", then term {term}"));
                }
                fate
            }
        };
        format!(
            "{} {fate} (longest without a renewal {:.1} s; steps down at {:.1} s)",
            self.label,
            self.longest_unrenewed.as_secs_f64(),
            self.renew_deadline.as_secs_f64()
        )
    }
}
