//! A zone's controls: keys an operator (or a `block=` line) blocked or gave
//! another rate, each until a time. They live in a small open-addressing
//! table in the zone's shared memory, after the counter table, read by the
//! request path only while the zone has any (`Header::live`, an atomic read
//! without the lock).
//!
//! On a zone with Redis the fleet's controls are kept in one Redis hash per
//! zone (`<prefix>{<zone>}:ctl`, a field per key and kind, its value the
//! end time on Redis's clock and the override's rate) beside a version
//! (`<prefix>{<zone>}:ctl:v`, bumped by every change). The node's sender
//! reads the version every `POLL_MS` and, when it moved, the whole hash,
//! each control's time left rather than its end (no node's clock is
//! trusted); the worker then makes the table what Redis holds
//! (`Controls::apply`). A change made on this node is in force here at once
//! and stays as made (*pending*) until Redis has it and a read of Redis at
//! least as new as that write came back: a Redis outage, a reload or a
//! read crossing the write lose nothing.

use crate::key::{EntryId, MAX_KEY_BYTES};
use crate::rate::Rate;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// The longest a control may last.
pub const MAX_TTL_MS: u64 = 30 * 86_400_000;
/// How often a node's sender reads the zone's version in Redis.
pub const POLL_MS: u64 = 500;
/// How long the version outlives the last change: past every control's
/// end, so a version Redis no longer has means Redis lost its data.
pub const VERSION_TTL_MS: u64 = MAX_TTL_MS + 86_400_000;

/// What one control does to its key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Every limit of the zone rejects the key.
    Block,
    /// Every rate limit of the zone on the key takes this rate.
    Override(Rate),
}

impl Kind {
    /// The Redis hash field's first byte.
    fn tag(self) -> u8 {
        match self {
            Kind::Block => b'b',
            Kind::Override(_) => b'o',
        }
    }

    /// A key's override when its rate does not matter (a lift).
    pub const ANY_OVERRIDE: Kind = Kind::Override(Rate { limit: 1, period: 1 });

    pub fn name(self) -> &'static str {
        match self {
            Kind::Block => "block",
            Kind::Override(_) => "override",
        }
    }
}

const USED: u16 = 1;
const BLOCK_PENDING: u16 = 2;
const OVERRIDE_PENDING: u16 = 4;

/// One key's controls (a slot of the table).
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Slot {
    pub id: EntryId,
    /// Until when (ms since the epoch, this node's clock) the key is
    /// blocked; 0: not.
    pub block_until: u64,
    /// Until when the override below holds; 0: none.
    pub override_until: u64,
    pub override_limit: u32,
    pub override_period: u32,
    /// For a pending block or override: the version of Redis's write of
    /// it (0: not written yet).
    pub block_written: u64,
    pub override_written: u64,
    flags: u16,
    key_len: u16,
    _pad: u32,
    /// The key (`key_form`).
    key: [u8; MAX_KEY_BYTES],
}

impl Slot {
    const EMPTY: Slot = Slot {
        id: EntryId([0, 0]),
        block_until: 0,
        override_until: 0,
        override_limit: 0,
        override_period: 0,
        block_written: 0,
        override_written: 0,
        flags: 0,
        key_len: 0,
        _pad: 0,
        key: [0; MAX_KEY_BYTES],
    };

    pub fn key(&self) -> &[u8] {
        &self.key[..usize::from(self.key_len).min(MAX_KEY_BYTES)]
    }

    fn used(&self) -> bool {
        self.flags & USED != 0
    }

    /// Whether the block (or its removal) is this node's, not yet in a
    /// read of Redis.
    pub fn block_pending(&self) -> bool {
        self.flags & BLOCK_PENDING != 0
    }

    pub fn override_pending(&self) -> bool {
        self.flags & OVERRIDE_PENDING != 0
    }

