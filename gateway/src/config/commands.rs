//! The commands besides `serve`: fenced tables and keys.

use clap::{Args, Subcommand};

use super::Config;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway (the default when no command is given).
    Serve(Box<Config>),
    #[command(flatten)]
    Tables(TablesCommand),
    /// Keys for --auth-file.
    #[command(subcommand)]
    Key(KeyCommand),
}

/// The commands for keys of `--auth-file`.
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Make a new random key. Prints the key (give it to the client, once) and the line
    /// to put in the identity's `keys` list (the file stores only the key's hash).
    New,
    /// Print the hash of a key read from standard input, as the auth file stores it.
    Hash,
}

/// The commands for fenced tables ([`crate::dbfence::admin`]).
#[derive(Debug, Subcommand)]
pub enum TablesCommand {
    /// Fence a table of your own: from now on every INSERT, UPDATE, DELETE, TRUNCATE and
    /// COPY on it (and on its partitions, present and future) must present a current
    /// fencing token for RESOURCE, or it fails inside its transaction. Run it as the
    /// table's owner; writers must not own it.
    Protect(ProtectArgs),
    /// Remove the fence from a table and its partitions.
    Unprotect(UnprotectArgs),
    /// Audit the fenced tables: partitions without the fence, triggers not enabled
    /// ALWAYS, writers that own fenced tables, roles that can write fencegate's own
    /// tables. Exits 1 if it finds a problem.
    Check(CheckArgs),
}

#[derive(Debug, Clone, Args)]
pub struct ProtectArgs {
    /// The table, as SQL names it: `orders`, `app.orders`, `"Orders"`.
    pub table: String,
    /// The fence scope: the name of the lease whose tokens writers present.
    #[arg(long)]
    pub resource: String,
    #[command(flatten)]
    pub database: AdminDatabase,
}

#[derive(Debug, Clone, Args)]
pub struct UnprotectArgs {
    /// The table, as SQL names it.
    pub table: String,
    #[command(flatten)]
    pub database: AdminDatabase,
}

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    #[command(flatten)]
    pub database: AdminDatabase,
}

#[derive(Debug, Clone, Args)]
pub struct AdminDatabase {
    /// Postgres connection string of a role that owns the tables (and may create or
    /// migrate schema `fencegate`).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
}
