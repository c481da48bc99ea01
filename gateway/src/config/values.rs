//! The values of flags that are more than a number, a duration or a path: listen
//! addresses, `--pg-allow` pairs, the log format, and sizes.

use std::net::SocketAddr;

use clap::ValueEnum;

/// A listening address, or `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Listen {
    On(SocketAddr),
    Off,
}

pub(super) fn parse_listen(text: &str) -> Result<Listen, String> {
    if text == "off" {
        return Ok(Listen::Off);
    }
    text.parse()
        .map(Listen::On)
        .map_err(|_| format!("{text:?} is not an address such as 127.0.0.1:7432, nor `off`"))
}

/// One `--pg-allow` pair: a database and a role, either `*` for any.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DoorGrant {
    /// `None`: any database.
    pub database: Option<String>,
    /// `None`: any role.
    pub role: Option<String>,
}

impl DoorGrant {
    /// Whether this pair admits `role` into `database`.
    pub fn admits(&self, database: &str, role: &str) -> bool {
        self.database.as_deref().is_none_or(|d| d == database)
            && self.role.as_deref().is_none_or(|r| r == role)
    }
}

pub(super) fn parse_door_grant(text: &str) -> Result<DoorGrant, String> {
    let (database, role) = text
        .split_once('/')
        .ok_or_else(|| format!("{text:?} is not a pair such as orders/app_writer or orders/*"))?;
    let part = |name: &str, what: &str| match name {
        "*" => Ok(None),
        "" => Err(format!("{text:?} has no {what}: use * for any")),
        name => Ok(Some(name.to_owned())),
    };
    Ok(DoorGrant {
        database: part(database, "database")?,
        role: part(role, "role")?,
    })
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

/// Parses `1048576`, `512KiB`, `1MiB` or `1GiB`.
pub(super) fn parse_size(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let number: usize = digits
        .parse()
        .map_err(|_| format!("{text:?} is not a size such as 1048576 or 1MiB"))?;
    let scale: usize = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        other => {
            return Err(format!(
                "unknown size unit {other:?}: use B, KiB, MiB or GiB"
            ))
        }
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("{text:?} is too large"))
}
