//! Coalescing of increments between a worker and its background thread:
//! every request allowed for the same (zone, key, period, window) adds to one
//! pending item, so a hot key costs one `INCRBY` per flush, not per request.
//! Bounded by items and by bytes: an item holds the key's Redis hash tag
//! (bounded, whatever the key: `key::redis_tag`), and once `max_items` items or
//! `max_bytes` bytes wait, new keys are dropped (and counted), never
//! blocking the worker.

use crate::key::EntryId;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::hash::{BuildHasherDefault, Hasher};

use crate::counter::Fresh;
use crate::key::redis_tag;
use crate::sync::{may_carry, Due};

/// How many windows back a new item looks for a quiet key's held
/// increments to carry (`Batch::add`).
pub const CARRY_BACK: u64 = 8;

/// Hashes an `ItemId` with a multiply and a rotate per word (FxHash's
/// step): its entry is already a keyed hash of the key (`key::IdHasher`,
/// seeded per zone), so clients cannot aim keys at one bucket, and hashing
/// it again with SipHash would spend on every request what the keyed hash
/// already did.
#[derive(Clone, Copy, Default)]
pub struct ItemHasher(u64);

impl Hasher for ItemHasher {
    #[inline]
    fn finish(&self) -> u64 {
        self.0
    }

    #[inline]
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(u64::from(b));
        }
    }

    #[inline]
    fn write_u32(&mut self, n: u32) {
        self.write_u64(u64::from(n));
    }

    #[inline]
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x517c_c1b7_2722_0a95);
    }
}

/// A map by `ItemId`, hashed by `ItemHasher`.
pub type ItemMap<V> = HashMap<ItemId, V, BuildHasherDefault<ItemHasher>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ItemId {
    pub zone: u32,
    pub entry: EntryId,
    pub window: u64,
}

/// Four words, one step each: the derived `Hash` would hash the entry
/// array as a length and 16 bytes, one `ItemHasher` step per byte, on
/// every push.
impl std::hash::Hash for ItemId {
    #[inline]
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u32(self.zone);
        state.write_u64(self.entry.0[0]);
        state.write_u64(self.entry.0[1]);
        state.write_u64(self.window);
    }
}

/// Counted requests of one key for the thread to send: `n` increments of
/// the key (`namespace`, `key`) under a period, for the tightest limit of
/// the limits that counted them.
#[derive(Clone, Copy, Debug)]
pub struct Increment<'a> {
    pub namespace: &'a [u8],
    pub key: &'a [u8],
    pub period: u32,
    pub limit: u32,
    pub n: u32,
    /// What the node knows of the key's counter for this window
    /// (`Item::fresh`).
    pub fresh: Fresh,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// `<namespace>:<key part>`: the hash tag of the key's Redis counters.
    pub tag: Box<[u8]>,
    pub period: u32,
    /// The tightest limit that counted this item (for the breaker).
    pub limit: u32,
    /// Increments coalesced into this item.
    pub n: u32,
    /// Increments of the key's earlier windows carried into this one's
    /// counter (`sync::may_carry`): counted there, not in their own.
    pub carried: u32,
    /// Whether every push into it was far from the limit (`Due::Hold`):
    /// only then may it be carried into a later window.
    pub quiet: bool,
    /// What the pushes knew of the window's counter, the least sure of
    /// them (`counter::fresh`): an item far from its limit (`far`) whose
    /// counter is probably new creates it with its TTL in one command,
    /// `SET NX EX`, instead of `INCRBY` and `EXPIRE`.
    pub fresh: Fresh,
    /// When it is to be sent (ms; 0: at once). See `sync`.
    pub due: u64,
    /// The least room its pushes had to carry held counts of the key's
    /// earlier windows into it (`sync::Due::Hold`; 0 when none had):
    /// what the node's sender carries by when the item is forwarded
    /// (`ring`).
    pub room: u32,
}

