//! Leases hosted by the gateway, and fence resets: the rules both backends apply.
//!
//! # Leases
//!
//! A lease is named like the resource it fences. Each backend decides every step in
//! one transaction, on its own clock (the database's `clock_timestamp()` for
//! Postgres, which every replica shares; the gateway's wall clock for the embedded
//! store), with [`decide`]:
//!
//! - **acquire** takes the lease if it is free, expired, or already held by the same
//!   holder under the same identity, and mints a new token: one above both the last
//!   token of the lease and the resource's highest fence, and at least the first token
//!   of the server's [`Epoch`] (below). The fence is raised to it in
//!   the same transaction, so writes still in flight from every older term are
//!   rejected from the moment the new holder learns its token.
//! - **renew** extends the lease if the same holder, under the same identity, still
//!   holds it at the token it names and it has not expired; the token stays.
//! - **release** frees the lease if the same holder holds it at that token.
//!
//! A lease taken under an authenticated identity can only be renewed or released by
//! that identity, and no other identity can take it before it expires.
//!
//! Releasing a lease clears its holder and ends its term, but keeps its last token and
//! the identity that token was issued to, durably: the token stays bound to that
//! identity (the coordinator's `issuers`) on every replica and across restarts, until a new term
//! replaces both.
//!
//! # Epochs
//!
//! A token minted on Postgres carries the server's timeline in its high bits
//! ([`Epoch`]): every promotion of a standby starts a new timeline, and the first
//! token minted on it is above every token the older timelines could mint, whether
//! or not the promoted server kept the record of those. So a failover that lost the
//! last acquisitions (asynchronous replication, a restore) never hands out one of
//! their tokens again. The low [`EPOCH_BITS`] count terms within an epoch: 2^40, more
//! than a thousand a second for thirty years. The embedded store has one epoch, 0.
//! Where this stops is in docs/failover.md.
//!
//! # Fence resets
//!
//! A reset lowers a fence that a token nobody issued raised. It never goes below its
//! floor — every token the resource's issuer issued and every token an object of the
//! resource was written with — so that no older term's write gets in afterwards. Each
//! reset is recorded (who, why, from, to) with a generation number that replicas
//! watch to forget what they cached of the resource.

use std::time::Duration;

use fencegate_proto::{ResourceName, Token};

/// What a caller asks of a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOp {
    Acquire { ttl: Duration },
    Renew { token: Token, ttl: Duration },
    Release { token: Token },
}

/// Who asks: the holder named in the request, and the authenticated identity
/// (`None` when authentication is off).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claimant {
    pub holder: String,
    pub identity: Option<String>,
}

/// A lease as stored, read on the store's clock.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LeaseRecord {
    pub holder: Option<String>,
    pub identity: Option<String>,
    /// The last token minted for the lease; `None` if never taken.
    pub token: Option<Token>,
    /// Time left before expiry; zero once expired or released.
    pub remaining: Duration,
}

impl LeaseRecord {
    /// Held now: by someone, and not expired.
    pub fn held(&self) -> bool {
        self.holder.is_some() && !self.remaining.is_zero()
    }

    fn is_held_by(&self, claimant: &Claimant) -> bool {
        self.holder.as_deref() == Some(claimant.holder.as_str())
            && self.identity == claimant.identity
    }
}

/// The outcome of a lease step, with the lease as it is after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeaseOutcome {
    /// Acquired (with a new token) or renewed.
    Granted(LeaseRecord),
    /// Released.
    Released(LeaseRecord),
    /// Acquire refused: another holder holds the lease.
    Held(LeaseRecord),
    /// Renew or release refused: the claimant does not hold the lease at that token.
    Lost(LeaseRecord),
    /// Acquire refused: the fence or the lease is at the largest token.
    Exhausted,
}

/// What the store must do for a step, decided from the lease as it stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Mint a new token and raise the fence to it; hold the lease for `ttl`.
    Mint { ttl: Duration },
    /// Keep the token; hold the lease for `ttl` from now.
    Extend { ttl: Duration },
    /// Free the lease; keep its last token and the identity it is bound to.
    Free,
    /// Change nothing: someone else holds the lease.
    RefuseHeld,
    /// Change nothing: the claimant's term is over.
    RefuseLost,
}

/// The rule of every lease step; see the module doc.
pub fn decide(op: &LeaseOp, claimant: &Claimant, current: &LeaseRecord) -> Decision {
    match *op {
        LeaseOp::Acquire { ttl } => {
            if current.held() && !current.is_held_by(claimant) {
                Decision::RefuseHeld
            } else {
                Decision::Mint { ttl }
            }
        }
        LeaseOp::Renew { token, ttl } => {
            if current.held() && current.is_held_by(claimant) && current.token == Some(token) {
                Decision::Extend { ttl }
            } else {
                Decision::RefuseLost
            }
        }
        LeaseOp::Release { token } => {
            // An expired lease may still be released by its holder: that changes
            // nothing anybody relies on, and spares the holder a pointless error.
            if current.is_held_by(claimant) && current.token == Some(token) {
                Decision::Free
            } else {
                Decision::RefuseLost
            }
        }
    }
}

