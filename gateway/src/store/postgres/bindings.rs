//! The issuer bindings recorded in the database (`fencegate.issuer_bindings`), which
//! every replica and the in-database fence follow.
//!
//! # Behavior
//!
//! - A gateway adopts the recorded bindings if they are its own `--issued-by` flags,
//!   writes its own if none are recorded, and otherwise refuses to start — unless told
//!   `--replace-issuer-bindings`, which writes its own under a new generation. So one
//!   replica started with other flags cannot weaken the bindings the others rely on.
//! - Running replicas compare the record with their own flags every second: a change
//!   under their generation (an older gateway, a hand edit) is drift, which they undo;
//!   a newer generation is a deliberate replacement, which they report until they are
//!   restarted with the new flags.

use tokio_postgres::Client;

use super::connection;
use super::errors::{classify, Sent};
use crate::config::Binding;
use crate::store::StoreError;

/// One recorded binding: pattern, whether it is a prefix, issuer.
pub type Recorded = (String, bool, String);

/// How a gateway's flags stand to the recorded bindings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adopted {
    /// The record is the gateway's flags, at this generation.
    Same { generation: i64 },
    /// The gateway wrote its flags, at this new generation.
    Written { generation: i64 },
    /// The record differs and was left as it is.
    Differs { recorded: Vec<Recorded> },
}

/// What a running replica found when it looked at the record again.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drift {
    None,
    /// Changed under this replica's generation: restored.
    Restored {
        found: Vec<Recorded>,
    },
    /// Replaced at a newer generation by a gateway with other flags.
    Replaced {
        generation: i64,
    },
}

fn ours(bindings: &[Binding]) -> Vec<Recorded> {
    bindings
        .iter()
        .map(|binding| {
            let (pattern, prefix) = binding.pattern.parts();
            (
                pattern.to_owned(),
                prefix,
                binding.issuer.as_str().to_owned(),
            )
        })
        .collect()
}

async fn recorded(
    client: &impl tokio_postgres::GenericClient,
) -> Result<(Vec<Recorded>, i64), tokio_postgres::Error> {
    let rows = client
        .query(
            "SELECT pattern, prefix, issuer FROM fencegate.issuer_bindings ORDER BY position",
            &[],
        )
        .await?;
    let generation = client
        .query_opt("SELECT generation FROM fencegate.issuer_binding_state", &[])
        .await?
        .map_or(0, |row| row.get(0));
    Ok((
        rows.iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect(),
        generation,
    ))
}

async fn write(
    tx: &tokio_postgres::Transaction<'_>,
    bindings: &[Recorded],
    generation: i64,
) -> Result<(), tokio_postgres::Error> {
    tx.execute("DELETE FROM fencegate.issuer_bindings", &[])
        .await?;
    for (position, (pattern, prefix, issuer)) in (0i32..).zip(bindings) {
        tx.execute(
            "INSERT INTO fencegate.issuer_bindings (position, pattern, prefix, issuer)
             VALUES ($1, $2, $3, $4)",
            &[&position, pattern, prefix, issuer],
        )
        .await?;
    }
    tx.execute(
        "INSERT INTO fencegate.issuer_binding_state (generation) VALUES ($1)
         ON CONFLICT (only_row) DO UPDATE SET generation = EXCLUDED.generation, written_at = now()",
        &[&generation],
    )
    .await?;
    Ok(())
}

/// Adopts, writes or refuses `bindings` at start; see the module doc.
pub(super) async fn adopt(
    client: &mut Client,
    bindings: &[Binding],
    replace: bool,
) -> Result<Adopted, StoreError> {
    let ours = ours(bindings);
    let failed = |e| classify(e, Sent::NoCommit);
    let tx = client.transaction().await.map_err(failed)?;
    tx.batch_execute("LOCK TABLE fencegate.issuer_bindings IN SHARE ROW EXCLUSIVE MODE")
        .await
        .map_err(failed)?;
    let (found, generation) = recorded(&tx).await.map_err(failed)?;
    let adopted = if found == ours && generation > 0 {
        Adopted::Same { generation }
    } else if found == ours || found.is_empty() || replace {
        let generation = generation + 1;
        write(&tx, &ours, generation).await.map_err(failed)?;
        Adopted::Written { generation }
    } else {
        Adopted::Differs { recorded: found }
    };
    connection::committing();
    tx.commit().await.map_err(|e| classify(e, Sent::Commit))?;
    Ok(adopted)
}

/// Looks at the record again, for a replica running at `generation`; see the module doc.
pub(super) async fn follow(
    client: &mut Client,
    bindings: &[Binding],
    generation: i64,
) -> Result<Drift, StoreError> {
    let ours = ours(bindings);
    let failed = |e| classify(e, Sent::NoCommit);
    let (found, recorded_generation) = recorded(&*client).await.map_err(failed)?;
    if found == ours && recorded_generation == generation {
        return Ok(Drift::None);
    }
    if recorded_generation > generation {
        return Ok(Drift::Replaced {
            generation: recorded_generation,
        });
    }
    let tx = client.transaction().await.map_err(failed)?;
    tx.batch_execute("LOCK TABLE fencegate.issuer_bindings IN SHARE ROW EXCLUSIVE MODE")
        .await
        .map_err(failed)?;
    // Looked at again under the lock: a replacement may have come in between.
    let (found, recorded_generation) = recorded(&tx).await.map_err(failed)?;
    if recorded_generation > generation {
        return Ok(Drift::Replaced {
            generation: recorded_generation,
        });
    }
    if found == ours && recorded_generation == generation {
        return Ok(Drift::None);
    }
    write(&tx, &ours, generation).await.map_err(failed)?;
    connection::committing();
    tx.commit().await.map_err(|e| classify(e, Sent::Commit))?;
    Ok(Drift::Restored { found })
}

/// The bindings as `--issued-by` would spell them, for messages.
pub fn describe(bindings: &[Recorded]) -> String {
    if bindings.is_empty() {
        return "none".to_owned();
    }
    bindings
        .iter()
        .map(|(pattern, prefix, issuer)| {
            format!("{issuer}:{pattern}{}", if *prefix { "*" } else { "" })
        })
        .collect::<Vec<_>>()
        .join(",")
}
