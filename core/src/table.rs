//! The per-zone table of counters: a fixed-capacity hash table with an exact
//! least-recently-used list, laid out in one flat region so that it can live
//! in nginx shared memory (every worker maps the same bytes). Indices, not
//! pointers, link the entries, so the region may be mapped at any address.
//!
//! The table knows nothing of nginx: the caller hands it the three slices
//! (header, bucket heads, entries) cut from the region, and holds the lock.
//! An entry is one (key, period) pair, identified by a 128-bit keyed hash of
//! both; when every entry is in use, the least recently used one is reused.

/// "RRLTABLE" — marks a formatted region.
pub const MAGIC: u64 = 0x5252_4c54_4142_4c45;
/// Bumped whenever `Header` or `Entry` change layout, or entry ids change
/// meaning (`key::IdHasher`): a region written by another version is
/// formatted anew instead of being misread.
pub const VERSION: u32 = 11;

use crate::key::EntryId;
use crate::stats::Stats;

const NIL: u32 = u32::MAX;

#[repr(C)]
#[derive(Debug)]
pub struct Header {
    pub magic: u64,
    pub version: u32,
    pub capacity: u32,
    pub nbuckets: u32,
    pub len: u32,
    lru_head: u32,
    lru_tail: u32,
    free_head: u32,
    _pad: u32,
    /// Key for the keyed hash; random per zone, kept across reloads.
    pub seed: [u64; 2],
    pub evictions: u64,
    /// Evictions of entries that still held counts, and how many of them
    /// the last line about it covered, when (`claim_pressure_note`).
    pub evictions_counting: u64,
    pub evictions_counting_noted: u64,
    pub pressure_logged_sec: u64,
    /// Total size in bytes of the region the table was formatted in.
    pub region_len: u64,
    /// Second (since the epoch) of the last backend error / recovery line
    /// logged for this zone by any worker: at most one per second.
    pub error_logged_sec: u64,
    pub notice_logged_sec: u64,
    /// What the zone decided, all workers together (updated without the
    /// lock: atomics).
    pub stats: Stats,
}

/// One (key, period) counter. `prev`/`cur` are the counts of the previous and
/// current window, `window` the index of the current one.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Entry {
    pub id: EntryId,
    next: u32,
    lru_prev: u32,
    lru_next: u32,
    pub window: u32,
    pub prev: u32,
    pub cur: u32,
    /// Requests this node allowed that the shared store has not confirmed.
    pub inflight: u32,
    /// The limit the breaker below was computed for.
    pub blocked_limit: u32,
    /// Circuit breaker: until this time (ms since the epoch) the key is over
    /// `blocked_limit`.
    pub blocked_until_ms: u64,
    /// This node's share of the key's recent global count, out of
    /// `u16::MAX` (0: not known yet), from Redis's replies. See `sync`.
    pub share: u16,
    /// 1 when Redis's last count of the key's window held only this node's
    /// increments (see `counter::counter_is_new`).
    pub alone: u8,
    /// 1 while this node waits for Redis to answer increments it sent
    /// promptly (`counter::wait`), since `waiting_since`.
    pub waiting: u8,
    /// The window (its low 15 bits, with the top bit set) in which the
    /// key's breaker last opened and was counted (`counter::opened`): the
    /// metric counts a key once per window, not once per reply.
    pub opened_in: u16,
    /// When the wait began: the low 16 bits of the clock in ms.
    pub waiting_since: u16,
}

/// Sizes of the three parts of a region of a given length.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub capacity: u32,
    pub nbuckets: u32,
}

impl Layout {
    pub const HEADER: usize = std::mem::size_of::<Header>();
    pub const ENTRY: usize = std::mem::size_of::<Entry>();

    /// The largest table that fits in `bytes`, with a power-of-two number of
    /// buckets between half and all of the entries. `None` if too small.
    pub fn for_region(bytes: usize) -> Option<Layout> {
        let room = bytes.checked_sub(Self::HEADER)?;
        let rough = room / (Self::ENTRY + 4);
        if rough < 2 {
            return None;
        }
        let mut nbuckets = 1usize << (usize::BITS - 1 - rough.leading_zeros());
        nbuckets = nbuckets.max(2);
        let capacity = (room.checked_sub(nbuckets * 4)?) / Self::ENTRY;
        if capacity < 1 {
            return None;
        }
        Some(Layout {
            capacity: u32::try_from(capacity.min(NIL as usize - 1)).ok()?,
            nbuckets: u32::try_from(nbuckets).ok()?,
        })
    }

    pub fn buckets_offset(&self) -> usize {
        Self::HEADER
    }

    pub fn entries_offset(&self) -> usize {
        // bucket heads are u32; entries need 8-byte alignment
        (Self::HEADER + self.nbuckets as usize * 4).next_multiple_of(8)
    }

    pub fn total(&self) -> usize {
        self.entries_offset() + self.capacity as usize * Self::ENTRY
    }
}

