//! The fence cache: resource -> highest token known to be committed.
//!
//! # Invariant
//!
//! An entry is never above the durable highest token of its resource: it is raised
//! only from results the backend has committed (or read after commit), and only
//! upwards. So a rejection from the cache is always correct, and the cache may only
//! reject early — the database decides everything else. Losing an entry (eviction,
//! restart) loses the shortcut, never correctness.
//!
//! # Resets
//!
//! An administrator's fence reset ([`crate::store::leases`]) lowers a durable fence,
//! which the invariant above does not foresee. A replica that learns of a reset
//! [forgets](FenceCache::forget) the resource, and moves the cache to a new
//! *generation*: a result read before the reset but reported after it carries the old
//! generation ([`CacheGeneration`]) and is ignored, so the forgotten value cannot come back.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use dashmap::DashMap;
use fencegate_proto::{ResourceName, Token};

/// What the cache knows about one resource.
#[derive(Debug, Default)]
struct Cached {
    /// Highest committed token seen; 0 only transiently, before the first raise.
    highest: AtomicU64,
    /// Stale rejections since this entry was created, for logs.
    rejections: AtomicU64,
}

/// A bounded map of resource -> highest committed token.
#[derive(Debug)]
pub struct FenceCache {
    map: DashMap<Box<str>, Cached>,
    /// Tracks `map.len()` without visiting every shard.
    len: AtomicUsize,
    capacity: usize,
    /// Moves on at every reset; see the module doc.
    generation: AtomicU64,
}

/// The cache generation a backend call started in: its results may raise the cache
/// only if no reset was learned since.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheGeneration(u64);

/// The outcome of [`FenceCache::raise`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raised {
    /// Whether the value went up (false if the cache already knew this token or a higher one).
    pub changed: bool,
}

impl FenceCache {
    pub fn new(capacity: usize) -> FenceCache {
        FenceCache {
            map: DashMap::new(),
            len: AtomicUsize::new(0),
            capacity: capacity.max(1),
            generation: AtomicU64::new(0),
        }
    }

    /// The generation now: taken before a backend call whose result will raise the cache.
    pub fn seen(&self) -> CacheGeneration {
        CacheGeneration(self.generation.load(Ordering::Acquire))
    }

    /// Records that `token` was committed for `resource` by a call that started at
    /// `seen`; ignored if a reset was learned since.
    pub fn raise_seen(
        &self,
        resource: &ResourceName,
        token: Token,
        seen: CacheGeneration,
    ) -> Raised {
        if self.seen() != seen {
            return Raised { changed: false };
        }
        let raised = self.raise(resource, token);
        if self.seen() != seen {
            // A reset was learned while raising: whatever was written goes too.
            self.remove(resource);
            return Raised { changed: false };
        }
        raised
    }

    /// Forgets `resource` after a reset of its fence, and starts a new generation.
    pub fn forget(&self, resource: &ResourceName) {
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.remove(resource);
    }