    /// The override in force at `now`.
    pub fn rate(&self, now: u64) -> Option<Rate> {
        (self.override_until > now && self.override_limit > 0)
            .then_some(Rate { limit: self.override_limit, period: self.override_period })
    }

    /// The block's end, if it holds at `now`.
    pub fn blocked(&self, now: u64) -> Option<u64> {
        (self.block_until > now).then_some(self.block_until)
    }

    /// Nothing in force at `now` and nothing to tell Redis.
    fn spent(&self, now: u64) -> bool {
        self.blocked(now).is_none()
            && self.rate(now).is_none()
            && self.flags & (BLOCK_PENDING | OVERRIDE_PENDING) == 0
    }
}

/// The table's header in shared memory.
#[repr(C)]
pub struct Header {
    /// Slots in use (the request path reads it without the lock: 0, the
    /// common case, costs it nothing more).
    pub live: AtomicU32,
    pub slots: u32,
    /// When the sender last read Redis's controls (ms since the epoch).
    pub synced_ms: AtomicU64,
}

/// The bytes of the controls' part of a zone of `region_len` bytes, and
/// its slots: a sixteenth of the zone, 16 to 65 536 slots.
pub fn layout(region_len: usize) -> (usize, u32) {
    let room = (region_len / 16).saturating_sub(std::mem::size_of::<Header>());
    let slots = (room / std::mem::size_of::<Slot>()).clamp(16, 1 << 16);
    (std::mem::size_of::<Header>() + slots * std::mem::size_of::<Slot>(), slots as u32)
}

/// At most this many controls live in `slots` slots (the probes stay short).
pub fn capacity(slots: u32) -> usize {
    slots as usize * 3 / 4
}

/// The table is full.
#[derive(Debug, PartialEq, Eq)]
pub struct Full;

/// One control as Redis holds it, read by the sender.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    pub key: Vec<u8>,
    pub kind: Kind,
    /// What is left of it, by Redis's clock.
    pub left_ms: u64,
}

/// The table, locked.
pub struct Controls<'a> {
    hdr: &'a mut Header,
    slots: &'a mut [Slot],
}

