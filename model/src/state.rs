//! The state of the modelled system: the lease store, the writers, the network, the
//! gateway replicas, the database, and the history the properties judge.
//!
//! Everything is small and ordered (arrays, sorted vectors, no hash maps), so that a
//! state hashes the same on every run and the checker can rebuild a path to it.

use std::fmt;

/// Lease candidates that write through the gateways.
pub const WRITERS: usize = 2;
/// Gateway replicas in front of the one database.
pub const GATEWAYS: usize = 2;
/// Most resources a model may have; each has one fence and one object.
pub const MAX_RESOURCES: usize = 2;

/// A fencing token: the lease epoch a request was issued under. A fence of 0 means the
/// resource has no fence row yet; real tokens start at 1.
pub type Token = u8;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct State {
    pub lease: Lease,
    pub writers: [Writer; WRITERS],
    /// Requests in flight, as a multiset: kept sorted, because their order means nothing
    /// (any of them may be delivered next).
    pub network: Vec<Request>,
    pub gateways: [Gateway; GATEWAYS],
    pub database: Database,
    pub history: History,
    pub budget: Budget,
}

/// The lease store: one lease, decided atomically on the store's clock.
///
/// Time is kept as the one fact the protocol reads from it: whether the lease has
/// expired. The store's clock passing the expiry is a step of its own (see
/// [`crate::model::Action::Expire`]).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Lease {
    /// The last epoch minted. It rises on every acquisition and never goes down.
    pub epoch: Token,
    pub holder: Option<u8>,
    /// The store's clock has passed the holder's expiry.
    pub expired: bool,
}

impl Lease {
    /// Whether `writer` may acquire: the lease is free, expired, or already its own.
    pub fn available_to(&self, writer: u8) -> bool {
        self.expired || self.holder.is_none() || self.holder == Some(writer)
    }
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Writer {
    /// The epoch of the term this writer believes it leads, if any. The writer's own
    /// clock ends the term before the lease can expire, unless the writer was paused
    /// across the expiry: then it wakes still believing it leads, and sends with this
    /// token until it steps down.
    pub term: Option<Token>,
}

/// A request from a writer to whichever gateway the load balancer picks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Request {
    /// Unique per send (a duplicate keeps it); also the value a put writes.
    pub id: u8,
    pub writer: u8,
    pub token: Token,
    pub resource: u8,
    pub op: Op,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// A put without a precondition: it goes through group commit.
    Put,
    /// A put with `If-Match`: applied only if the object's version is this one (0: the
    /// object must not exist). Its own transaction.
    PutIfVersion(u8),
    /// A fence advance: raise the fence without writing an object.
    Advance,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Gateway {
    /// The fence cache: per resource, the highest token this replica knows to be
    /// committed (0: no entry). Raised only from committed results; it may only reject
    /// early, the database decides everything else.
    pub cache: [Token; MAX_RESOURCES],
    /// Puts without a precondition waiting for this replica's write lane, in arrival
    /// order.
    pub queue: Vec<Request>,
    /// The writes of a rolled-back group, which the lane applies one by one, in order,
    /// before it takes another group.
    pub solo: Vec<Request>,
}

/// The durable store: what Postgres holds.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Database {
    /// Per resource, the highest token committed (`fencegate.fences`).
    pub fence: [Token; MAX_RESOURCES],
    /// Per resource, its one object (`fencegate.objects`).
    pub objects: [Object; MAX_RESOURCES],
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Object {
    /// The id of the put that wrote the current value; 0 if never written.
    pub value: u8,
    /// Rises by one on every applied put; 0 if never written.
    pub version: u8,
}

impl Object {
    pub fn put(&mut self, id: u8) {
        self.value = id;
        self.version += 1;
    }
}

/// What the gateways answered and what happened on the way: records for the properties
/// to judge, not part of the system (nothing in the system reads them).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct History {
    /// Per resource, the highest token an answer acknowledged (a put applied or an
    /// advance applied).
    pub acknowledged: [Token; MAX_RESOURCES],
    /// Per resource, the highest durable fence ever seen.
    pub highest_fence: [Token; MAX_RESOURCES],
    /// Per resource, the object as the acknowledged puts made it: the last one's value,
    /// one version per put.
    pub expected: [Object; MAX_RESOURCES],
    /// What the last step decided, in order; cleared by the next step.
    pub events: Vec<Event>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Event {
    /// A put or an advance committed and was acknowledged; `acknowledged_before` is the
    /// highest token acknowledged on its resource before it.
    Accepted {
        id: u8,
        resource: u8,
        token: Token,
        acknowledged_before: Token,
    },
    /// A request was answered stale: `highest` is the token the answer named, `durable`
    /// the resource's committed fence when the answer was decided.
    Rejected {
        id: u8,
        resource: u8,
        presented: Token,
        highest: Token,
        durable: Token,
        by: Decider,
    },
    /// An `If-Match` did not hold; the transaction rolled back.
    PreconditionFailed { id: u8, resource: u8 },
    /// A group of more than one write committed, `applied` of them applied.
    GroupCommitted { size: u8, applied: u8 },
    /// A group of more than one write was rolled back; its writes go solo.
    GroupRolledBack { size: u8 },
    /// A writer sent a request with a token older than the lease's current epoch: it
    /// slept through a takeover.
    SentAfterTakeover { id: u8, token: Token, epoch: Token },
}

/// Who turned a stale request away.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Decider {
    Cache,
    Database,
}

