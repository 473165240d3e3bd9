//! What one node's workers hand the node's sender of a Redis zone: a byte
//! ring in the zone's shared memory. Every worker's thread forwards the
//! increments its worker counted (coalesced per key, with their due times)
//! into it; the thread that holds the zone's lease (`Lease`) takes them
//! out, coalesces them again with its own and sends them. So a key's
//! counts go to Redis once per node, whichever workers counted them, and
//! one connection per node serves the zone.
//!
//! Pure logic over the ring's state and bytes; the caller maps them and
//! holds the ring's lock.

use crate::batch::{Item, ItemId};
use crate::counter::Fresh;
use crate::key::EntryId;

/// Where the ring stands: byte positions that only grow (the data index is
/// the position modulo the data's length).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RingState {
    pub head: u64,
    pub tail: u64,
}

/// The fixed part of a record: the item's id (less its zone, which the
/// ring's zone is) and fields, then the tag's length.
const FIXED: usize = 16 + 8 + 4 * 5 + 8 + 2 + 2;
/// A record's length prefix.
const PREFIX: usize = 4;
/// A length prefix that says: the rest of the data to its end is unused,
/// the next record starts at the beginning.
const WRAP: u32 = u32::MAX;

/// One forwarded item: what a worker's batch held for the key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Forwarded {
    pub entry: EntryId,
    pub window: u64,
    pub item: Item,
}

impl Forwarded {
    fn len(&self) -> usize {
        FIXED + self.item.tag.len()
    }

    fn write(&self, out: &mut [u8]) {
        let i = &self.item;
        let mut at = 0;
        let mut put = |b: &[u8]| {
            out[at..at + b.len()].copy_from_slice(b);
            at += b.len();
        };
        put(&self.entry.0[0].to_le_bytes());
        put(&self.entry.0[1].to_le_bytes());
        put(&self.window.to_le_bytes());
        for v in [i.period, i.limit, i.n, i.carried, i.room] {
            put(&v.to_le_bytes());
        }
        put(&i.due.to_le_bytes());
        put(&[u8::from(i.quiet), fresh_code(i.fresh)]);
        put(&(i.tag.len() as u16).to_le_bytes());
        put(&i.tag);
    }

    fn read(b: &[u8]) -> Option<Forwarded> {
        let u64_at = |at: usize| Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?));
        let u32_at = |at: usize| Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?));
        let tag_len = usize::from(u16::from_le_bytes(b.get(FIXED - 2..FIXED)?.try_into().ok()?));
        if b.len() != FIXED + tag_len {
            return None;
        }
        let tag: Box<[u8]> = b.get(FIXED..)?.into();
        Some(Forwarded {
            entry: EntryId([u64_at(0)?, u64_at(8)?]),
            window: u64_at(16)?,
            item: Item {
                tag,
                period: u32_at(24)?,
                limit: u32_at(28)?,
                n: u32_at(32)?,
                carried: u32_at(36)?,
                quiet: *b.get(52)? != 0,
                fresh: fresh_of(*b.get(53)?),
                due: u64_at(44)?,
                room: u32_at(40)?,
            },
        })
    }

    /// The batch id of the item, in the zone of index `zone`.
    pub fn id(&self, zone: u32) -> ItemId {
        ItemId { zone, entry: self.entry, window: self.window }
    }
}

fn fresh_code(f: Fresh) -> u8 {
    match f {
        Fresh::No => 0,
        Fresh::Maybe => 1,
        Fresh::Alone => 2,
    }
}

fn fresh_of(b: u8) -> Fresh {
    match b {
        2 => Fresh::Alone,
        1 => Fresh::Maybe,
        _ => Fresh::No,
    }
}

/// The ring over its state and data, for the holder of its lock.
pub struct Ring<'a> {
    st: &'a mut RingState,
    data: &'a mut [u8],
}

impl<'a> Ring<'a> {
    pub fn attach(st: &'a mut RingState, data: &'a mut [u8]) -> Ring<'a> {
        Ring { st, data }
    }

    /// Bytes in use.
    pub fn used(&self) -> u64 {
        self.st.tail - self.st.head
    }

    pub fn is_empty(&self) -> bool {
        self.st.tail == self.st.head
    }

    /// Adds a record; `false` when it does not fit (the ring is full, or
    /// the record is larger than a quarter of it).
    pub fn push(&mut self, f: &Forwarded) -> bool {
        let cap = self.data.len() as u64;
        let need = (PREFIX + f.len()) as u64;
        if need > cap / 4 {
            return false;
        }
        let at = self.st.tail % cap;
        // a record never wraps: what is left to the end is skipped
        let skip = if at + need > cap { cap - at } else { 0 };
        if self.used() + skip + need > cap {
            return false;
        }
        if skip > 0 {
            if skip >= PREFIX as u64 {
                self.data[at as usize..at as usize + PREFIX].copy_from_slice(&WRAP.to_le_bytes());
            }
            self.st.tail += skip;
        }
        let at = (self.st.tail % cap) as usize;
        let len = f.len();
        self.data[at..at + PREFIX].copy_from_slice(&(len as u32).to_le_bytes());
        f.write(&mut self.data[at + PREFIX..at + PREFIX + len]);
        self.st.tail += need;
        true
    }

    /// Takes the oldest record out, if any. A record that cannot be read
    /// (memory written by something else) empties the ring.
    pub fn pop(&mut self) -> Option<Forwarded> {
        let cap = self.data.len() as u64;
        loop {
            if self.is_empty() {
                return None;
            }
            let at = self.st.head % cap;
            let left = cap - at;
            if left < PREFIX as u64 {
                self.st.head += left;
                continue;
            }
            let at = at as usize;
            let len = u32::from_le_bytes(self.data[at..at + PREFIX].try_into().ok()?);
            if len == WRAP {
                self.st.head += left;
                continue;
            }
            let end = at + PREFIX + len as usize;
            let rec = self.data.get(at + PREFIX..end).and_then(Forwarded::read);
            match rec {
                Some(f) if (PREFIX + len as usize) as u64 <= self.used() => {
                    self.st.head += (PREFIX + len as usize) as u64;
                    return Some(f);
                }
                _ => {
                    self.st.head = self.st.tail;
                    return None;
                }
            }
        }
    }
}