/// The counts `Batch::put` adds to an item.
#[derive(Clone, Copy)]
struct Put {
    period: u32,
    limit: u32,
    n: u32,
    carried: u32,
    fresh: Fresh,
}

/// What one pending item costs in memory, beyond its tag: the map slot,
/// the id and the item itself.
pub const ITEM_OVERHEAD: usize = 96;

impl Item {
    /// Whether no push into it was near the limit (`Due::Now`): a wrong
    /// guess that its counter is new may then cost its count a round trip.
    #[inline]
    pub fn far(&self) -> bool {
        self.due != 0
    }

    /// What its `INCRBY` adds: its own increments and the carried ones.
    #[inline]
    pub fn total(&self) -> u32 {
        self.n.saturating_add(self.carried)
    }

    /// Bytes this item holds (for the byte bounds).
    pub fn bytes(&self) -> usize {
        ITEM_OVERHEAD + self.tag.len()
    }
}

/// Distinct items that may wait for one flush before new ones are dropped,
/// at least.
pub const BATCH_ITEMS: usize = 1 << 16;
/// What increments waiting for their time (`sync`) may hold per worker, at
/// least; more when the Redis zones are larger (`Bounds`). Past it the
/// earliest due go at once until a quarter is free (`Batch::drain_due`).
pub const HOLD_BYTES: usize = 2 << 20;

/// A worker's batch bounds, for Redis zones of `zone_bytes` of shared
/// memory together: held increments may take as much memory as the zones
/// (whose size says how many keys the operator expects), at least
/// `HOLD_BYTES`; the batch twice that, in bytes and in items.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub hold: usize,
    pub bytes: usize,
    pub items: usize,
}

impl Bounds {
    pub fn for_zones(zone_bytes: usize) -> Bounds {
        let hold = zone_bytes.max(HOLD_BYTES);
        let bytes = hold.saturating_mul(2);
        Bounds { hold, bytes, items: (bytes / ITEM_OVERHEAD).max(BATCH_ITEMS) }
    }
}

/// A key to forget in Redis (both windows around `window`, or its
/// bucket).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delete {
    pub zone: u32,
    /// The table entry of the key (drops its pending increments).
    pub entry: EntryId,
    pub tag: Box<[u8]>,
    pub period: u32,
    pub window: u64,
    /// The key's bucket of this many requests per period
    /// (`redis_ratelimit ... burst=`), not its windows.
    pub bucket: Option<u32>,
    /// The thread sends the `DEL`. `false`: a worker's strict link sent it,
    /// in order with that worker's strict calls, and the thread only
    /// forgets what it holds of the key.
    pub command: bool,
}

impl Delete {
    /// The Redis keys it deletes, under `prefix`.
    pub fn keys(&self, prefix: &[u8]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        if let Some(limit) = self.bucket {
            let mut k = Vec::new();
            crate::key::write_bucket_key_for_tag(&mut k, prefix, &self.tag, self.period, limit);
            out.push(k);
            return out;
        }
        let p = u64::from(self.period);
        for w in [self.window, self.window.saturating_sub(1)] {
            let mut k = Vec::new();
            crate::key::write_key_for_tag(&mut k, prefix, &self.tag, self.period, w * p);
            out.push(k);
        }
        out
    }
}

#[derive(Debug)]
pub struct Batch {
    items: ItemMap<Item>,
    deletes: Vec<Delete>,
    max_items: usize,
    max_bytes: usize,
    bytes: usize,
    /// Items to send at once.
    now: Vec<ItemId>,
    /// Items that may wait, by when (entries of items sent since, or due
    /// earlier since, are skipped when they come up).
    later: BinaryHeap<Reverse<(u64, ItemId)>>,
    /// Increments dropped because the batch was full.
    pub dropped: u64,
    /// Increments waiting, by zone.
    pending: Vec<u64>,
    /// When the consumer plans to look again (ms; 0: it is not waiting).
    /// A producer wakes it for an item due earlier. Read and written under
    /// the same lock as the batch.
    pub wake_at: u64,
}

