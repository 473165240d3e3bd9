//! Increments the thread holds back for Redis: known not to have run (the
//! backend was down, a master failed, the stop deadline passed), sent again
//! with the next flush that can go. Bounded in bytes per zone: past the
//! bound, and when the thread stops with some still held, they are
//! undelivered: counted on this node only (`Event::KeepLocal`), counted as
//! dropped, and said in a log line.

use ratelimit_core::key::EntryId;
use std::time::Instant;

use ratelimit_core::batch::{Item, ItemId, ItemMap};
use ratelimit_core::health::LogGate;

use super::clock::unix_ms;
use super::event::{Event, Level};
use super::server::Server;

/// Bytes the increments kept for sending again may hold, per zone and
/// worker (beyond it they are dropped, and stay counted on this node).
pub const RETRY_BYTES: usize = 4 << 20;

pub(super) struct Retry {
    items: ItemMap<Item>,
    bytes: usize,
    /// Increments that will never reach Redis, not logged yet, and the
    /// gate of that line.
    unsent: u64,
    drops: LogGate,
}

impl Retry {
    pub(super) fn new() -> Retry {
        Retry {
            items: ItemMap::default(),
            bytes: 0,
            unsent: 0,
            drops: LogGate::new(super::DROP_LOG_INTERVAL),
        }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// What is held, by key and window.
    pub(super) fn items(&self) -> &ItemMap<Item> {
        &self.items
    }

    /// How many increments are held.
    pub(super) fn count(&self) -> u64 {
        self.items.values().map(|i| u64::from(i.n)).sum()
    }

    /// Forgets what is held for one entry (its key was reset).
    pub(super) fn forget(&mut self, entry: EntryId) {
        let mut freed = 0;
        self.items.retain(|id, item| {
            let keep = id.entry != entry;
            if !keep {
                freed += item.bytes();
            }
            keep
        });
        self.bytes -= freed;
    }

    /// Keeps increments known not to have run for the next flush (bounded
    /// in bytes; beyond it they stay counted on this node only, as
    /// dropped).
    pub(super) fn keep(&mut self, items: &[(ItemId, Item)], s: &Server, events: &mut Vec<Event>) {
        for (id, item) in items.iter().filter(|(_, i)| i.total() > 0) {
            if let Some(r) = self.items.get_mut(id) {
                r.n = r.n.saturating_add(item.n);
                r.carried = r.carried.saturating_add(item.carried);
                r.limit = r.limit.min(item.limit);
            } else if self.bytes + item.bytes() <= RETRY_BYTES {
                self.bytes += item.bytes();
                self.items.insert(*id, item.clone());
            } else {
                self.undelivered(*id, item, s, events);
            }
        }
        if self.unsent > 0 {
            let text = format!(
                "redis_ratelimit: zone \"{}\": {} increments could not wait for Redis (more than {} MiB held for it); counted on this node only",
                s.spec.name,
                self.unsent,
                RETRY_BYTES >> 20
            );
            if self.drops.pass(Instant::now(), false).is_some() {
                self.unsent = 0;
                events.push(Event::Log { zone: s.spec.index, level: Level::Loss, message: text });
            }
        }
    }

    /// Increments that will never reach Redis: the worker counts them on
    /// this node alone (no answer is waited for), and they are counted as
    /// dropped.
    pub(super) fn undelivered(
        &mut self,
        id: ItemId,
        item: &Item,
        s: &Server,
        events: &mut Vec<Event>,
    ) {
        keep_local(id, item, events);
        self.unsent += u64::from(item.n);
        if let Some(st) = s.stats() {
            st.dropped.fetch_add(u64::from(item.n), std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The thread stops (the worker exits) with increments Redis has not
    /// taken: they stay counted on this node, and the line says so.
    pub(super) fn abandon(&mut self, s: &Server, events: &mut Vec<Event>) {
        let kept: Vec<(ItemId, Item)> = self.items.drain().collect();
        self.bytes = 0;
        for (id, item) in &kept {
            self.undelivered(*id, item, s, events);
        }
        if self.unsent > 0 {
            events.push(Event::Log {
                zone: s.spec.index,
                level: Level::Loss,
                message: format!(
                    "redis_ratelimit: zone \"{}\": {} increments not sent before the worker exited (Redis {} not answering); counted on this node only",
                    s.spec.name,
                    self.unsent,
                    s.describe()
                ),
            });
            self.unsent = 0;
        }
    }

    /// New items plus those held (merged per key and window); increments
    /// for windows that no longer matter are dropped.
    pub(super) fn with(&mut self, items: Vec<(ItemId, Item)>) -> Vec<(ItemId, Item)> {
        if self.items.is_empty() {
            return items;
        }
        let now_ms = unix_ms();
        self.bytes = 0;
        let mut merged: ItemMap<Item> = self
            .items
            .drain()
            .filter(|(id, item)| {
                let current =
                    ratelimit_core::window::window_index(now_ms, u64::from(item.period) * 1000);
                id.window + 1 >= current
            })
            .collect();
        for (id, item) in items {
            match merged.get_mut(&id) {
                Some(m) => {
                    m.n = m.n.saturating_add(item.n);
                    m.carried = m.carried.saturating_add(item.carried);
                    m.limit = m.limit.min(item.limit);
                }
                None => {
                    merged.insert(id, item);
                }
            }
        }
        merged.into_iter().collect()
    }
}

/// Increments that stay counted on this node (no answer is waited for).
pub(super) fn keep_local(id: ItemId, item: &Item, events: &mut Vec<Event>) {
    if item.n > 0 {
        events.push(Event::KeepLocal { id, sent: item.n });
    }
}
