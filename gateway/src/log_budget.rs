//! How many lines of one kind the log gets: "stale write rejected" lines
//! (`--stale-log-limit`), and the Postgres door's lines about clients it refuses.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// A budget of "stale write rejected" lines per wall-clock second (`--stale-log-limit`,
/// 100 by default; 0 for no limit).
///
/// Under a stale flood — a writer that goes on writing after losing its lease — writing
/// every line costs more than the rejection itself, and lets one client fill the log.
/// Metrics still count every rejection; the next line logged says how many were left
/// out (`unlogged`), and so does a summary line once a second while lines are left out.
pub(crate) struct LogBudget {
    /// Lines per window; 0 for no limit.
    pub(crate) limit: u64,
    /// The window's length, in seconds (at least 1).
    window_secs: u64,
    started: Instant,
    /// `window << 32 | lines logged in that window`, windows counted from `started`.
    window: AtomicU64,
    /// Lines refused since the last one admitted.
    refused: AtomicU64,
}

impl LogBudget {
    pub(crate) fn new(limit: u64) -> LogBudget {
        LogBudget::per_window(limit, 1)
    }

    /// A budget of `limit` lines per window of `window_secs` seconds.
    pub(crate) fn per_window(limit: u64, window_secs: u64) -> LogBudget {
        LogBudget {
            limit,
            window_secs: window_secs.max(1),
            started: Instant::now(),
            window: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        }
    }

    /// Lines refused since the last line or summary that counted them.
    pub(crate) fn take_refused(&self) -> u64 {
        self.refused.swap(0, Ordering::Relaxed)
    }

    /// `Some(refused)` if a line may be logged now, with the number of lines refused
    /// since the previous one; `None` if this window's budget is spent.
    pub(crate) fn take_line(&self) -> Option<u64> {
        if self.limit == 0 {
            return Some(0);
        }
        let window = (self.started.elapsed().as_secs() / self.window_secs) & u64::from(u32::MAX);
        let mut current = self.window.load(Ordering::Relaxed);
        loop {
            let next = if current >> 32 != window {
                window << 32 | 1
            } else if current & u64::from(u32::MAX) < self.limit {
                current + 1
            } else {
                self.refused.fetch_add(1, Ordering::Relaxed);
                return None;
            };
            match self.window.compare_exchange_weak(
                current,
                next,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return Some(self.take_refused()),
                Err(actual) => current = actual,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_budget_admits_its_limit_and_counts_the_rest() {
        let budget = LogBudget::new(3);
        let admitted: Vec<Option<u64>> = (0..5).map(|_| budget.take_line()).collect();
        // Within one second (the test takes far less): three lines, then refusals.
        if budget.started.elapsed().as_secs() == 0 {
            assert_eq!(admitted, [Some(0), Some(0), Some(0), None, None]);
            assert_eq!(budget.take_refused(), 2);
            assert_eq!(budget.take_refused(), 0, "counted once");
        }
        let unlimited = LogBudget::new(0);
        assert!((0..1000).all(|_| unlimited.take_line() == Some(0)));
    }
}