impl Batch {
    pub fn new(max_items: usize, max_bytes: usize) -> Batch {
        Batch {
            items: ItemMap::default(),
            deletes: Vec::new(),
            max_items,
            max_bytes,
            bytes: 0,
            now: Vec::new(),
            later: BinaryHeap::new(),
            dropped: 0,
            pending: Vec::new(),
            wake_at: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty() && self.deletes.is_empty()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Increments of `zone` waiting to be sent.
    pub fn pending(&self, zone: u32) -> u64 {
        self.pending.get(zone as usize).copied().unwrap_or(0)
    }

    #[inline]
    fn pend(&mut self, zone: u32, n: u32) {
        let z = zone as usize;
        if self.pending.len() <= z {
            self.pending.resize(z + 1, 0);
        }
        self.pending[z] += u64::from(n);
    }

    fn unpend(&mut self, zone: u32, n: u32) {
        if let Some(p) = self.pending.get_mut(zone as usize) {
            *p = p.saturating_sub(u64::from(n));
        }
    }

    /// Bytes held by the pending items and deletes.
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    fn full(&self, more: usize) -> bool {
        self.items.len() + self.deletes.len() >= self.max_items
            || self.bytes + more > self.max_bytes
    }

    /// Queues a delete. Increments of the key still waiting were counted
    /// before it and are dropped with it; deletes are sent before the
    /// increments of the same flush, so what is counted after it stays.
    pub fn delete(&mut self, d: Delete) -> bool {
        let size = ITEM_OVERHEAD + d.tag.len();
        let mut freed = 0;
        let mut gone = 0u32;
        self.items.retain(|id, item| {
            let keep = !(id.zone == d.zone && id.entry == d.entry);
            if !keep {
                freed += item.bytes();
                gone = gone.saturating_add(item.total());
            }
            keep
        });
        self.bytes -= freed;
        self.unpend(d.zone, gone);
        if self.full(size) {
            self.dropped += 1;
            return false;
        }
        self.bytes += size;
        self.deletes.push(d);
        true
    }

    /// Adds `n` increments of a key (a request that weighs `n`) for the
    /// tightest limit `limit`, to be sent as `send` says, coalesced with
    /// what is pending for the item (which then goes at the earlier of the
    /// two times); returns the earliest time it scheduled something for
    /// (ms; 0: at once), or `None` if the increments had to be dropped.
    /// The key's tag is made (and a long key digested) only when the item
    /// is new.
    ///
    /// Far from the limit (`Due::Hold`), the new item of a window takes
    /// over what the key still holds of an earlier window (at most
    /// `CARRY_BACK` back) if `sync::may_carry` allows: one `INCRBY` for
    /// several windows of a quiet key. Held increments that may not be
    /// carried (past the room, or a push near the limit) go with the next
    /// flush instead, so what a node holds of a key stays within its
    /// allowance.
    #[inline]
    pub fn add(&mut self, id: ItemId, inc: &Increment<'_>, send: Due) -> Option<u64> {
        let Increment { namespace, key, period, limit, n, fresh } = *inc;
        let put = Put { period, limit, n, carried: 0, fresh };
        self.put(id, put, send, || redis_tag(namespace, key))
    }

    /// Adds an item another thread of the node forwarded (`ring`), as `add`
    /// adds a push: coalesced with what is pending for it, due at the
    /// earlier time, and (held far from the limit) carrying what the key
    /// still holds of earlier windows while its room allows.
    pub fn merge(&mut self, id: ItemId, item: Item) -> Option<u64> {
        let send = if item.due == 0 {
            Due::Now
        } else if item.quiet {
            Due::Hold(item.due, item.room)
        } else {
            Due::By(item.due)
        };
        let Item { tag, period, limit, n, carried, fresh, .. } = item;
        self.put(id, Put { period, limit, n, carried, fresh }, send, move || tag)
    }

    #[inline(always)]
    fn put(
        &mut self,
        id: ItemId,
        p: Put,
        send: Due,
        make_tag: impl FnOnce() -> Box<[u8]>,
    ) -> Option<u64> {
        let Put { period, limit, n, fresh, .. } = p;
        let mut due = send.due();
        let room = send.room().unwrap_or(0);
        if let Some(item) = self.items.get_mut(&id) {
            item.n = item.n.saturating_add(n);
            item.carried = item.carried.saturating_add(p.carried);
            item.limit = item.limit.min(limit);
            item.quiet &= send.room().is_some();
            item.room = item.room.min(room);
            item.fresh = item.fresh.min(fresh);
            if item.carried > 0 && !may_carry(item.carried, send) {
                // what it carries no longer fits: with the next flush
                due = due.min(1);
            }
            if due < item.due {
                item.due = due;
                self.schedule(id, due);
            }
            self.pend(id.zone, n.saturating_add(p.carried));
            return Some(due);
        }
        let (mut carried, mut tag) = (0, None);
        let mut earliest = due;
        // (nothing to carry in an empty batch: a hot key's new item after
        // each flush looks no further)
        if !self.items.is_empty() {
            if let Some((old_id, held)) = self.held_before(&id) {
                if may_carry(held, send) {
                    if let Some(old) = self.items.remove(&old_id) {
                        self.bytes -= old.bytes();
                        carried = old.total();
                        due = due.min(old.due);
                        tag = Some(old.tag);
                    }
                } else if let Some(old) = self.items.get_mut(&old_id) {
                    // not carried: with the next flush, or with this push
                    // if it goes at once (the key is near its limit now)
                    let at = due.min(1);
                    if old.due > at {
                        old.due = at;
                        self.schedule(old_id, at);
                        earliest = earliest.min(at);
                    }
                }
            }
        }
        let tag = tag.unwrap_or_else(make_tag);
        let quiet = send.room().is_some();
        let carried = carried.saturating_add(p.carried);
        let item = Item { tag, period, limit, n, carried, quiet, fresh, due, room };
        if self.full(item.bytes()) {
            self.dropped += 1;
            // what it took over is dropped with it
            self.unpend(id.zone, carried.saturating_sub(p.carried));
            return None;
        }
        self.bytes += item.bytes();
        self.items.insert(id, item);
        self.schedule(id, due);
        self.pend(id.zone, n.saturating_add(p.carried));
        Some(earliest.min(due))
    }

    /// The key's latest item of an earlier window (at most `CARRY_BACK`
    /// windows back), if every push into it was quiet, and what it holds.
    #[inline]
    fn held_before(&self, id: &ItemId) -> Option<(ItemId, u32)> {
        (1..=CARRY_BACK)
            .find_map(|back| {
                let old = ItemId { window: id.window.checked_sub(back)?, ..*id };
                self.items.get(&old).map(|item| (old, item))
            })
            .filter(|(_, item)| item.quiet)
            .map(|(old, item)| (old, item.total()))
    }

    fn schedule(&mut self, id: ItemId, due: u64) {
        if due == 0 {
            self.now.push(id);
        } else {
            self.later.push(Reverse((due, id)));
        }
    }

    /// When the next item is due (ms; 0: now), if any is pending.
    pub fn next_due(&mut self) -> Option<u64> {
        if !self.now.is_empty() || !self.deletes.is_empty() {
            return Some(0);
        }
        while let Some(&Reverse((due, id))) = self.later.peek() {
            match self.items.get(&id) {
                Some(item) if item.due == due => return Some(due),
                _ => {
                    self.later.pop();
                }
            }
        }
        None
    }

    /// Takes every item due at once, at most `max_due` of those due by `by`
    /// (ms; the earliest first: a backlog goes in several flushes, so that
    /// what must go at once never waits behind it), and every delete; when
    /// the items hold more than `hold_bytes`, also the earliest due until a
    /// quarter of it is free (what waits is bounded by bytes, and the keys
    /// held longest go first).
    pub fn drain_due(
        &mut self,
        by: u64,
        max_due: usize,
        hold_bytes: usize,
    ) -> (Vec<(ItemId, Item)>, Vec<Delete>) {
        let mut out = Vec::new();
        if self.bytes > hold_bytes {
            let target = hold_bytes - hold_bytes / 4;
            let mut freed = 0;
            while self.bytes - freed > target {
                let Some(Reverse((due, id))) = self.later.pop() else {
                    break;
                };
                if self.items.get(&id).is_some_and(|i| i.due == due) {
                    if let Some(item) = self.items.remove(&id) {
                        freed += item.bytes();
                        out.push((id, item));
                    }
                }
            }
        }
        for id in std::mem::take(&mut self.now) {
            if let Some(item) = self.items.remove(&id) {
                out.push((id, item));
            }
        }
        let mut taken = 0;
        while let Some(&Reverse((due, id))) = self.later.peek() {
            if due > by || taken >= max_due {
                break;
            }
            taken += 1;
            self.later.pop();
            if self.items.get(&id).is_some_and(|i| i.due <= by) {
                if let Some(item) = self.items.remove(&id) {
                    out.push((id, item));
                }
            }
        }
        for (id, item) in &out {
            self.bytes -= item.bytes();
            self.unpend(id.zone, item.total());
        }
        // entries of items sent early or due earlier pile up; keep them
        // within twice the items
        if self.later.len() > 2 * self.items.len() + 64 {
            self.later = self
                .items
                .iter()
                .filter(|(_, i)| i.due > 0)
                .map(|(id, i)| Reverse((i.due, *id)))
                .collect();
        }
        let deletes = std::mem::take(&mut self.deletes);
        if !deletes.is_empty() {
            self.bytes = self.items.values().map(Item::bytes).sum();
        }
        (out, deletes)
    }

    /// Takes the deletes alone: the thread applies them before the strict
    /// calls it sends (a key reset, then counted, is counted after the
    /// reset).
    pub fn take_deletes(&mut self) -> Vec<Delete> {
        let deletes = std::mem::take(&mut self.deletes);
        if !deletes.is_empty() {
            self.bytes = self.items.values().map(Item::bytes).sum();
        }
        deletes
    }

    /// Takes every pending item of `zone` (and its deletes), whatever its
    /// due time: a thread that does not send the zone forwards them to the
    /// node's sender (`ring`), which holds them until they are due.
    pub fn drain_zone(&mut self, zone: u32) -> (Vec<(ItemId, Item)>, Vec<Delete>) {
        let ids: Vec<ItemId> = self.items.keys().filter(|id| id.zone == zone).copied().collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some(item) = self.items.remove(&id) {
                self.bytes -= item.bytes();
                out.push((id, item));
            }
        }
        if let Some(p) = self.pending.get_mut(zone as usize) {
            *p = 0;
        }
        let (deletes, keep): (Vec<Delete>, Vec<Delete>) =
            std::mem::take(&mut self.deletes).into_iter().partition(|d| d.zone == zone);
        self.deletes = keep;
        for d in &deletes {
            self.bytes -= ITEM_OVERHEAD + d.tag.len();
        }
        (out, deletes)
    }

    /// Whether items or deletes of `zone` wait.
    pub fn has_zone(&self, zone: u32) -> bool {
        self.pending(zone) > 0 || self.deletes.iter().any(|d| d.zone == zone)
    }

    /// Takes every pending item, leaving the batch empty.
    pub fn drain(&mut self) -> (Vec<(ItemId, Item)>, Vec<Delete>) {
        self.bytes = 0;
        self.now.clear();
        self.later.clear();
        self.pending.clear();
        (self.items.drain().collect(), std::mem::take(&mut self.deletes))
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
