//! The seed's Redis recipe, with a fencing token minted in the same step.
//!
//! The lease is one key, `<prefix><lease>`, holding `<epoch>:<holder>` with a `PX`
//! expiry; the token counter is a second key, `<prefix><lease>:epoch`. Each operation
//! is one Lua script, which Redis runs atomically:
//!
//! - acquire: if the key is absent (the seed's `SET NX PX`) or holds our identity,
//!   `INCR` the counter and `SET` the key to `<new epoch>:<holder> PX ttl`;
//! - renew: `PEXPIRE` only if the key still reads `<epoch>:<holder>`;
//! - release: `DEL` only if the key still reads `<epoch>:<holder>` (the seed's
//!   compare-then-delete).
//!
//! # What this store guarantees, and what it does not
//!
//! - One Redis server, no replicas in the decision: a failover to a replica that had
//!   not received the latest `SET` can grant the lease twice. Do not use Sentinel or
//!   Cluster failover for this store (or accept that the gateway's fence, not the
//!   lease, is then what keeps writes safe).
//! - Expiry runs on the Redis server's clock; clocks of the lease holders do not
//!   matter, but a Redis clock jump shortens or lengthens leases.
//! - Tokens rise only as long as the counter key survives. Without persistence, a
//!   Redis restart resets the counter and hands out tokens that were handed out
//!   before: the gateway then rejects the new leader's writes as stale (safe, but the
//!   leader cannot work until the counter passes the gateway's highest token). To make
//!   tokens never repeat, run Redis with `appendonly yes` and `appendfsync always`
//!   (every `INCR` on disk before the reply), or use the Postgres store.

use std::sync::Mutex;
use std::time::Duration;

use fencegate_proto::Token;
use redis::aio::MultiplexedConnection;
use redis::Script;

use super::{token_of, ForgetOnDrop, LeaseStore, StoreError};

/// The key prefix used unless another is given.
pub const DEFAULT_PREFIX: &str = "fencegate:lease:";

const ACQUIRE: &str = r"
local current = redis.call('GET', KEYS[1])
if current then
  local sep = string.find(current, ':', 1, true)
  if not sep or string.sub(current, sep + 1) ~= ARGV[1] then
    return false
  end
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], epoch .. ':' .. ARGV[1], 'PX', ARGV[2])
return epoch
";

const RENEW: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
";

const RELEASE: &str = r"
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
";

/// Leases as Redis keys with a minted counter token.
pub struct RedisStore {
    client: redis::Client,
    prefix: String,
    /// The open connection, if any; a multiplexed connection is cheap to clone.
    conn: Mutex<Option<MultiplexedConnection>>,
    acquire: Script,
    renew: Script,
    release: Script,
}

impl RedisStore {
    /// A store on `url` (`redis://127.0.0.1:6379`), its keys starting with `prefix`.
    pub fn new(url: &str, prefix: &str) -> Result<RedisStore, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|_| StoreError::Invalid("the Redis URL does not parse".into()))?;
        Ok(RedisStore {
            client,
            prefix: prefix.to_owned(),
            conn: Mutex::new(None),
            acquire: Script::new(ACQUIRE),
            renew: Script::new(RENEW),
            release: Script::new(RELEASE),
        })
    }

    /// The key holding the lease.
    pub fn lease_key(&self, lease: &str) -> String {
        format!("{}{lease}", self.prefix)
    }

    /// The key holding the lease's token counter.
    pub fn counter_key(&self, lease: &str) -> String {
        format!("{}{lease}:epoch", self.prefix)
    }

    async fn conn(&self) -> Result<MultiplexedConnection, StoreError> {
        if let Some(conn) = self.conn.lock().unwrap().as_ref() {
            return Ok(conn.clone());
        }
        let conn = self
            .client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| StoreError::Unavailable(e.to_string()))?;
        *self.conn.lock().unwrap() = Some(conn.clone());
        Ok(conn)
    }

    /// Turns a failed call into a store error, dropping a connection that broke.
    fn failed(&self, error: redis::RedisError) -> StoreError {
        if error.is_io_error() || error.is_connection_dropped() || error.is_timeout() {
            *self.conn.lock().unwrap() = None;
            StoreError::Unavailable(error.to_string())
        } else {
            StoreError::Unexpected(error.to_string())
        }
    }
}

fn value(epoch: Token, holder: &str) -> String {
    format!("{epoch}:{holder}")
}

fn millis(ttl: Duration) -> u64 {
    u64::try_from(ttl.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl LeaseStore for RedisStore {
    async fn acquire(
        &self,
        lease: &str,
        holder: &str,
        ttl: Duration,
    ) -> Result<Option<Token>, StoreError> {
        let mut conn = self.conn().await?;
        let abandoned = ForgetOnDrop::new(|| *self.conn.lock().unwrap() = None);
        let result: redis::RedisResult<Option<i64>> = self
            .acquire
            .key(self.lease_key(lease))
            .key(self.counter_key(lease))
            .arg(holder)
            .arg(millis(ttl))
            .invoke_async(&mut conn)
            .await;
        abandoned.completed();
        let epoch = result.map_err(|e| self.failed(e))?;
        epoch.map(|e| token_of(e, "counter")).transpose()
    }

    async fn renew(
        &self,
        lease: &str,
        holder: &str,
        epoch: Token,
        ttl: Duration,
    ) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let abandoned = ForgetOnDrop::new(|| *self.conn.lock().unwrap() = None);
        let result: redis::RedisResult<i64> = self
            .renew
            .key(self.lease_key(lease))
            .arg(value(epoch, holder))
            .arg(millis(ttl))
            .invoke_async(&mut conn)
            .await;
        abandoned.completed();
        let renewed = result.map_err(|e| self.failed(e))?;
        Ok(renewed == 1)
    }

    async fn release(&self, lease: &str, holder: &str, epoch: Token) -> Result<bool, StoreError> {
        let mut conn = self.conn().await?;
        let abandoned = ForgetOnDrop::new(|| *self.conn.lock().unwrap() = None);
        let result: redis::RedisResult<i64> = self
            .release
            .key(self.lease_key(lease))
            .arg(value(epoch, holder))
            .invoke_async(&mut conn)
            .await;
        abandoned.completed();
        let deleted = result.map_err(|e| self.failed(e))?;
        Ok(deleted == 1)
    }
}