/// The low bits of a minted token, which count terms within one [`Epoch`].
pub const EPOCH_BITS: u32 = 40;

/// The epoch a token is minted in: the timeline of the Postgres server that mints it,
/// less one, so that tokens minted before any promotion are 1, 2, 3…
///
/// The first token of epoch `e` is `e · 2^40 + 1`, above every token of the epochs
/// before it as long as none of them minted 2^40 terms.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct Epoch(u64);

impl Epoch {
    /// The largest epoch whose tokens fit in `1..=i64::MAX`.
    pub const MAX: Epoch = Epoch((i64::MAX as u64) >> EPOCH_BITS);

    /// The epoch of a server on `timeline` (Postgres numbers timelines from 1); a
    /// timeline past [`Epoch::MAX`] stays in the last epoch, and says so
    /// ([`Epoch::past_the_last`]).
    pub fn of_timeline(timeline: i64) -> Epoch {
        let epoch = u64::try_from(timeline.saturating_sub(1)).unwrap_or(0);
        Epoch(epoch.min(Epoch::MAX.0))
    }

    /// Whether `timeline` is past the last epoch: its tokens no longer rise above the
    /// older timelines' by construction, only by the fence and the lease's last token.
    pub fn past_the_last(timeline: i64) -> bool {
        u64::try_from(timeline.saturating_sub(1)).is_ok_and(|epoch| epoch > Epoch::MAX.0)
    }

    /// The epoch a token belongs to.
    pub fn of_token(token: Token) -> Epoch {
        Epoch((token.get() >> EPOCH_BITS).min(Epoch::MAX.0))
    }

    /// The first token of this epoch.
    pub fn first_token(self) -> u64 {
        (self.0 << EPOCH_BITS) + 1
    }
}

/// The token a new term gets: above the lease's last token and the fence, and not
/// below the first token of `epoch`. `None` when that would pass the largest token.
pub fn next_token(
    lease_token: Option<Token>,
    highest: Option<Token>,
    epoch: Epoch,
) -> Option<Token> {
    let above = lease_token.max(highest).map_or(0, Token::get);
    Token::new(above.checked_add(1)?.max(epoch.first_token())).ok()
}

/// An administrator's request to lower a fence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reset {
    pub resource: ResourceName,
    pub to: Token,
    /// The lowest `to` may go, from issuers outside the store (the `leader_lease`
    /// table); the store adds its own (its leases, its objects).
    pub floor: Option<Token>,
    pub identity: Option<String>,
    pub reason: String,
}

/// What a reset did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResetOutcome {
    Applied {
        from: Token,
        generation: u64,
    },
    /// Nothing to lower: the fence is at or below `to`, or the resource has none.
    NotLower {
        highest: Option<Token>,
    },
    /// `to` is below a token that was issued or written with.
    BelowFloor {
        floor: Token,
    },
}

/// Checks a reset against the fence and the floors; `Ok(from)` if it may be applied.
pub fn check_reset(
    reset: &Reset,
    highest: Option<Token>,
    floors: &[Option<Token>],
) -> Result<Token, ResetOutcome> {
    let from = match highest {
        Some(from) if from > reset.to => from,
        other => return Err(ResetOutcome::NotLower { highest: other }),
    };
    let floor = floors.iter().copied().chain([reset.floor]).flatten().max();
    match floor {
        Some(floor) if floor > reset.to => Err(ResetOutcome::BelowFloor { floor }),
        _ => Ok(from),
    }
}

