//! Lease timing and identity, validated before an elector starts.
//!
//! # The arithmetic
//!
//! ```text
//! t = 0        last renewal sent (the store stamps expiry >= 0 + lease_duration)
//! t = renew_interval       next renewal; on failure retry every renew_retry_period
//! t = renew_deadline       no renewal succeeded since t = 0: step down, on our own clock
//! t = lease_duration       the earliest instant a rival can acquire
//! ```
//!
//! The holder measures from the instant it *sent* its last successful renewal, not
//! from the answer: the store's clock read the request after it was sent, so the
//! expiry it wrote is at least `sent + lease_duration`. Stepping down at
//! `sent + renew_deadline` therefore leaves `lease_duration - renew_deadline` for the
//! leading code to stop and for a write it sent just before to land, before any rival
//! can hold the lease. That gap must fit at least one round trip (`max_round_trip`);
//! anything later is refused by the fence anyway, since the rival's term has a higher
//! token.
//!
//! Every default scales with the lease duration. For 15 s: renew every 5 s, retry a
//! failed renewal every 0.5 s (each try abandoned after 1 s), step down 13 s after the
//! last successful renewal was sent, followers retry every 2 s. A holder rides out a
//! store or gateway outage of `renew_deadline - renew_interval - max_round_trip` at the
//! least (7 s of a 15 s lease) — a database switchover or a failover that the cluster
//! finishes in that time does not end a live holder's term. (Kubernetes' leader
//! election steps down at 10 s of 15; the two seconds that fencing makes unnecessary
//! are given to riding out outages.)

use std::time::Duration;

/// The seed's lease duration.
pub const DEFAULT_LEASE_DURATION: Duration = Duration::from_secs(15);

/// The longest lease name, in bytes (it is also a metric label value).
pub const MAX_NAME_LEN: usize = 200;
/// The longest holder identity: the gateway's `Fencing-Holder` limit.
pub const MAX_HOLDER_LEN: usize = fencegate_proto::headers::MAX_HOLDER_LEN;

/// How long a lease lasts and how its holder keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseConfig {
    /// How long a successful acquisition or renewal keeps the lease, on the store's clock.
    pub lease_duration: Duration,
    /// How often the holder renews. Default: a third of the lease.
    pub renew_interval: Duration,
    /// After this long without a successful renewal, measured on the holder's own
    /// monotonic clock from the renewal's send instant, the holder steps down.
    /// Default: 13/15 of the lease (the lease less two round trips).
    pub renew_deadline: Duration,
    /// How often a follower tries to acquire; each wait is jittered up by to 20 %.
    /// Default: 2/15 of the lease.
    pub retry_period: Duration,
    /// How soon a holder retries a failed renewal, again and again until one succeeds
    /// or `renew_deadline` passes; jittered as `retry_period`. Default: 1/30 of the
    /// lease.
    pub renew_retry_period: Duration,
    /// The longest a store call or a gateway call is expected to take; each one is
    /// abandoned after this long. Default: 1/15 of the lease.
    pub max_round_trip: Duration,
}

impl Default for LeaseConfig {
    fn default() -> Self {
        LeaseConfig::with_lease(DEFAULT_LEASE_DURATION)
    }
}

impl LeaseConfig {
    /// The defaults, scaled to `lease_duration`.
    pub fn with_lease(lease_duration: Duration) -> LeaseConfig {
        LeaseConfig {
            lease_duration,
            renew_interval: lease_duration / 3,
            renew_deadline: lease_duration * 13 / 15,
            retry_period: lease_duration * 2 / 15,
            renew_retry_period: lease_duration / 30,
            max_round_trip: lease_duration / 15,
        }
    }

    /// Checks the arithmetic of the module doc; every error says which rule failed.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let LeaseConfig {
            lease_duration,
            renew_interval,
            renew_deadline,
            retry_period,
            renew_retry_period,
            max_round_trip,
        } = *self;
        for (name, value) in [
            ("lease_duration", lease_duration),
            ("renew_interval", renew_interval),
            ("renew_deadline", renew_deadline),
            ("retry_period", retry_period),
            ("renew_retry_period", renew_retry_period),
            ("max_round_trip", max_round_trip),
        ] {
            if value.is_zero() {
                return Err(ConfigError::Zero(name));
            }
        }
        if lease_duration < Duration::from_millis(1) {
            return Err(ConfigError::TooShort(lease_duration));
        }
        if renew_interval + max_round_trip > renew_deadline {
            return Err(ConfigError::RenewIntervalTooLong {
                renew_interval,
                renew_deadline,
                max_round_trip,
            });
        }
        if renew_deadline + max_round_trip > lease_duration {
            return Err(ConfigError::RenewDeadlineTooLong {
                renew_deadline,
                lease_duration,
                max_round_trip,
            });
        }
        for (name, period) in [
            ("retry_period", retry_period),
            ("renew_retry_period", renew_retry_period),
        ] {
            if period >= renew_deadline {
                return Err(ConfigError::RetryPeriodTooLong {
                    name,
                    period,
                    renew_deadline,
                });
            }
        }
        Ok(())
    }
}

