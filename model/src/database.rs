//! The durable store's operations, as the Postgres backend runs them.
//!
//! Each function is one transaction, taken as one atomic step. That is sound for these
//! statements: every write first locks its resource's fence row and holds the lock to
//! commit, so the transactions on one resource are serialised, and transactions on
//! different resources touch different rows. Their outcome is that of some serial order,
//! which the checker explores every one of.
//!
//! The mutants change exactly the step they name; with `None` this is the code as built.

use crate::model::Mutant;
use crate::state::{Database, Request};

/// What a statement or a transaction committed for one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied,
    /// The fence refused the token; nothing of the request remains.
    Stale,
    /// The `If-Match` did not hold; the transaction rolled back.
    PreconditionFailed,
}

impl Database {
    /// `FENCED_PUT`: raise-or-check the fence and write the object in one statement.
    /// The object insert reads from the fence CTE, so it runs only if the token is at
    /// least the committed highest, and the fence becomes `max(highest, token)` in the
    /// same statement (invariant 1).
    fn fenced_put(&mut self, request: &Request, mutant: Option<Mutant>) -> Outcome {
        let r = usize::from(request.resource);
        // Mutant: the check was made earlier, outside this transaction, and is not
        // made again here.
        let checked_here = mutant != Some(Mutant::CheckOutsideTransaction);
        if checked_here && request.token < self.fence[r] {
            return Outcome::Stale;
        }
        self.fence[r] = self.fence[r].max(request.token);
        self.objects[r].put(request.id);
        Outcome::Applied
    }

    /// A write lane's group: `writes` sorted by resource (stably), one `FENCED_PUT` each,
    /// in order, in ONE transaction. Each statement sees the fence as the writes before
    /// it left it, so a lower token after a higher one on the same resource is stale. A
    /// stale statement returns no row, which is not an error: the transaction commits
    /// with the others applied and the stale one answered stale. A single write is the
    /// same statement autocommitted.
    pub fn apply_group(&mut self, writes: &[Request], mutant: Option<Mutant>) -> Vec<Outcome> {
        writes
            .iter()
            .map(|write| {
                let outcome = self.fenced_put(write, mutant);
                // Mutant: a refused member is not rolled back; its object write stays
                // in the group's commit.
                if outcome == Outcome::Stale
                    && writes.len() > 1
                    && mutant == Some(Mutant::StaleMemberKept)
                {
                    self.objects[usize::from(write.resource)].put(write.id);
                }
                outcome
            })
            .collect()
    }

    /// `write_conditional`: in one transaction, raise-or-check the fence, read the
    /// object's version, check the precondition, write and commit; any early return
    /// rolls back, so a failed precondition leaves the fence as it was (invariant 4).
    pub fn conditional_put(
        &mut self,
        request: &Request,
        expected_version: u8,
        mutant: Option<Mutant>,
    ) -> Outcome {
        let r = usize::from(request.resource);
        let before = self.fence[r];
        let checked_here = mutant != Some(Mutant::CheckOutsideTransaction);
        if checked_here && request.token < before {
            return Outcome::Stale;
        }
        self.fence[r] = before.max(request.token);
        if self.objects[r].version != expected_version {
            // Mutant: the fence raise is committed although the write is not.
            if mutant != Some(Mutant::PreconditionKeepsFence) {
                self.fence[r] = before;
            }
            return Outcome::PreconditionFailed;
        }
        self.objects[r].put(request.id);
        Outcome::Applied
    }

    /// `FENCE_RAISE` alone, autocommitted: an advance.
    pub fn advance(&mut self, request: &Request) -> Outcome {
        let r = usize::from(request.resource);
        if request.token < self.fence[r] {
            return Outcome::Stale;
        }
        self.fence[r] = request.token;
        Outcome::Applied
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::Op;

    fn put(id: u8, token: u8) -> Request {
        Request {
            id,
            writer: 0,
            token,
            resource: 0,
            op: Op::Put,
        }
    }

    #[test]
    fn a_group_commits_around_its_stale_member() {
        let mut database = Database::default();
        let outcomes = database.apply_group(&[put(1, 2), put(2, 1)], None);
        assert_eq!(outcomes, [Outcome::Applied, Outcome::Stale]);
        assert_eq!(database.fence[0], 2);
        assert_eq!(
            (database.objects[0].value, database.objects[0].version),
            (1, 1)
        );
    }

    #[test]
    fn a_kept_stale_member_overwrites_its_neighbour() {
        let mut database = Database::default();
        let outcomes = database.apply_group(&[put(1, 2), put(2, 1)], Some(Mutant::StaleMemberKept));
        assert_eq!(outcomes, [Outcome::Applied, Outcome::Stale]);
        assert_eq!(database.objects[0].value, 2);
    }

    #[test]
    fn a_failed_precondition_leaves_the_fence() {
        let mut database = Database::default();
        let request = Request {
            op: Op::PutIfVersion(3),
            ..put(1, 4)
        };
        assert_eq!(
            database.conditional_put(&request, 3, None),
            Outcome::PreconditionFailed
        );
        assert_eq!(database.fence[0], 0);
        assert_eq!(
            database.conditional_put(&request, 3, Some(Mutant::PreconditionKeepsFence)),
            Outcome::PreconditionFailed
        );
        assert_eq!(database.fence[0], 4);
    }
}
