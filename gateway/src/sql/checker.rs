//! The threads that check a request's statements ([`super::guard::check`]) before
//! anything runs: their stacks hold the deepest walk the guard's bounds allow, which a
//! request handler's stack does not.

use fencegate_proto::body::SqlStatement;

use super::guard::{check, Refused, SqlPolicy};

/// The stack of the threads that check statements ([`Checker`]): twice what a chain of
/// [`super::guard::MAX_OPERATORS`] takes in an unoptimised build (tested), many times what it takes
/// in a release build. Reserved, not committed: only the pages a walk touches use
/// memory.
pub const GUARD_STACK: usize = 32 << 20;

/// Checks statements on a few threads of their own, whose stacks hold the deepest walk
/// [`super::guard::MAX_OPERATORS`] allows (a request handler's stack is far smaller).
/// Dropping the checker stops them.
pub struct Checker {
    queue: tokio::sync::mpsc::Sender<CheckJob>,
}

/// The statements of one request, checked in order.
struct CheckJob {
    statements: Vec<SqlStatement>,
    policy: SqlPolicy,
    reply: tokio::sync::oneshot::Sender<CheckedAll>,
}

/// The statements back, and the index and reason of the first one refused.
pub type CheckedAll = (Vec<SqlStatement>, Result<(), (usize, Refused)>);

impl Checker {
    /// Starts `threads` checking threads.
    pub fn start(threads: usize) -> std::io::Result<Checker> {
        let (queue, jobs) = tokio::sync::mpsc::channel::<CheckJob>(1024);
        let jobs = std::sync::Arc::new(std::sync::Mutex::new(jobs));
        for _ in 0..threads {
            let jobs = std::sync::Arc::clone(&jobs);
            std::thread::Builder::new()
                .name("fencegate-sql-guard".to_owned())
                .stack_size(GUARD_STACK)
                .spawn(move || loop {
                    // One thread waits for the next job; the others wait for the lock.
                    let job = jobs.lock().map(|mut jobs| jobs.blocking_recv());
                    let Ok(Some(job)) = job else {
                        return;
                    };
                    let verdict =
                        job.statements
                            .iter()
                            .enumerate()
                            .try_for_each(|(index, statement)| {
                                check(&statement.sql, &job.policy)
                                    .map_err(|refused| (index, refused))
                            });
                    let _ = job.reply.send((job.statements, verdict));
                })?;
        }
        Ok(Checker { queue })
    }

    /// Checks `statements` in order; on a refusal, the index of the first statement
    /// refused. The statements come back either way.
    pub async fn check_all(&self, statements: Vec<SqlStatement>, policy: &SqlPolicy) -> CheckedAll {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = CheckJob {
            statements,
            policy: policy.clone(),
            reply,
        };
        if let Err(refused) = self.queue.send(job).await {
            let job = refused.0;
            return (
                job.statements,
                Err((0, Refused("the SQL checker has stopped".to_owned()))),
            );
        }
        answer.await.unwrap_or_else(|_| {
            (
                Vec::new(),
                Err((0, Refused("the SQL checker has stopped".to_owned()))),
            )
        })
    }
}