/// A lease configuration that would let a holder lead past its lease, or never renew.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    #[error("{0} must be greater than zero")]
    Zero(&'static str),
    #[error("lease_duration {0:?} is too short: the store keeps milliseconds")]
    TooShort(Duration),
    #[error(
        "renew_interval ({renew_interval:?}) plus one round trip ({max_round_trip:?}) must not \
         exceed renew_deadline ({renew_deadline:?}): the holder needs at least one retry \
         before it gives up"
    )]
    RenewIntervalTooLong {
        renew_interval: Duration,
        renew_deadline: Duration,
        max_round_trip: Duration,
    },
    #[error(
        "renew_deadline ({renew_deadline:?}) plus one round trip ({max_round_trip:?}) must not \
         exceed lease_duration ({lease_duration:?}): the holder must step down before a rival \
         can acquire"
    )]
    RenewDeadlineTooLong {
        renew_deadline: Duration,
        lease_duration: Duration,
        max_round_trip: Duration,
    },
    #[error(
        "{name} ({period:?}) must be shorter than renew_deadline ({renew_deadline:?}): a \
         failed renewal must be retried before the holder gives up"
    )]
    RetryPeriodTooLong {
        name: &'static str,
        period: Duration,
        renew_deadline: Duration,
    },
    #[error("invalid lease name: {0}")]
    InvalidName(&'static str),
    #[error("invalid holder identity: {0}")]
    InvalidHolder(&'static str),
}

/// Checks a lease name: 1–200 bytes of `[A-Za-z0-9._-]`, so it is safe as a Redis key
/// part, in logs and as a metric label (a process leads a handful of leases).
pub fn validate_name(name: &str) -> Result<(), ConfigError> {
    if name.is_empty() {
        return Err(ConfigError::InvalidName("the name is empty"));
    }
    if name.len() > MAX_NAME_LEN {
        return Err(ConfigError::InvalidName("longer than 200 bytes"));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
    {
        return Err(ConfigError::InvalidName(
            "use only A-Z, a-z, 0-9, '.', '_' and '-'",
        ));
    }
    Ok(())
}

/// Checks a holder identity: what the gateway accepts as `Fencing-Holder` (1–256 bytes,
/// no control characters).
pub fn validate_holder(holder: &str) -> Result<(), ConfigError> {
    if holder.is_empty() {
        return Err(ConfigError::InvalidHolder("the holder is empty"));
    }
    if holder.len() > MAX_HOLDER_LEN {
        return Err(ConfigError::InvalidHolder("longer than 256 bytes"));
    }
    if holder.chars().any(char::is_control) {
        return Err(ConfigError::InvalidHolder("contains a control character"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: fn(u64) -> Duration = Duration::from_millis;

    #[test]
    fn defaults_ride_out_seven_seconds_of_a_fifteen_second_lease() {
        let config = LeaseConfig::default();
        assert_eq!(config.lease_duration, Duration::from_secs(15));
        assert_eq!(config.renew_interval, Duration::from_secs(5));
        assert_eq!(config.renew_deadline, Duration::from_secs(13));
        assert_eq!(config.retry_period, Duration::from_secs(2));
        assert_eq!(config.renew_retry_period, MS(500));
        assert_eq!(config.max_round_trip, Duration::from_secs(1));
        assert_eq!(
            config.renew_deadline - config.renew_interval - config.max_round_trip,
            Duration::from_secs(7)
        );
        assert_eq!(config.validate(), Ok(()));
        assert_eq!(LeaseConfig::with_lease(MS(600)).validate(), Ok(()));
    }

    #[test]
    fn bad_settings_are_rejected_with_the_rule_they_break() {
        let base = LeaseConfig::with_lease(MS(600));
        let cases = [
            (
                LeaseConfig {
                    renew_interval: Duration::ZERO,
                    ..base
                },
                "renew_interval must be greater than zero",
            ),
            (
                LeaseConfig {
                    renew_deadline: MS(600),
                    ..base
                },
                "must not exceed lease_duration",
            ),
            (
                LeaseConfig {
                    renew_deadline: MS(700),
                    ..base
                },
                "must step down before a rival",
            ),
            (
                LeaseConfig {
                    renew_retry_period: MS(520),
                    ..base
                },
                "renew_retry_period (520ms) must be shorter than renew_deadline",
            ),
            (
                LeaseConfig {
                    renew_interval: MS(500),
                    ..base
                },
                "at least one retry",
            ),
            (
                LeaseConfig {
                    retry_period: MS(520),
                    ..base
                },
                "retry_period (520ms) must be shorter than renew_deadline",
            ),
        ];
        for (config, expected) in cases {
            let error = config
                .validate()
                .expect_err("invalid settings were accepted");
            assert!(error.to_string().contains(expected), "{error}");
        }
    }

    #[test]
    fn names_and_holders() {
        assert_eq!(validate_name("invoice-sweeper"), Ok(()));
        assert!(validate_name("a b").is_err());
        assert!(validate_name("").is_err());
        assert_eq!(validate_holder("node-a"), Ok(()));
        assert!(validate_holder("node\n").is_err());
        assert!(validate_holder(&"x".repeat(257)).is_err());
    }
}