/// How long a sender's lease lasts without being renewed: the holder
/// renews it at every turn of its thread (at least every `RENEW_MS`), and
/// another worker takes it over once it has run out, or at once when its
/// holder's process is gone.
pub const LEASE_MS: u64 = 1500;
/// The longest a holder's thread sleeps between renewals.
pub const RENEW_MS: u64 = 500;

/// Whether a thread of process `me` may take a zone's lease held by
/// `holder` (0: nobody) renewed at `renewed_ms`, at `now_ms`.
pub fn may_take(
    holder: u64,
    renewed_ms: u64,
    me: u64,
    now_ms: u64,
    alive: impl Fn(u64) -> bool,
) -> bool {
    holder == 0 || holder == me || now_ms.saturating_sub(renewed_ms) > LEASE_MS || !alive(holder)
}

/// How large a zone's ring is, for a zone of `zone_bytes`: a sixteenth of
/// it, from 64 KiB to 4 MiB. The sender drains it every few milliseconds;
/// it holds what the workers forward meanwhile, and the keys of a spray of
/// new keys for a while when the sender changes hands.
pub fn ring_bytes(zone_bytes: usize) -> usize {
    let least = (64 << 10).min(zone_bytes / 4);
    (zone_bytes / 16).clamp(least, 4 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(k: u64, tag_len: usize) -> Forwarded {
        Forwarded {
            entry: EntryId([k, !k]),
            window: 7 + k,
            item: Item {
                tag: vec![b'a' + (k % 26) as u8; tag_len].into(),
                period: 60,
                limit: 100,
                n: k as u32 + 1,
                carried: 2,
                quiet: k.is_multiple_of(2),
                fresh: [Fresh::No, Fresh::Maybe, Fresh::Alone][(k % 3) as usize],
                due: 1_000 + k,
                room: 5,
            },
        }
    }

    #[test]
    fn records_come_out_as_they_went_in_across_the_wrap() {
        let mut st = RingState::default();
        let mut data = vec![0u8; 1000];
        let mut next_in = 0u64;
        let mut next_out = 0u64;
        for round in 0..200 {
            let mut ring = Ring::attach(&mut st, &mut data);
            // fill until full, with tags of varying length
            while ring.push(&rec(next_in, (next_in as usize * 7) % 90)) {
                next_in += 1;
            }
            let take = 1 + round % 5;
            for _ in 0..take {
                let got = ring.pop().expect("a record");
                assert_eq!(got, rec(next_out, (next_out as usize * 7) % 90));
                next_out += 1;
            }
        }
        let mut ring = Ring::attach(&mut st, &mut data);
        while let Some(got) = ring.pop() {
            assert_eq!(got, rec(next_out, (next_out as usize * 7) % 90));
            next_out += 1;
        }
        assert_eq!(next_out, next_in);
        assert!(ring.is_empty());
        assert!(next_in > 300, "the ring wrapped many times: {next_in}");
    }

    #[test]
    fn a_full_ring_refuses_and_garbage_empties_it() {
        let mut st = RingState::default();
        let mut data = vec![0u8; 400];
        let mut ring = Ring::attach(&mut st, &mut data);
        assert!(!ring.push(&rec(1, 200)), "over a quarter of the ring");
        let mut n = 0;
        while ring.push(&rec(n, 10)) {
            n += 1;
        }
        assert!(n >= 4 && ring.used() <= 400);
        // a length that points past what was written
        data[..4].copy_from_slice(&300u32.to_le_bytes());
        let mut ring = Ring::attach(&mut st, &mut data);
        assert_eq!(ring.pop(), None);
        assert!(ring.is_empty());
        assert!(ring.push(&rec(9, 10)), "usable again");
        assert_eq!(ring.pop(), Some(rec(9, 10)));
    }

    #[test]
    fn the_lease_goes_to_whoever_asks_once_its_holder_is_gone_or_silent() {
        let alive = |pid: u64| pid != 66;
        assert!(may_take(0, 0, 10, 5_000, alive), "nobody holds it");
        assert!(may_take(10, 4_900, 10, 5_000, alive), "its holder renews it");
        assert!(!may_take(20, 4_000, 10, 5_000, alive), "held and renewed lately");
        assert!(may_take(20, 3_000, 10, 5_000, alive), "not renewed for 2 s");
        assert!(may_take(66, 4_999, 10, 5_000, alive), "its holder is gone");
    }

    #[test]
    fn rings_are_a_sixteenth_of_the_zone_within_bounds() {
        assert_eq!(ring_bytes(32 << 10), 8 << 10, "a quarter of the smallest zone");
        assert_eq!(ring_bytes(1 << 20), 64 << 10);
        assert_eq!(ring_bytes(10 << 20), 640 << 10);
        assert_eq!(ring_bytes(1 << 30), 4 << 20);
    }
}