/// How much of each bounded resource of the model has been used.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Budget {
    pub sent: u8,
    pub duplicated: u8,
    pub rolled_back: u8,
}

/// Inserts into a vector kept sorted (a multiset).
pub(crate) fn insert_sorted(items: &mut Vec<Request>, request: Request) {
    let at = items.partition_point(|item| *item <= request);
    items.insert(at, request);
}

/// Removes one copy of `request` from a sorted vector; false if it is not there.
pub(crate) fn remove_one(items: &mut Vec<Request>, request: &Request) -> bool {
    match items.iter().position(|item| item == request) {
        Some(at) => {
            items.remove(at);
            true
        }
        None => false,
    }
}

/// Writer and gateway names as a trace prints them.
pub fn writer_name(writer: u8) -> char {
    (b'A' + writer) as char
}

impl fmt::Display for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let what = match self.op {
            Op::Put => "put".to_string(),
            Op::PutIfVersion(version) => format!("put If-Match v{version}"),
            Op::Advance => "advance".to_string(),
        };
        write!(
            f,
            "#{} {what} r{} token {} (from {})",
            self.id,
            self.resource,
            self.token,
            writer_name(self.writer)
        )
    }
}

impl State {
    /// One line per part, for traces; `resources` is how many the model has.
    pub fn summary(&self, resources: usize) -> String {
        let list = |requests: &[Request]| {
            requests
                .iter()
                .map(|request| format!("#{}", request.id))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let mut lines = Vec::new();
        lines.push(format!(
            "lease: epoch {}, holder {}, {}",
            self.lease.epoch,
            self.lease
                .holder
                .map_or("none".to_string(), |w| writer_name(w).to_string()),
            if self.lease.expired {
                "expired"
            } else {
                "live"
            }
        ));
        let writers: Vec<String> = self
            .writers
            .iter()
            .enumerate()
            .map(|(w, writer)| match writer.term {
                Some(epoch) => format!("{} leads epoch {epoch}", writer_name(w as u8)),
                None => format!("{} follows", writer_name(w as u8)),
            })
            .collect();
        lines.push(format!("writers: {}", writers.join("; ")));
        lines.push(format!("in flight: [{}]", list(&self.network)));
        for (g, gateway) in self.gateways.iter().enumerate() {
            lines.push(format!(
                "gateway {g}: cache {:?}, lane queue [{}], solo [{}]",
                &gateway.cache[..resources],
                list(&gateway.queue),
                list(&gateway.solo)
            ));
        }
        let objects: Vec<String> = self.database.objects[..resources]
            .iter()
            .enumerate()
            .map(|(r, object)| match object.value {
                0 => format!("r{r} empty"),
                id => format!("r{r} = #{id} v{}", object.version),
            })
            .collect();
        lines.push(format!(
            "database: fence {:?}, {}",
            &self.database.fence[..resources],
            objects.join(", ")
        ));
        lines.join("\n")
    }
}