    fn remove(&self, resource: &ResourceName) {
        if self.map.remove(resource.as_str()).is_some() {
            self.len.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// If `token` is below the highest committed token cached for `resource`: that
    /// highest, and the resource's count of rejections, this one included. One lookup —
    /// this is what each request of a stale flood costs the cache.
    pub fn reject_below(&self, resource: &ResourceName, token: Token) -> Option<(Token, u64)> {
        let entry = self.map.get(resource.as_str())?;
        let highest = Token::new(entry.highest.load(Ordering::Acquire)).ok()?;
        if token >= highest {
            return None;
        }
        Some((
            highest,
            entry.rejections.fetch_add(1, Ordering::Relaxed) + 1,
        ))
    }

    /// The highest committed token known for `resource`, if cached.
    pub fn highest(&self, resource: &ResourceName) -> Option<Token> {
        let entry = self.map.get(resource.as_str())?;
        Token::new(entry.highest.load(Ordering::Acquire)).ok()
    }

    /// Records that `token` is committed for `resource` (never lowers the entry).
    ///
    /// Callers pass only tokens read from a committed result: this is what keeps the
    /// cache's invariant.
    pub fn raise(&self, resource: &ResourceName, token: Token) -> Raised {
        if let Some(entry) = self.map.get(resource.as_str()) {
            let previous = entry.highest.fetch_max(token.get(), Ordering::AcqRel);
            return Raised {
                changed: previous < token.get(),
            };
        }
        self.make_room();
        let entry = self.map.entry(resource.as_str().into()).or_insert_with(|| {
            self.len.fetch_add(1, Ordering::Relaxed);
            Cached::default()
        });
        let previous = entry.highest.fetch_max(token.get(), Ordering::AcqRel);
        Raised {
            changed: previous < token.get(),
        }
    }

    /// Counts a stale rejection for `resource` and returns the count since the entry was
    /// created. `highest` is the committed token that caused the rejection, read by a
    /// call that started at `seen`.
    pub fn count_rejection(
        &self,
        resource: &ResourceName,
        highest: Token,
        seen: CacheGeneration,
    ) -> u64 {
        self.raise_seen(resource, highest, seen);
        self.count_reported_rejection(resource)
    }

    /// Counts a stale rejection whose `highest` the cache must not learn: one the
    /// database reported from inside a transaction, where the highest it names may be
    /// the transaction's own raise, which its failure rolls back.
    pub fn count_reported_rejection(&self, resource: &ResourceName) -> u64 {
        match self.map.get(resource.as_str()) {
            Some(entry) => entry.rejections.fetch_add(1, Ordering::Relaxed) + 1,
            // Evicted between the two calls; the count restarts.
            None => 1,
        }
    }

    /// Every resource and its cached token, in batches of at most `batch`.
    pub fn snapshot(&self, batch: usize) -> Vec<Vec<(ResourceName, Token)>> {
        let mut batches: Vec<Vec<(ResourceName, Token)>> = Vec::new();
        for entry in self.map.iter() {
            let (Ok(resource), Ok(token)) = (
                ResourceName::new(&**entry.key()),
                Token::new(entry.highest.load(Ordering::Acquire)),
            ) else {
                continue;
            };
            match batches.last_mut() {
                Some(last) if last.len() < batch => last.push((resource, token)),
                _ => batches.push(vec![(resource, token)]),
            }
        }
        batches
    }

    pub fn len(&self) -> usize {
        self.len.load(Ordering::Relaxed)
    }

    /// Evicts about an eighth of the entries when the cache is full.
    ///
    /// Which entries go is arbitrary (hash order): any choice is safe, and a sweep over
    /// the map every `capacity / 8` insertions keeps the amortised cost per insertion
    /// constant without any per-entry bookkeeping on the read path.
    fn make_room(&self) {
        if self.len() < self.capacity {
            return;
        }
        let target = self.capacity - self.capacity / 8 - 1;
        let mut excess = self.len().saturating_sub(target);
        self.map.retain(|_, _| {
            if excess == 0 {
                return true;
            }
            excess -= 1;
            self.len.fetch_sub(1, Ordering::Relaxed);
            false
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn res(name: &str) -> ResourceName {
        ResourceName::new(name).unwrap()
    }
    fn tok(value: u64) -> Token {
        Token::new(value).unwrap()
    }

    #[test]
    fn only_a_token_below_the_cached_highest_is_rejected_and_counted() {
        let cache = FenceCache::new(10);
        assert_eq!(
            cache.reject_below(&res("a"), tok(1)),
            None,
            "nothing cached"
        );
        cache.raise(&res("a"), tok(5));
        assert_eq!(cache.reject_below(&res("a"), tok(5)), None);
        assert_eq!(cache.reject_below(&res("a"), tok(6)), None);
        assert_eq!(cache.reject_below(&res("a"), tok(4)), Some((tok(5), 1)));
        assert_eq!(cache.reject_below(&res("a"), tok(1)), Some((tok(5), 2)));
        // The count is the one the other rejections add to.
        assert_eq!(cache.count_reported_rejection(&res("a")), 3);
        assert_eq!(cache.highest(&res("a")), Some(tok(5)), "unchanged");
    }

    #[test]
    fn raises_never_lower() {
        let cache = FenceCache::new(10);
        assert_eq!(cache.highest(&res("a")), None);
        assert!(cache.raise(&res("a"), tok(42)).changed);
        assert!(!cache.raise(&res("a"), tok(41)).changed);
        assert!(!cache.raise(&res("a"), tok(42)).changed);
        assert_eq!(cache.highest(&res("a")), Some(tok(42)));
        let seen = cache.seen();
        assert_eq!(cache.count_rejection(&res("a"), tok(42), seen), 1);
        assert_eq!(cache.count_rejection(&res("a"), tok(43), seen), 2);
        assert_eq!(cache.highest(&res("a")), Some(tok(43)));
    }

    #[test]
    fn a_reset_is_not_undone_by_results_read_before_it() {
        let cache = FenceCache::new(10);
        let before = cache.seen();
        cache.raise_seen(&res("a"), Token::MAX, before);
        cache.forget(&res("a"));
        assert_eq!(cache.highest(&res("a")), None);
        // A write that started before the reset reports late.
        assert!(!cache.raise_seen(&res("a"), Token::MAX, before).changed);
        assert_eq!(cache.highest(&res("a")), None);
        assert_eq!(cache.len(), 0);
        let after = cache.seen();
        assert!(cache.raise_seen(&res("a"), tok(9), after).changed);
        assert_eq!(cache.highest(&res("a")), Some(tok(9)));
    }

    #[test]
    fn snapshot_holds_every_entry_in_batches_of_at_most_the_size() {
        let cache = FenceCache::new(100);
        assert!(cache.snapshot(2).is_empty());
        for i in 1..=5 {
            cache.raise(&res(&format!("r{i}")), tok(i * 10));
        }
        let batches = cache.snapshot(2);
        let mut sizes: Vec<usize> = batches.iter().map(Vec::len).collect();
        sizes.sort_unstable();
        assert_eq!(sizes, [1, 2, 2]);
        let mut all: Vec<(ResourceName, Token)> = batches.into_iter().flatten().collect();
        all.sort_by_key(|(_, token)| *token);
        let expected: Vec<(ResourceName, Token)> = (1..=5)
            .map(|i| (res(&format!("r{i}")), tok(i * 10)))
            .collect();
        assert_eq!(all, expected);
        assert_eq!(cache.snapshot(5).len(), 1);
    }

    /// At the capacity, the next new resource evicts an eighth: the cache then holds
    /// `capacity - capacity / 8` entries, its count matching its map.
    #[test]
    fn a_full_cache_evicts_an_eighth_for_a_new_resource() {
        let cache = FenceCache::new(64);
        for i in 0..64 {
            cache.raise(&res(&format!("r{i}")), tok(i + 1));
        }
        assert_eq!(cache.len(), 64, "full, nothing evicted yet");
        // A raise of a resource already cached makes no room.
        cache.raise(&res("r0"), tok(100));
        assert_eq!(cache.len(), 64);
        cache.raise(&res("new"), tok(1));
        assert_eq!(cache.len(), 64 - 64 / 8);
        assert_eq!(cache.len(), cache.map.len());
        assert_eq!(cache.highest(&res("new")), Some(tok(1)));
    }

    #[test]
    fn stays_within_capacity() {
        let cache = FenceCache::new(100);
        for i in 0..1000 {
            cache.raise(&res(&format!("r{i}")), tok(i + 1));
            assert!(cache.len() <= 100, "len {} after {i}", cache.len());
        }
        assert_eq!(cache.len(), cache.map.len());
        // Whatever survived still holds exactly what was raised.
        for entry in cache.map.iter() {
            let i: u64 = entry.key()[1..].parse().unwrap();
            assert_eq!(entry.highest.load(Ordering::Relaxed), i + 1);
        }
    }
}
