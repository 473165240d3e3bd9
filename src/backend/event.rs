//! What a worker and its Redis thread say to each other: the zones the
//! thread serves (`ZoneSpec`), and what it hands back (`Event`): Redis's
//! counts, increments that stay local, log lines.

use ratelimit_core::tickets::Ticket;
use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::time::Duration;

use ratelimit_core::batch::ItemId;
use ratelimit_core::control::{Held, Kind as ControlKind};
use ratelimit_core::counter::Confirmation;
use ratelimit_core::key::Tag;
use ratelimit_core::params::Sentinel;
use ratelimit_core::stats::Stats;
use ratelimit_core::strict::{self, Answer, Kind, Request};
use smallvec::SmallVec;

/// Items per pipeline.
pub const PIPELINE_ITEMS: usize = 1024;

/// A zone with a Redis backend, as the thread needs it.
#[derive(Clone, Debug)]
pub struct ZoneSpec {
    pub index: u32,
    pub name: String,
    pub urls: Vec<String>,
    pub cluster: bool,
    /// `sentinel=`: the master's name, and what the sentinels are asked
    /// with (the URLs are sentinels).
    pub sentinel: Option<Sentinel>,
    pub prefix: Vec<u8>,
    pub timeout: Duration,
    /// `ssl_*=`: the CA and client certificate every `rediss://`
    /// connection uses, and the name it verifies.
    pub tls: super::io::Tls,
    /// A `strict` limit uses the zone (its workers may get strict links).
    pub strict: bool,
    /// `on_error=share`: the thread keeps the zone's node count
    /// (`fleet.rs`).
    pub share: bool,
    /// The zone's shared memory: how many keys the operator expects it to
    /// hold (bounds what the thread remembers per key).
    pub bytes: usize,
    /// The zone's figures in shared memory (`None`: not mapped here).
    pub stats: Option<StatsRef>,
    /// The zone's ring to the node's sender and its lease (`None`: not
    /// mapped here; the thread then sends the zone's counts itself).
    pub ring: Option<super::RingRef>,
}

impl ZoneSpec {
    /// Whether the zone's strict calls may go down a worker's own
    /// connection (`link.rs`): on a single Redis or through Sentinel,
    /// without TLS. A zone that a `strict` limit uses gets one at once;
    /// another when a small limit is first decided by Redis (`exact`).
    pub fn may_link(&self) -> bool {
        !self.cluster
            && self.urls.iter().all(|u| {
                let u = u.to_ascii_lowercase();
                !u.starts_with("rediss:") && !u.starts_with("valkeys:")
            })
    }
}

/// A zone's figures in shared memory, for its Redis thread to count in.
#[derive(Clone, Copy, Debug)]
pub struct StatsRef(*const Stats);

// SAFETY: the figures are atomics in the zone's shared memory, mapped at one
// address for the worker's whole life; the thread that holds this is joined
// (`exit_process`) before the worker unmaps anything.
unsafe impl Send for StatsRef {}

impl StatsRef {
    pub fn new(stats: &Stats) -> StatsRef {
        StatsRef(stats)
    }

    pub fn get(&self) -> &Stats {
        // SAFETY: see the `Send` impl: the pointer stays valid while the
        // thread runs.
        unsafe { &*self.0 }
    }
}

/// One limit of a strict request, for the thread to decide in Redis.
#[derive(Debug)]
pub struct StrictAsk {
    /// Names the waiting request (and which of its limits) in the answer.
    pub ticket: Ticket,
    pub id: ItemId,
    /// The key's hash tag (`key::redis_tag`).
    pub tag: Tag,
    pub period: u32,
    pub limit: u32,
    /// What Redis decides: the key's window, its bucket, or its slots.
    pub kind: Kind,
    pub cost: u32,
    /// When the request stops waiting (ms since the epoch, this node's
    /// clock; 0: none): a script that runs later does not count it.
    pub deadline_ms: u64,
}

/// The strict limits of one key and limit that wait together: one script
/// call answers them all, in order.
#[derive(Debug)]
pub struct StrictGroup {
    pub id: ItemId,
    pub tag: Tag,
    pub period: u32,
    pub limit: u32,
    pub kind: Kind,
    pub requests: Each<Request>,
}

/// One value per request of a group: a group mostly holds one request (a
/// key's requests wait together only while its call is out).
pub type Each<T> = SmallVec<[T; 2]>;

impl StrictGroup {
    /// A group with `a`'s key and limit, and none of its requests yet
    /// (`a`'s tag moved in).
    pub fn from(a: StrictAsk) -> StrictGroup {
        StrictGroup {
            id: a.id,
            tag: a.tag,
            period: a.period,
            limit: a.limit,
            kind: a.kind,
            requests: SmallVec::new(),
        }
    }

    /// A group with `a`'s key and limit, and none of its requests yet.
    pub fn of(a: &StrictAsk) -> StrictGroup {
        StrictGroup::from(StrictAsk { tag: a.tag.clone(), ..*a })
    }

