//! The commands besides `serve`: the operator's commands on a database, and keys.

use clap::{Args, Subcommand};

use super::Config;

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the gateway (the default when no command is given).
    Serve(Box<Config>),
    #[command(flatten)]
    Admin(AdminCommand),
    /// Keys for --auth-file.
    #[command(subcommand)]
    Key(KeyCommand),
}

/// The commands for keys of `--auth-file`.
#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Make a new random key, and the hash to store for it.
    ///
    /// Make a new random key. Prints the key (give it to the client, once) and the line
    /// to put in the identity's `keys` list (the file stores only the key's hash).
    New,
    /// Print the hash of a key read from standard input.
    ///
    /// Print the hash of a key read from standard input, as the auth file stores it.
    Hash,
}

/// The operator's commands on a database ([`crate::admin`]): fenced tables, the grants
/// of resources, and `leader_lease` tables.
#[derive(Debug, Subcommand)]
pub enum AdminCommand {
    /// Fence a table: its writes must then present a current token.
    ///
    /// Fence a table of your own: from now on every INSERT, UPDATE, DELETE, TRUNCATE and
    /// COPY on it (and on its partitions, present and future) must present a current
    /// fencing token for RESOURCE, or it fails inside its transaction. Run it as the
    /// table's owner; writers must not own it.
    Protect(ProtectArgs),
    /// Remove the fence from a table and its partitions.
    Unprotect(UnprotectArgs),
    /// Audit the fenced tables; exits 1 if it finds a problem.
    ///
    /// Audit the fenced tables: partitions and families without the fence, triggers not
    /// enabled ALWAYS or not installed by protect, writers that own fenced tables, roles
    /// that can write fencegate's own tables or reach its functions, prepared
    /// transactions. Exits 1 if it finds a problem.
    Check(CheckArgs),
    /// Let a database role hold resources, or fence its own tables.
    ///
    /// Let a database role present and raise the fences of resources (writers: the
    /// Postgres door, direct connections, electors of a leader_lease table), or fence
    /// tables it owns (--tables). Run it as the owner of schema fencegate (the
    /// gateway's login) or a superuser.
    Grant(GrantArgs),
    /// Take back what `grant` gave a role.
    ///
    /// Take back what `grant` gave a role: the resources named, or all of them. Run it
    /// as the owner of schema fencegate (the gateway's login) or a superuser.
    Revoke(RevokeArgs),
    /// List who holds which resources, and who may fence tables.
    ///
    /// List the roles and the resources they hold, and the roles that may fence tables.
    /// Run it as the owner of schema fencegate (the gateway's login) or a superuser: no
    /// other role may read the grants.
    Grants(GrantsArgs),
    /// A seed `leader_lease` table as an issuer its electors cannot forge.
    #[command(subcommand)]
    LeaderLease(LeaderLeaseCommand),
}

/// The commands for `leader_lease` tables.
#[derive(Debug, Subcommand)]
pub enum LeaderLeaseCommand {
    /// Guard the table, so that electors cannot forge epochs.
    ///
    /// Guard the table: from now on an elector raises a lease's epoch by exactly one,
    /// only on a new term (lease free, expired, or held by its own role), only for
    /// resources it holds (fencegate grant), and never deletes a lease. The seed's
    /// acquire, renew and release statements keep working. Adds the column
    /// holder_role, the role that took the term. Run it as the table's owner.
    Guard(LeaseTableArgs),
    /// Retire a forged lease record.
    ///
    /// Retire a forged lease record: set its epoch back to EPOCH, the last one really
    /// issued, and record who, when and why. Then reset the resource's fence past the
    /// forged token (POST /v1/fences/{resource}/reset). Run it as the table's owner.
    Retire(RetireArgs),
}

#[derive(Debug, Clone, Args)]
pub struct GrantArgs {
    /// The database role, as Postgres spells it (case matters).
    pub role: String,
    /// A resource the role may present and raise (repeatable).
    ///
    /// A resource the role may present and raise: a name, or a prefix followed by one
    /// `*` (`orders-*`), as the patterns of --auth-file. Repeatable.
    #[arg(long = "resource", value_parser = parse_pattern, value_name = "PATTERN")]
    pub resources: Vec<crate::auth::Pattern>,
    /// Let the role fence, unfence and audit tables it owns (protect, unprotect, check).
    #[arg(long)]
    pub tables: bool,
    #[command(flatten)]
    pub database: SchemaOwnerDatabase,
}

#[derive(Debug, Clone, Args)]
pub struct RevokeArgs {
    /// The database role.
    pub role: String,
    /// A resource pattern to take back, as granted (repeatable).
    ///
    /// A resource pattern to take back, as granted. Without any: every resource, and
    /// the right to call fencegate.fence().
    #[arg(long = "resource", value_parser = parse_pattern, value_name = "PATTERN")]
    pub resources: Vec<crate::auth::Pattern>,
    /// Take back the right to fence tables.
    #[arg(long)]
    pub tables: bool,
    #[command(flatten)]
    pub database: SchemaOwnerDatabase,
}

#[derive(Debug, Clone, Args)]
pub struct GrantsArgs {
    #[command(flatten)]
    pub database: SchemaOwnerDatabase,
}

#[derive(Debug, Clone, Args)]
pub struct LeaseTableArgs {
    /// The leader_lease table, optionally schema-qualified.
    #[arg(long, default_value = super::issuers::DEFAULT_LEADER_LEASE_TABLE, value_parser = super::issuers::parse_table)]
    pub table: String,
    #[command(flatten)]
    pub database: AdminDatabase,
}

#[derive(Debug, Clone, Args)]
pub struct RetireArgs {
    /// The lease (the resource) whose record was forged.
    pub resource: String,
    /// The epoch to go back to: the last one really issued.
    #[arg(long)]
    pub epoch: i64,
    /// Why, for the record (an incident number, who asked).
    #[arg(long)]
    pub reason: String,
    #[command(flatten)]
    pub table: LeaseTableArgs,
}

fn parse_pattern(text: &str) -> Result<crate::auth::Pattern, String> {
    crate::auth::Pattern::parse(text)
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

// The database of `protect`, `unprotect`, `check` and `leader-lease`. (A doc comment
// here would become the `about` of every command that flattens it.)
#[derive(Debug, Clone, Args)]
pub struct AdminDatabase {
    /// Postgres connection string of a role that owns the tables.
    ///
    /// Postgres connection string of a role that owns the tables (and may create or
    /// migrate schema `fencegate`).
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: String,
}

// The database of `grant`, `revoke` and `grants`, which read and change who holds
// what.
#[derive(Debug, Clone, Args)]
pub struct SchemaOwnerDatabase {
    /// Postgres connection string of schema fencegate's owner, or of a superuser.
    ///
    /// Postgres connection string of the owner of schema `fencegate` (the gateway's
    /// login) or of a superuser: the grants are rows of the schema's own tables, which
    /// no other role may read or write, and privileges on its functions, which only
    /// their owner or a superuser may give or take back. Owning the writers' tables is
    /// not enough. The schema is first brought to this binary's version, as the gateway
    /// does at start.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true, value_name = "URL")]
    pub database_url: String,
}