pub struct Table<'a> {
    hdr: &'a mut Header,
    buckets: &'a mut [u32],
    entries: &'a mut [Entry],
}

impl<'a> Table<'a> {
    /// Formats a table over the given parts (as cut by `Layout`).
    pub fn format(
        hdr: &'a mut Header,
        buckets: &'a mut [u32],
        entries: &'a mut [Entry],
        seed: [u64; 2],
        region_len: u64,
    ) -> Table<'a> {
        *hdr = Header {
            magic: MAGIC,
            version: VERSION,
            capacity: entries.len() as u32,
            nbuckets: buckets.len() as u32,
            len: 0,
            lru_head: NIL,
            lru_tail: NIL,
            free_head: if entries.is_empty() { NIL } else { 0 },
            _pad: 0,
            seed,
            evictions: 0,
            evictions_counting: 0,
            evictions_counting_noted: 0,
            pressure_logged_sec: 0,
            region_len,
            error_logged_sec: 0,
            notice_logged_sec: 0,
            stats: Stats::default(),
        };
        buckets.fill(NIL);
        let n = entries.len();
        for (i, e) in entries.iter_mut().enumerate() {
            *e = Entry {
                next: if i + 1 < n { i as u32 + 1 } else { NIL },
                lru_prev: NIL,
                lru_next: NIL,
                ..Entry::default()
            };
        }
        Table { hdr, buckets, entries }
    }

    /// Whether a header describes a table of this version over this layout.
    pub fn is_valid(hdr: &Header, layout: Layout, region_len: u64) -> bool {
        hdr.magic == MAGIC
            && hdr.version == VERSION
            && hdr.capacity == layout.capacity
            && hdr.nbuckets == layout.nbuckets
            && hdr.region_len == region_len
            && hdr.len <= hdr.capacity
    }

    /// Wraps parts that `is_valid` accepted.
    #[inline]
    pub fn attach(
        hdr: &'a mut Header,
        buckets: &'a mut [u32],
        entries: &'a mut [Entry],
    ) -> Table<'a> {
        Table { hdr, buckets, entries }
    }

    /// How many entries the table holds.
    pub fn capacity(&self) -> usize {
        self.hdr.capacity as usize
    }

    pub fn len(&self) -> usize {
        self.hdr.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.hdr.len == 0
    }

    /// Claims the right to log a line of this kind in second `sec`: true for
    /// the first caller in that second, across all workers.
    pub fn claim_log(&mut self, error: bool, sec: u64) -> bool {
        let slot =
            if error { &mut self.hdr.error_logged_sec } else { &mut self.hdr.notice_logged_sec };
        if *slot == sec {
            return false;
        }
        *slot = sec;
        true
    }

    pub fn evictions(&self) -> u64 {
        self.hdr.evictions
    }

    #[inline]
    fn bucket(&self, id: EntryId) -> usize {
        (id.0[0] as usize) & (self.buckets.len() - 1)
    }

    /// Index of the entry with this id, if present (does not touch the LRU).
    #[inline]
    pub fn find(&self, id: EntryId) -> Option<u32> {
        let mut i = self.buckets[self.bucket(id)];
        while i != NIL {
            let e = &self.entries[i as usize];
            if e.id == id {
                return Some(i);
            }
            i = e.next;
        }
        None
    }

    #[inline]
    pub fn entry(&self, i: u32) -> &Entry {
        &self.entries[i as usize]
    }

    #[inline]
    pub fn entry_mut(&mut self, i: u32) -> &mut Entry {
        &mut self.entries[i as usize]
    }

    /// The entry for `id`, marked most recently used; a new zeroed one if
    /// absent (reusing one of the least recently used entries when the table
    /// is full: `victim`). Returns the index and whether it was created.
    #[inline(always)]
    pub fn get_or_insert(&mut self, id: EntryId, now_ms: u64) -> (u32, bool) {
        if let Some(i) = self.find(id) {
            // a hot key is already the most recent one
            if self.hdr.lru_head != i {
                self.lru_unlink(i);
                self.lru_push_front(i);
            }
            return (i, false);
        }
        let i = match self.free_pop() {
            Some(i) => i,
            None => {
                let victim = self.victim(now_ms);
                let e = &self.entries[victim as usize];
                let old = e.id;
                if weight(e, now_ms) > 0 {
                    self.hdr.evictions_counting += 1;
                }
                self.remove_at(victim, old);
                self.hdr.evictions += 1;
                match self.free_pop() {
                    Some(i) => i,
                    None => unreachable_free(),
                }
            }
        };
        let b = self.bucket(id);
        self.entries[i as usize] =
            Entry { id, next: self.buckets[b], lru_prev: NIL, lru_next: NIL, ..Entry::default() };
        self.buckets[b] = i;
        self.lru_push_front(i);
        self.hdr.len += 1;
        (i, true)
    }

    /// Every entry, in use or free (a free one is all zeros but its links).
    pub fn entries_mut(&mut self) -> impl Iterator<Item = &mut Entry> {
        self.entries.iter_mut()
    }

    /// The entry to evict from a full table: of the `VICTIMS` least
    /// recently used, the one whose loss matters least (`weight`), the
    /// oldest of equals. A flood of new keys then evicts its own keys, each
    /// counted once, and not a key that has counted towards its limit and
    /// comes back less often than the flood turns the table over: that key
    /// would pass blind each time (until Redis answers, or for good in a
    /// zone without Redis). To evict it, a flood must give every key it
    /// sends as many requests.
    fn victim(&self, now_ms: u64) -> u32 {
        let mut best = self.hdr.lru_tail;
        let mut least = weight(&self.entries[best as usize], now_ms);
        let mut i = self.entries[best as usize].lru_prev;
        for _ in 1..VICTIMS {
            if least == 0 || i == NIL {
                break;
            }
            let w = weight(&self.entries[i as usize], now_ms);
            if w < least {
                (best, least) = (i, w);
            }
            i = self.entries[i as usize].lru_prev;
        }
        best
    }

    /// Evictions so far of entries that still held counts.
    pub fn evictions_counting(&self) -> u64 {
        self.hdr.evictions_counting
    }

    /// Claims the line that says the zone evicts keys still counting: once
    /// a `every_sec` across the workers, when such evictions happened since
    /// the last. Returns how many.
    pub fn claim_pressure_note(&mut self, now_sec: u64, every_sec: u64) -> Option<u64> {
        let n = self.hdr.evictions_counting - self.hdr.evictions_counting_noted;
        if n == 0 || now_sec < self.hdr.pressure_logged_sec.saturating_add(every_sec) {
            return None;
        }
        self.hdr.pressure_logged_sec = now_sec;
        self.hdr.evictions_counting_noted = self.hdr.evictions_counting;
        Some(n)
    }

    /// Forgets `id`; returns whether it was present.
    pub fn remove(&mut self, id: EntryId) -> bool {
        match self.find(id) {
            Some(i) => {
                self.remove_at(i, id);
                true
            }
            None => false,
        }
    }

    fn remove_at(&mut self, i: u32, id: EntryId) {
        let b = self.bucket(id);
        let next = self.entries[i as usize].next;
        if self.buckets[b] == i {
            self.buckets[b] = next;
        } else {
            let mut j = self.buckets[b];
            while j != NIL {
                if self.entries[j as usize].next == i {
                    self.entries[j as usize].next = next;
                    break;
                }
                j = self.entries[j as usize].next;
            }
        }
        self.lru_unlink(i);
        self.entries[i as usize] =
            Entry { next: self.hdr.free_head, lru_prev: NIL, lru_next: NIL, ..Entry::default() };
        self.hdr.free_head = i;
        self.hdr.len -= 1;
    }

    fn free_pop(&mut self) -> Option<u32> {
        let i = self.hdr.free_head;
        if i == NIL {
            return None;
        }
        self.hdr.free_head = self.entries[i as usize].next;
        Some(i)
    }

    #[inline]
    fn lru_unlink(&mut self, i: u32) {
        let (p, n) = {
            let e = &self.entries[i as usize];
            (e.lru_prev, e.lru_next)
        };
        if p == NIL {
            if self.hdr.lru_head == i {
                self.hdr.lru_head = n;
            }
        } else {
            self.entries[p as usize].lru_next = n;
        }
        if n == NIL {
            if self.hdr.lru_tail == i {
                self.hdr.lru_tail = p;
            }
        } else {
            self.entries[n as usize].lru_prev = p;
        }
        let e = &mut self.entries[i as usize];
        e.lru_prev = NIL;
        e.lru_next = NIL;
    }

    #[inline]
    fn lru_push_front(&mut self, i: u32) {
        let head = self.hdr.lru_head;
        {
            let e = &mut self.entries[i as usize];
            e.lru_prev = NIL;
            e.lru_next = head;
        }
        if head != NIL {
            self.entries[head as usize].lru_prev = i;
        }
        self.hdr.lru_head = i;
        if self.hdr.lru_tail == NIL {
            self.hdr.lru_tail = i;
        }
    }
}

/// How many of the least recently used entries a full table weighs
/// before it evicts one (`Table::victim`).
pub const VICTIMS: usize = 8;

/// What losing an entry costs: the counts it holds (they decide its key's
/// next requests), and above any count an open breaker.
#[inline]
fn weight(e: &Entry, now_ms: u64) -> u64 {
    let counts = u64::from(e.cur) + u64::from(e.inflight) + u64::from(e.prev);
    counts + (u64::from(e.blocked_until_ms > now_ms) << 33)
}

/// A full table always has an LRU tail, and evicting it frees an entry; a
/// table formatted with no entries at all is refused by `Layout`.
#[cold]
fn unreachable_free() -> u32 {
    // Never reached: `Layout::for_region` guarantees capacity >= 1, so a table
    // with no free entry has a tail to evict. Returning entry 0 keeps the
    // worker alive even if the region was corrupted behind our back.
    0
}

#[cfg(test)]
#[path = "table_tests.rs"]
mod tests;