impl<'a> Controls<'a> {
    /// An empty table over the given parts.
    pub fn format(hdr: &'a mut Header, slots: &'a mut [Slot]) -> Controls<'a> {
        *hdr = Header {
            live: AtomicU32::new(0),
            slots: slots.len() as u32,
            synced_ms: AtomicU64::new(0),
        };
        slots.fill(Slot::EMPTY);
        Controls { hdr, slots }
    }

    /// Wraps parts formatted before.
    pub fn attach(hdr: &'a mut Header, slots: &'a mut [Slot]) -> Controls<'a> {
        Controls { hdr, slots }
    }

    pub fn len(&self) -> usize {
        self.hdr.live.load(Ordering::Relaxed) as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn header(&self) -> &Header {
        self.hdr
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    fn home(&self, id: EntryId) -> usize {
        (id.0[0] % self.slots.len() as u64) as usize
    }

    fn find(&self, id: EntryId) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut i = self.home(id);
        for _ in 0..self.slots.len() {
            let s = &self.slots[i];
            if !s.used() {
                return None;
            }
            if s.id == id {
                return Some(i);
            }
            i = self.next(i);
        }
        None
    }

    /// The key's controls, if it has any.
    pub fn get(&self, id: EntryId) -> Option<&Slot> {
        self.find(id).map(|i| &self.slots[i])
    }

    /// Every key with controls.
    pub fn iter(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().filter(|s| s.used())
    }

    /// The key's slot, made if need be (`Full` when no room is left once
    /// spent slots are gone).
    fn slot(&mut self, id: EntryId, key: &[u8], now: u64) -> Result<usize, Full> {
        if let Some(i) = self.find(id) {
            return Ok(i);
        }
        if self.slots.is_empty() {
            return Err(Full);
        }
        if self.len() >= capacity(self.slots.len() as u32) {
            self.purge(now);
            if self.len() >= capacity(self.slots.len() as u32) {
                return Err(Full);
            }
        }
        let mut i = self.home(id);
        while self.slots[i].used() {
            i = self.next(i);
        }
        let n = key.len().min(MAX_KEY_BYTES);
        let s = &mut self.slots[i];
        *s = Slot::EMPTY;
        s.id = id;
        s.flags = USED;
        s.key_len = n as u16;
        s.key[..n].copy_from_slice(&key[..n]);
        self.hdr.live.fetch_add(1, Ordering::Relaxed);
        Ok(i)
    }

    /// Sets a control of `key` (id `id`) until `until`; `pending`: this
    /// node's change, kept until Redis has it.
    pub fn set(
        &mut self,
        id: EntryId,
        key: &[u8],
        kind: Kind,
        until: u64,
        pending: bool,
        now: u64,
    ) -> Result<(), Full> {
        let i = self.slot(id, key, now)?;
        let s = &mut self.slots[i];
        match kind {
            Kind::Block => {
                s.block_until = until;
                s.block_written = 0;
                s.flags = mark(s.flags, BLOCK_PENDING, pending);
            }
            Kind::Override(rate) => {
                s.override_until = until;
                s.override_limit = rate.limit;
                s.override_period = rate.period;
                s.override_written = 0;
                s.flags = mark(s.flags, OVERRIDE_PENDING, pending);
            }
        }
        Ok(())
    }

    /// Lifts a control of the key (an override's rate is not read:
    /// `Kind::ANY_OVERRIDE`);
    /// `pending` as for `set`. Whether the key had it in force.
    pub fn clear(&mut self, id: EntryId, key: &[u8], kind: Kind, pending: bool, now: u64) -> bool {
        let had = self.get(id).is_some_and(|s| match kind {
            Kind::Block => s.blocked(now).is_some(),
            Kind::Override(_) => s.rate(now).is_some(),
        });
        if !had && !pending {
            return false;
        }
        // a removal to tell Redis needs its slot; without room it is
        // told all the same (`Change`), only not kept against a read
        let Ok(i) = self.slot(id, key, now) else {
            return had;
        };
        let s = &mut self.slots[i];
        match kind {
            Kind::Block => {
                s.block_until = 0;
                s.block_written = 0;
                s.flags = mark(s.flags, BLOCK_PENDING, pending);
            }
            Kind::Override(_) => {
                s.override_until = 0;
                s.override_written = 0;
                s.flags = mark(s.flags, OVERRIDE_PENDING, pending);
            }
        }
        if self.slots[i].spent(now) {
            self.remove(i);
        }
        had
    }

    /// Redis took this node's change of `kind` on the key, as version
    /// `version`: it stays pending until a read at least that new.
    pub fn written(&mut self, id: EntryId, kind: Kind, version: u64) {
        if let Some(i) = self.find(id) {
            let s = &mut self.slots[i];
            match kind {
                Kind::Block if s.block_pending() => s.block_written = version,
                Kind::Override(_) if s.override_pending() => s.override_written = version,
                _ => {}
            }
        }
    }

    /// The changes of this node Redis does not have yet.
    pub fn unwritten(&self, now: u64) -> Vec<Change> {
        let mut out = Vec::new();
        for s in self.iter() {
            if s.block_pending() && s.block_written == 0 {
                out.push(Change::of(s, Kind::Block, s.blocked(now).map(|u| u - now)));
            }
            if s.override_pending() && s.override_written == 0 {
                let kind = Kind::Override(Rate {
                    limit: s.override_limit.max(1),
                    period: s.override_period,
                });
                out.push(Change::of(s, kind, s.rate(now).map(|_| s.override_until - now)));
            }
        }
        out
    }

    /// Marks every control in force as this node's change, not written
    /// (Redis lost the fleet's: the nodes write back what they hold).
    pub fn rewrite_all(&mut self, now: u64) {
        for s in self.slots.iter_mut().filter(|s| s.used()) {
            if s.blocked(now).is_some() {
                s.flags |= BLOCK_PENDING;
                s.block_written = 0;
            }
            if s.rate(now).is_some() {
                s.flags |= OVERRIDE_PENDING;
                s.override_written = 0;
            }
        }
    }

    /// Makes the table what Redis holds (`held`, read as `version` at
    /// `now`), but for this node's changes not yet in a read as new as
    /// their write. Returns how many of Redis's did not fit.
    pub fn apply(&mut self, held: &[(EntryId, Held)], version: u64, now: u64) -> usize {
        let kept = |pending: bool, written: u64| pending && (written == 0 || written > version);
        let mut old: Vec<Slot> = self.iter().copied().collect();
        for s in &mut old {
            if !kept(s.block_pending(), s.block_written) {
                s.block_until = 0;
                s.flags &= !BLOCK_PENDING;
            }
            if !kept(s.override_pending(), s.override_written) {
                s.override_until = 0;
                s.flags &= !OVERRIDE_PENDING;
            }
        }
        self.slots.fill(Slot::EMPTY);
        self.hdr.live.store(0, Ordering::Relaxed);
        for s in old.iter().filter(|s| !s.spent(now)) {
            if let Ok(i) = self.slot(s.id, s.key(), now) {
                self.slots[i] = *s;
            }
        }
        let mut dropped = 0;
        for (id, h) in held {
            let pending = self.get(*id).is_some_and(|s| match h.kind {
                Kind::Block => s.block_pending(),
                Kind::Override(_) => s.override_pending(),
            });
            if pending {
                continue;
            }
            let until = now.saturating_add(h.left_ms.min(MAX_TTL_MS));
            if self.set(*id, &h.key, h.kind, until, false, now).is_err() {
                dropped += 1;
            }
        }
        self.hdr.synced_ms.store(now, Ordering::Relaxed);
        dropped
    }

    /// Redis was read at `now` and its controls had not moved.
    pub fn read_at(&mut self, now: u64) {
        self.hdr.synced_ms.store(now, Ordering::Relaxed);
    }

    /// Frees the slots with nothing in force and nothing to tell Redis.
    pub fn purge(&mut self, now: u64) {
        let mut i = 0;
        while i < self.slots.len() {
            if self.slots[i].used() && self.slots[i].spent(now) {
                // the slot is refilled from its cluster: look at it again
                self.remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Empties slot `i`, moving back the slots of its probe cluster that
    /// belong before it (linear probing's deletion without tombstones).
    fn remove(&mut self, mut i: usize) {
        self.slots[i] = Slot::EMPTY;
        self.hdr.live.fetch_sub(1, Ordering::Relaxed);
        let mut j = i;
        loop {
            j = self.next(j);
            if !self.slots[j].used() {
                return;
            }
            let home = self.home(self.slots[j].id);
            // whether `home` lies cyclically in (i, j]: then it stays
            let stays = if i <= j { i < home && home <= j } else { i < home || home <= j };
            if !stays {
                self.slots[i] = self.slots[j];
                self.slots[j] = Slot::EMPTY;
                i = j;
            }
        }
    }
}

fn mark(flags: u16, bit: u16, on: bool) -> u16 {
    if on {
        flags | bit
    } else {
        flags & !bit
    }
}

/// A change to write to Redis: a control set (with its time left) or
/// lifted (`left_ms` `None`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Change {
    pub key: Vec<u8>,
    pub kind: Kind,
    pub left_ms: Option<u64>,
}

impl Change {
    fn of(s: &Slot, kind: Kind, left_ms: Option<u64>) -> Change {
        Change { key: s.key().to_vec(), kind, left_ms }
    }

    /// The Redis hash field: `b:<key>` or `o:<key>`.
    pub fn field(&self) -> Vec<u8> {
        field(self.kind, &self.key)
    }

    /// The value's part after the end time: an override's rate.
    pub fn payload(&self) -> String {
        match self.kind {
            Kind::Block => String::new(),
            Kind::Override(rate) => rate.to_string(),
        }
    }
}

/// A key as the controls keep it: as given, or `sha256:<hex>` of it when
/// longer than `MAX_KEY_BYTES` (`key::redis_key_part`'s digest); the fleet's
/// nodes name a key's controls by it.
pub fn key_form(key: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if key.len() <= MAX_KEY_BYTES {
        std::borrow::Cow::Borrowed(key)
    } else {
        crate::key::redis_key_part(key)
    }
}

/// A control's field in the zone's Redis hash.
pub fn field(kind: Kind, key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(key.len() + 2);
    out.push(kind.tag());
    out.push(b':');
    out.extend_from_slice(key);
    out
}

/// A field, its time left and its payload as the read script answers
/// them, back into a control (`None`: not one this version writes).
pub fn held(field: &[u8], left_ms: i64, payload: &[u8]) -> Option<Held> {
    let (tag, key) = match field {
        [t, b':', key @ ..] if !key.is_empty() && key.len() <= MAX_KEY_BYTES => (*t, key),
        _ => return None,
    };
    let kind = match tag {
        b'b' => Kind::Block,
        b'o' => Kind::Override(Rate::parse(payload).ok()?),
        _ => return None,
    };
    let left_ms = u64::try_from(left_ms).ok().filter(|&l| l > 0)?;
    Some(Held { key: key.to_vec(), kind, left_ms })
}

/// `<prefix>{<zone>}:ctl`, the zone's controls; with `version`,
/// `<prefix>{<zone>}:ctl:v`, their version.
pub fn redis_key(prefix: &[u8], zone: &str, version: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + zone.len() + 10);
    out.extend_from_slice(prefix);
    out.push(b'{');
    out.extend_from_slice(zone.as_bytes());
    out.extend_from_slice(b"}:ctl");
    if version {
        out.extend_from_slice(b":v");
    }
    out
}

/// The script that writes one change (KEYS: the hash, the version;
/// ARGV: the field, the time left in ms or 0 to lift, the payload, the
/// version's TTL). The hash lives until its last control ends (its TTL
/// only grows); every 64th change drops the controls already ended (the
/// reads skip them meanwhile), so a write costs O(1) but for those.
/// Answers the new version.
pub const WRITE_SCRIPT: &str = r#"
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local left = tonumber(ARGV[2])
local v = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], ARGV[4])
if left > 0 then
  local ends = now + left
  redis.call('HSET', KEYS[1], ARGV[1], string.format('%.0f', ends) .. '|' .. ARGV[3])
  if redis.call('PTTL', KEYS[1]) < left then
    redis.call('PEXPIREAT', KEYS[1], string.format('%.0f', ends))
  end
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
if v % 64 == 0 then
  local all = redis.call('HGETALL', KEYS[1])
  for i = 1, #all, 2 do
    local u = tonumber(string.match(all[i + 1], '^(%d+)|')) or 0
    if u <= now then redis.call('HDEL', KEYS[1], all[i]) end
  end
end
return v
"#;

/// The script that reads the controls when their version is not the one
/// known (KEYS: the hash, the version; ARGV: the known version, empty
/// when Redis had none). Answers `{version}` when nothing changed, else
/// the version (empty when Redis has none) and, per control in force, its
/// field, its time left in ms and its payload.
pub const READ_SCRIPT: &str = r#"
local v = redis.call('GET', KEYS[2]) or ''
if v == ARGV[1] then return {v} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {v}
local all = redis.call('HGETALL', KEYS[1])
for i = 1, #all, 2 do
  local u, p = string.match(all[i + 1], '^(%d+)|(.*)$')
  u = tonumber(u)
  if u and u > now then
    out[#out + 1] = all[i]
    out[#out + 1] = u - now
    out[#out + 1] = p
  end
end
return out
"#;

#[cfg(test)]
#[path = "control_tests.rs"]
mod tests;
