//! The door's share of the database's connection slots, settled at start.
//!
//! Every door session is a connection to the server, so `--pg-max-connections` door
//! sessions and the gateway's own pools must fit together in what the server lets
//! ordinary logins have: `max_connections` less `superuser_reserved_connections` and
//! (PostgreSQL 16 on) `reserved_connections`. Otherwise door clients could take the
//! last slots and leave the gateway's pools unable to reconnect.
//!
//! A `--pg-max-connections` given explicitly that does not fit stops the start, with the
//! numbers; the default is lowered to what fits, with a warning. If the pools alone do
//! not fit, the start stops either way. Other clients of the server are not counted:
//! leave room for them in `max_connections`.

use crate::config::{Config, IssuerKind};
use crate::store::PgStore;

/// The pool of the `leader_lease` issuer: see `crate::issuers`.
const LEADER_LEASE_POOL: usize = 4;

/// What the server allows, as read from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ServerSlots {
    pub(crate) max_connections: usize,
    pub(crate) superuser_reserved: usize,
    /// `reserved_connections`; 0 before PostgreSQL 16.
    pub(crate) reserved: usize,
}

impl ServerSlots {
    /// The slots any login may take.
    fn open(&self) -> usize {
        self.max_connections
            .saturating_sub(self.superuser_reserved)
            .saturating_sub(self.reserved)
    }

    fn describe(&self) -> String {
        format!(
            "max_connections = {}, less superuser_reserved_connections = {} and \
             reserved_connections = {}, leaves {}",
            self.max_connections,
            self.superuser_reserved,
            self.reserved,
            self.open()
        )
    }
}

/// The gateway's own connections to the server of `--database-url`, by the flag that
/// sets each pool.
pub(crate) fn gateway_pools(config: &Config) -> Vec<(&'static str, usize)> {
    let mut pools = vec![
        ("--pool-size", config.store.pool_size),
        ("--write-lanes", config.store.write_lanes),
    ];
    if config.sql.enabled {
        pools.push(("--sql-pool-size", config.sql.sql_pool_size));
    }
    let leader_lease = config
        .issuers
        .bindings
        .iter()
        .any(|binding| binding.issuer == IssuerKind::LeaderLease);
    if leader_lease && config.issuers.leader_lease_url.is_none() {
        pools.push(("the leader_lease issuer", LEADER_LEASE_POOL));
    }
    pools
}

/// What the door's connection cap is to be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Fit {
    /// The cap fits as it is.
    Fits(usize),
    /// The default cap did not fit, and is lowered.
    Lowered { from: usize, to: usize },
}

/// Settles the door's cap (`wanted`; `explicit` if the operator gave it) against the
/// server's slots and the gateway's `pools`; `Err` says why the gateway cannot start.
pub(crate) fn fit(
    wanted: usize,
    explicit: bool,
    server: ServerSlots,
    pools: &[(&'static str, usize)],
) -> Result<Fit, String> {
    let own: usize = pools.iter().map(|(_, size)| size).sum();
    let listed = pools
        .iter()
        .map(|(flag, size)| format!("{flag} {size}"))
        .collect::<Vec<_>>()
        .join(", ");
    let room = server.open().saturating_sub(own);
    if room == 0 {
        return Err(format!(
            "the database's connection slots ({}) leave none for the Postgres door once the \
             gateway's own pools have theirs ({own}: {listed}); raise max_connections on the \
             server, lower the pools, or turn the door off with --pg-listen off",
            server.describe()
        ));
    }
    if wanted <= room {
        return Ok(Fit::Fits(wanted));
    }
    if explicit {
        return Err(format!(
            "--pg-max-connections {wanted} does not fit the database: {}, and the gateway's \
             own pools take {own} of them ({listed}), so door clients could take the slots \
             the gateway needs. Lower --pg-max-connections to {room} or less, lower the \
             pools, or raise max_connections on the server",
            server.describe()
        ));
    }
    Ok(Fit::Lowered {
        from: wanted,
        to: room,
    })
}

/// Reads the server's slots and settles the door's cap; logs a warning if the default
/// was lowered.
pub(crate) async fn settle(config: &Config, pg: &PgStore) -> Result<usize, String> {
    let server = read(pg).await?;
    let pools = gateway_pools(config);
    let wanted = config.pg_max_connections();
    match fit(
        wanted,
        config.door.pg_max_connections.is_some(),
        server,
        &pools,
    )? {
        Fit::Fits(cap) => Ok(cap),
        Fit::Lowered { from, to } => {
            let own: usize = pools.iter().map(|(_, size)| size).sum();
            tracing::warn!(
                max_connections = server.max_connections,
                superuser_reserved_connections = server.superuser_reserved,
                reserved_connections = server.reserved,
                gateway_pools = own,
                pg_max_connections = to,
                "the default --pg-max-connections {from} does not fit the database's \
                 connection slots with the gateway's own pools; the door takes at most {to} \
                 connections. Set --pg-max-connections, or raise max_connections on the \
                 server"
            );
            Ok(to)
        }
    }
}

async fn read(pg: &PgStore) -> Result<ServerSlots, String> {
    let values = pg
        .server_settings(&[
            "max_connections",
            "superuser_reserved_connections",
            "reserved_connections",
        ])
        .await
        .map_err(|error| format!("could not read the database's max_connections: {error}"))?;
    let number = |index: usize| -> Result<usize, String> {
        match values.get(index).cloned().flatten() {
            // reserved_connections is absent before PostgreSQL 16.
            None => Ok(0),
            Some(text) => text
                .parse()
                .map_err(|_| format!("the database's setting {text:?} is not a number")),
        }
    };
    Ok(ServerSlots {
        max_connections: number(0)?,
        superuser_reserved: number(1)?,
        reserved: number(2)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: ServerSlots = ServerSlots {
        max_connections: 20,
        superuser_reserved: 3,
        reserved: 0,
    };

    #[test]
    fn a_cap_that_fits_stays() {
        let pools = [("--pool-size", 4), ("--write-lanes", 1)];
        assert_eq!(fit(12, true, SMALL, &pools), Ok(Fit::Fits(12)));
        assert_eq!(fit(5, false, SMALL, &pools), Ok(Fit::Fits(5)));
    }

    #[test]
    fn an_explicit_cap_too_large_stops_the_start_with_the_numbers() {
        let pools = [("--pool-size", 4), ("--write-lanes", 1)];
        let error = fit(64, true, SMALL, &pools).unwrap_err();
        for part in [
            "--pg-max-connections 64",
            "max_connections = 20",
            "superuser_reserved_connections = 3",
            "--pool-size 4, --write-lanes 1",
            "to 12 or less",
        ] {
            assert!(error.contains(part), "{part:?} in {error}");
        }
    }

    #[test]
    fn the_default_is_lowered_to_what_fits() {
        let pools = [("--pool-size", 4), ("--write-lanes", 1)];
        let reserved = ServerSlots {
            reserved: 2,
            ..SMALL
        };
        assert_eq!(
            fit(64, false, reserved, &pools),
            Ok(Fit::Lowered { from: 64, to: 10 })
        );
    }

    #[test]
    fn pools_that_take_every_slot_stop_the_start() {
        let pools = [("--pool-size", 16), ("--write-lanes", 2)];
        let error = fit(64, false, SMALL, &pools).unwrap_err();
        assert!(error.contains("--pg-listen off"), "{error}");
    }
}
