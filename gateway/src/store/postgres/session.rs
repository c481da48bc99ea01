//! Session settings pinned in the start-up packet of the gateway's Postgres connections.
//!
//! # Behavior
//!
//! - Settings given in the start-up packet's `options` outrank those of the database
//!   and of the role (`ALTER DATABASE ... SET`, `ALTER ROLE ... SET`) and of
//!   `postgresql.conf`, so a database configured against the gateway's assumptions —
//!   asynchronous commits, read-only transactions, another isolation level, short
//!   timeouts — cannot weaken them. They come after the URL's own `options`, so they
//!   win over those too.
//! - [`Pins::check`] reads back what a connection runs with (`pg_settings`): a pooler
//!   between the gateway and Postgres may drop start-up options, and then the
//!   connection runs with whatever the database says.

use std::time::Duration;

/// What a connection must run with: `(name, value)`, the value as `pg_settings.setting`
/// shows it (durations in milliseconds).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pins(Vec<(&'static str, String)>);

/// What the store's statements assume on every connection of theirs: an acknowledged
/// commit is durable (on the standbys `synchronous_standby_names` asks for, too),
/// writes are allowed, and each statement sees what committed before it (the fence
/// upserts rely on read committed's re-check of a conflicting row).
const STORE_SAFETY: [(&str, &str); 3] = [
    ("synchronous_commit", "on"),
    ("default_transaction_read_only", "off"),
    ("default_transaction_isolation", "read committed"),
];

impl Pins {
    pub fn new() -> Pins {
        Pins(Vec::new())
    }

    /// The settings of the store's connections. `lock_timeout` is zero (wait) except on
    /// the write lanes, which give up on a fence lock after `--write-lock-timeout`.
    /// Statements run without a server-side timeout: every call is bounded by the
    /// backend timeout, and what the gateway gives up on is cancelled. A transaction
    /// never idles longer than that bound, so a session that does (its gateway paused
    /// or cut off) is ended, releasing its fence locks.
    pub fn store(lock_timeout: Duration, backend_timeout: Duration) -> Pins {
        let mut pins = Pins::new();
        for (name, value) in STORE_SAFETY {
            pins = pins.set(name, value);
        }
        pins.set("statement_timeout", "0")
            .duration("lock_timeout", lock_timeout)
            .duration("idle_in_transaction_session_timeout", backend_timeout)
    }

    pub fn set(mut self, name: &'static str, value: &str) -> Pins {
        self.0.retain(|(pinned, _)| *pinned != name);
        self.0.push((name, value.to_owned()));
        self
    }

    /// A duration setting, in whole milliseconds; zero stays zero (no limit), anything
    /// else is at least 1 ms.
    pub fn duration(self, name: &'static str, value: Duration) -> Pins {
        let ms = if value.is_zero() {
            0
        } else {
            value.as_millis().max(1)
        };
        self.set(name, &ms.to_string())
    }

    /// The `options` string: `-c name=value` for each, spaces escaped.
    pub fn options(&self) -> String {
        self.0
            .iter()
            .map(|(name, value)| format!("-c {name}={}", value.replace(' ', "\\ ")))
            .collect::<Vec<_>>()
            .join(" ")
    }

    /// Adds the pins to `config`'s start-up options, after the URL's own.
    pub fn apply(&self, config: &mut tokio_postgres::Config) {
        let options = match config.get_options() {
            Some(theirs) if !theirs.trim().is_empty() => format!("{theirs} {}", self.options()),
            _ => self.options(),
        };
        config.options(&options);
    }

    /// The names pinned, for reading them back.
    pub fn names(&self) -> Vec<&'static str> {
        self.0.iter().map(|(name, _)| *name).collect()
    }

    /// Compares what a connection runs with (`found`: name and `pg_settings.setting`)
    /// with the pins; describes every difference.
    pub fn check(&self, found: &[(String, String)]) -> Result<(), String> {
        let wrong: Vec<String> = self
            .0
            .iter()
            .filter_map(|(name, value)| {
                let got = found.iter().find(|(n, _)| n == name).map(|(_, v)| v);
                match got {
                    Some(got) if got == value => None,
                    Some(got) => Some(format!("{name} is {got:?}, not {value:?}")),
                    None => Some(format!("{name} is unknown to the server")),
                }
            })
            .collect();
        if wrong.is_empty() {
            Ok(())
        } else {
            Err(wrong.join("; "))
        }
    }
}

/// Reads the settings `names` as a connection runs with them.
pub const SETTINGS: &str = "SELECT name, setting FROM pg_settings WHERE name = ANY($1)";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_escape_spaces_and_keep_the_last_value() {
        let pins = Pins::new()
            .set("default_transaction_isolation", "read committed")
            .duration("lock_timeout", Duration::from_millis(1500))
            .duration("statement_timeout", Duration::ZERO)
            .duration("lock_timeout", Duration::from_micros(10));
        assert_eq!(
            pins.options(),
            "-c default_transaction_isolation=read\\ committed -c statement_timeout=0 -c lock_timeout=1"
        );
        let mut config = tokio_postgres::Config::new();
        config.options("-c search_path=app");
        pins.apply(&mut config);
        assert_eq!(
            config.get_options(),
            Some(format!("-c search_path=app {}", pins.options()).as_str())
        );
    }

    #[test]
    fn the_store_pins_safety_and_its_timeouts() {
        let pins = Pins::store(Duration::ZERO, Duration::from_secs(5));
        let options = pins.options();
        for pinned in [
            "-c synchronous_commit=on",
            "-c default_transaction_read_only=off",
            "-c default_transaction_isolation=read\\ committed",
            "-c statement_timeout=0",
            "-c lock_timeout=0",
            "-c idle_in_transaction_session_timeout=5000",
        ] {
            assert!(options.contains(pinned), "{options}");
        }
    }

    #[test]
    fn a_connection_that_runs_otherwise_is_described() {
        let pins = Pins::store(Duration::from_millis(150), Duration::from_secs(5));
        let mut found: Vec<(String, String)> = pins
            .0
            .iter()
            .map(|(name, value)| ((*name).to_owned(), value.clone()))
            .collect();
        assert_eq!(pins.check(&found), Ok(()));
        found[0].1 = "off".into();
        found.pop();
        let error = pins.check(&found).unwrap_err();
        assert!(
            error.contains("synchronous_commit is \"off\", not \"on\""),
            "{error}"
        );
        assert!(
            error.contains("idle_in_transaction_session_timeout is unknown"),
            "{error}"
        );
    }
}