/// A reset as recorded, for replicas that follow the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResetRecord {
    pub generation: u64,
    pub resource: ResourceName,
    pub to: Token,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tok(value: u64) -> Token {
        Token::new(value).unwrap()
    }

    fn claimant(holder: &str, identity: Option<&str>) -> Claimant {
        Claimant {
            holder: holder.into(),
            identity: identity.map(Into::into),
        }
    }

    fn live(holder: &str, identity: Option<&str>, token: u64) -> LeaseRecord {
        LeaseRecord {
            holder: Some(holder.into()),
            identity: identity.map(Into::into),
            token: Some(tok(token)),
            remaining: Duration::from_secs(5),
        }
    }

    const TTL: Duration = Duration::from_secs(15);

    #[test]
    fn acquire() {
        let acquire = LeaseOp::Acquire { ttl: TTL };
        let a = claimant("a", None);
        let mint = Decision::Mint { ttl: TTL };
        assert_eq!(decide(&acquire, &a, &LeaseRecord::default()), mint);
        assert_eq!(decide(&acquire, &a, &live("a", None, 3)), mint);
        assert_eq!(
            decide(&acquire, &a, &live("b", None, 3)),
            Decision::RefuseHeld
        );
        let expired = LeaseRecord {
            remaining: Duration::ZERO,
            ..live("b", None, 3)
        };
        assert_eq!(decide(&acquire, &a, &expired), mint);
        // The same holder name under another identity does not take a live lease.
        assert_eq!(
            decide(
                &acquire,
                &claimant("a", Some("x")),
                &live("a", Some("y"), 3)
            ),
            Decision::RefuseHeld
        );
    }

    #[test]
    fn renew_and_release() {
        let a = claimant("a", Some("x"));
        let lease = live("a", Some("x"), 3);
        let renew = |token| LeaseOp::Renew {
            token: tok(token),
            ttl: TTL,
        };
        assert_eq!(decide(&renew(3), &a, &lease), Decision::Extend { ttl: TTL });
        assert_eq!(decide(&renew(2), &a, &lease), Decision::RefuseLost);
        assert_eq!(
            decide(&renew(3), &claimant("a", Some("y")), &lease),
            Decision::RefuseLost
        );
        let expired = LeaseRecord {
            remaining: Duration::ZERO,
            ..lease.clone()
        };
        assert_eq!(decide(&renew(3), &a, &expired), Decision::RefuseLost);
        let release = |token| LeaseOp::Release { token: tok(token) };
        assert_eq!(decide(&release(3), &a, &lease), Decision::Free);
        assert_eq!(decide(&release(3), &a, &expired), Decision::Free);
        assert_eq!(decide(&release(4), &a, &lease), Decision::RefuseLost);
        assert_eq!(
            decide(&release(3), &claimant("b", Some("x")), &lease),
            Decision::RefuseLost
        );
    }

    #[test]
    fn tokens_rise_above_lease_and_fence() {
        let first = Epoch::default();
        assert_eq!(next_token(None, None, first), Some(tok(1)));
        assert_eq!(next_token(Some(tok(4)), Some(tok(9)), first), Some(tok(10)));
        assert_eq!(next_token(Some(tok(9)), Some(tok(4)), first), Some(tok(10)));
        assert_eq!(next_token(None, Some(Token::MAX), first), None);
        assert_eq!(next_token(None, Some(Token::MAX), Epoch::MAX), None);
    }

    #[test]
    fn a_new_epoch_starts_above_every_token_of_the_ones_before() {
        let second = Epoch::of_timeline(2);
        assert_eq!(Epoch::of_timeline(1), Epoch::default());
        assert_eq!(Epoch::of_timeline(0), Epoch::default());
        assert_eq!(second.first_token(), (1 << EPOCH_BITS) + 1);
        // Whatever the promoted server kept of the first epoch's tokens:
        for kept in [None, Some(tok(3)), Some(tok(1 << EPOCH_BITS))] {
            assert_eq!(
                next_token(kept, kept, second),
                Some(tok((1 << EPOCH_BITS) + 1))
            );
        }
        // Within an epoch, terms count on.
        let minted = tok((1 << EPOCH_BITS) + 7);
        assert_eq!(
            next_token(Some(minted), None, second),
            Some(tok((1 << EPOCH_BITS) + 8))
        );
        assert_eq!(Epoch::of_token(minted), second);
        // The last epoch still has room for 2^40 terms, and no timeline goes past it.
        assert_eq!(Epoch::of_timeline(i64::MAX), Epoch::MAX);
        let last = i64::try_from(Epoch::MAX.0).unwrap() + 1;
        assert!(!Epoch::past_the_last(last));
        assert!(Epoch::past_the_last(last + 1));
        assert!(!Epoch::past_the_last(1));
        assert!(Token::new(Epoch::MAX.first_token() + (1 << EPOCH_BITS) - 2).is_ok());
        assert_eq!(Epoch::of_token(Token::MAX), Epoch::MAX);
    }

    #[test]
    fn resets_stay_above_their_floors() {
        let reset = Reset {
            resource: ResourceName::new("r").unwrap(),
            to: tok(10),
            floor: None,
            identity: None,
            reason: "forged".into(),
        };
        assert_eq!(check_reset(&reset, Some(Token::MAX), &[]), Ok(Token::MAX));
        assert_eq!(
            check_reset(&reset, Some(tok(10)), &[]),
            Err(ResetOutcome::NotLower {
                highest: Some(tok(10))
            })
        );
        assert_eq!(
            check_reset(&reset, None, &[]),
            Err(ResetOutcome::NotLower { highest: None })
        );
        assert_eq!(
            check_reset(&reset, Some(Token::MAX), &[Some(tok(11)), None]),
            Err(ResetOutcome::BelowFloor { floor: tok(11) })
        );
        let floored = Reset {
            floor: Some(tok(12)),
            ..reset.clone()
        };
        assert_eq!(
            check_reset(&floored, Some(Token::MAX), &[Some(tok(3))]),
            Err(ResetOutcome::BelowFloor { floor: tok(12) })
        );
        // A reset may go down to a floor, not below it.
        assert_eq!(
            check_reset(&reset, Some(tok(30)), &[Some(tok(10)), Some(tok(4))]),
            Ok(tok(30))
        );
        let at_floor = Reset {
            floor: Some(tok(10)),
            ..floored
        };
        assert_eq!(check_reset(&at_floor, Some(tok(30)), &[None]), Ok(tok(30)));
    }
}