    /// `call_group`, named by its entry: for a writer whose calls all
    /// have one prefix and one zone (a worker's strict link).
    pub fn keyed_group(&self) -> strict::Group<'_> {
        strict::Group { key: Some(self.id.entry), ..self.call_group() }
    }

    /// What a script call needs of it.
    pub fn call_group(&self) -> strict::Group<'_> {
        strict::Group {
            tag: &self.tag,
            key: None,
            period: self.period,
            window: self.id.window,
            limit: self.limit,
            kind: self.kind,
            requests: &self.requests,
        }
    }

    pub fn add(&mut self, a: &StrictAsk) {
        self.push(a.ticket, a.cost, a.deadline_ms);
    }

    /// Adds a request: its ticket, cost and deadline.
    pub fn push(&mut self, ticket: Ticket, cost: u32, deadline_ms: u64) {
        self.requests.push(Request { ticket, cost, deadline_ms });
    }

    /// Its requests' tickets, in order.
    pub fn tickets(&self) -> impl Iterator<Item = Ticket> + Clone + '_ {
        self.requests.iter().map(|r| r.ticket)
    }

    /// Asks grouped per key and limit, in the order they came.
    pub fn group(asks: &[StrictAsk]) -> Vec<StrictGroup> {
        let mut groups: Vec<StrictGroup> = Vec::new();
        let mut at: HashMap<(ItemId, u32), usize> = HashMap::new();
        for a in asks {
            let i = *at.entry((a.id, a.limit)).or_insert_with(|| {
                groups.push(StrictGroup::of(a));
                groups.len() - 1
            });
            groups[i].add(a);
        }
        groups
    }

    /// Back to one ask per request (to be sent another way).
    pub fn into_asks(self) -> impl Iterator<Item = StrictAsk> {
        let StrictGroup { id, tag, period, limit, kind, requests } = self;
        requests.into_iter().map(move |r| StrictAsk {
            ticket: r.ticket,
            id,
            tag: tag.clone(),
            period,
            limit,
            kind,
            cost: r.cost,
            deadline_ms: r.deadline_ms,
        })
    }

    /// What its requests that happened already weigh (`strict::COUNTED`:
    /// counts after the response, which no request waits for).
    pub fn counted(&self) -> u32 {
        self.requests
            .iter()
            .filter(|r| r.deadline_ms == strict::COUNTED)
            .fold(0u32, |n, r| n.saturating_add(r.cost))
    }

    /// Its requests as asks, taken out: `into_asks` of what it held, for a
    /// caller that holds it in place (it is left with its key and limit,
    /// and no request).
    pub fn take_asks(&mut self) -> impl Iterator<Item = StrictAsk> {
        let empty = StrictGroup { tag: self.tag.clone(), requests: SmallVec::new(), ..*self };
        std::mem::replace(self, empty).into_asks()
    }

    /// The answer for its requests (`None`: no decision).
    pub fn answered(self, answer: Option<Answer>) -> Event {
        Event::Strict {
            id: self.id,
            period: self.period,
            limit: self.limit,
            kind: self.kind,
            counted: self.counted(),
            tickets: self.tickets().collect(),
            answer,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Error,
    Info,
    /// The end of an outage: at `error`, the level its failure was logged
    /// at (an operator who sees the one sees the other), never held back
    /// by the once-a-second gate.
    Recovery,
    /// Counts that will never reach Redis: at `error`, never held back by
    /// the gate (rare, and each line says how many).
    Loss,
    /// The node's sender of a zone changed hands: at `info`, never held
    /// back (rare).
    Handover,
}

#[derive(Debug)]
pub enum Event {
    /// Redis's counts for an item.
    Confirmed {
        id: ItemId,
        period: u32,
        limit: u32,
        confirmation: Confirmation,
    },
    /// Redis did not take these increments (an error reply for the key, or
    /// the connection was lost with their fate unknown): they stay counted
    /// on this node only.
    KeepLocal {
        id: ItemId,
        sent: u32,
    },
    /// Process `pid` held the zone's slot of a Redis thread and is gone
    /// without giving it back (killed): what it held for Redis is lost.
    Orphaned {
        zone: u32,
        pid: u64,
    },
    /// Redis's decision for strict requests of one key (`None`: no answer:
    /// an error reply, the connection, the backend down), one ticket per
    /// request in the answer's order.
    Strict {
        id: ItemId,
        period: u32,
        limit: u32,
        /// What Redis decided (a bucket's answer is its level, a conn
        /// group's the leases).
        kind: Kind,
        /// What the group's counts after the response weigh (in flight
        /// here until the answer).
        counted: u32,
        tickets: Each<Ticket>,
        answer: Option<Answer>,
    },
    Log {
        zone: u32,
        level: Level,
        message: String,
    },
    /// The sender read the zone's controls in Redis (`held`: what Redis
    /// holds, when its version moved since the last read; `version` 0:
    /// Redis has none).
    ControlsRead {
        zone: u32,
        version: u64,
        held: Option<Vec<Held>>,
    },
    /// Redis took the worker's change of a control of `key` as `version`.
    ControlWritten {
        zone: u32,
        key: Vec<u8>,
        kind: ControlKind,
        version: u64,
    },
    /// A connection to the zone's Redis for the worker's strict calls,
    /// ready (authenticated, script loaded) and non-blocking.
    Link {
        zone: u32,
        fd: OwnedFd,
        /// Redis's clock minus ours (ms), when `TIME` answered.
        clock_offset_ms: Option<i64>,
    },
}
