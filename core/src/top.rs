//! The busiest keys a node sees in a zone (the API's `top`): a
//! Space-Saving sketch of a sample of the requests it decided, in the
//! zone's shared memory. Each sampled request adds one to its key's
//! count; a key not held takes the place of the least counted (with that
//! count, plus one), so a key with a large share of the traffic is never
//! missed; every `DECAY_MS` the counts are halved, so the sketch tells
//! what is busy now.

use crate::key::MAX_KEY_BYTES;

/// One request in this many is sampled.
pub const SAMPLE_EVERY: u32 = 16;
/// The counts are halved this often.
pub const DECAY_MS: u64 = 10_000;

/// One key's slot.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct Slot {
    pub count: u32,
    key_len: u16,
    _pad: u16,
    key: [u8; MAX_KEY_BYTES],
}

impl Slot {
    const EMPTY: Slot = Slot { count: 0, key_len: 0, _pad: 0, key: [0; MAX_KEY_BYTES] };

    pub fn key(&self) -> &[u8] {
        &self.key[..usize::from(self.key_len).min(MAX_KEY_BYTES)]
    }
}

/// The sketch's header.
#[repr(C)]
pub struct Header {
    pub slots: u32,
    _pad: u32,
    /// When the counts were last halved (ms since the epoch).
    pub decayed_ms: u64,
    /// Sampled requests the counts stand for.
    pub total: u64,
}

/// The sketch's bytes and slots for a zone that holds `control_slots`
/// controls: a quarter as many, 4 to 64.
pub fn layout(control_slots: u32) -> (usize, u32) {
    let slots = (control_slots / 4).clamp(4, 64);
    (std::mem::size_of::<Header>() + slots as usize * std::mem::size_of::<Slot>(), slots)
}

/// The sketch, locked.
pub struct Top<'a> {
    hdr: &'a mut Header,
    slots: &'a mut [Slot],
}

impl<'a> Top<'a> {
    pub fn format(hdr: &'a mut Header, slots: &'a mut [Slot]) -> Top<'a> {
        *hdr = Header { slots: slots.len() as u32, _pad: 0, decayed_ms: 0, total: 0 };
        slots.fill(Slot::EMPTY);
        Top { hdr, slots }
    }

    pub fn attach(hdr: &'a mut Header, slots: &'a mut [Slot]) -> Top<'a> {
        Top { hdr, slots }
    }

    /// Counts one sampled request of `key` (as `control::key_form` has it)
    /// at `now`.
    pub fn record(&mut self, key: &[u8], now: u64) {
        if self.slots.is_empty() || key.is_empty() || key.len() > MAX_KEY_BYTES {
            return;
        }
        if now.saturating_sub(self.hdr.decayed_ms) >= DECAY_MS {
            self.hdr.decayed_ms = now;
            self.hdr.total /= 2;
            for s in self.slots.iter_mut() {
                s.count /= 2;
            }
        }
        self.hdr.total += 1;
        let (mut least, mut least_count) = (0, u32::MAX);
        for (i, s) in self.slots.iter_mut().enumerate() {
            if s.count > 0 && s.key() == key {
                s.count = s.count.saturating_add(1);
                return;
            }
            if s.count < least_count {
                (least, least_count) = (i, s.count);
            }
        }
        let s = &mut self.slots[least];
        s.count = s.count.saturating_add(1);
        s.key_len = key.len() as u16;
        s.key[..key.len()].copy_from_slice(key);
    }

    /// The `n` keys counted most, most first, with each one's share of
    /// the sampled requests.
    pub fn busiest(&self, n: usize) -> Vec<(Vec<u8>, f64)> {
        let mut held: Vec<&Slot> = self.slots.iter().filter(|s| s.count > 0).collect();
        held.sort_by(|a, b| b.count.cmp(&a.count).then(a.key().cmp(b.key())));
        let total = self.hdr.total.max(1) as f64;
        held.iter()
            .take(n)
            .map(|s| (s.key().to_vec(), (f64::from(s.count) / total).min(1.0)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sketch(n: usize) -> (Box<Header>, Vec<Slot>) {
        (Box::new(Header { slots: 0, _pad: 0, decayed_ms: 0, total: 0 }), vec![Slot::EMPTY; n])
    }

    #[test]
    fn a_heavy_key_among_many_light_ones_comes_first() {
        let (mut h, mut s) = sketch(8);
        let mut t = Top::format(&mut h, &mut s);
        for i in 0..10_000u32 {
            if i % 3 == 0 {
                t.record(b"heavy", 1000);
            } else if i % 3 == 1 && i % 2 == 0 {
                t.record(b"second", 1000);
            } else {
                t.record(format!("light-{i}").as_bytes(), 1000);
            }
        }
        let top = t.busiest(3);
        assert_eq!(top[0].0, b"heavy");
        assert!(top[0].1 > 0.3 && top[0].1 < 0.4, "{}", top[0].1);
        assert_eq!(top[1].0, b"second");
        assert_eq!(t.busiest(100).len(), 8);
    }

    #[test]
    fn counts_decay_so_the_busy_now_rise() {
        let (mut h, mut s) = sketch(4);
        let mut t = Top::format(&mut h, &mut s);
        for _ in 0..100 {
            t.record(b"old", 0);
        }
        // later, a new key is busy and the old one idle
        for step in 1..=6u64 {
            for _ in 0..30 {
                t.record(b"new", step * DECAY_MS);
            }
        }
        assert_eq!(t.busiest(1)[0].0, b"new");
    }

    #[test]
    fn odd_keys_are_not_held() {
        let (mut h, mut s) = sketch(4);
        let mut t = Top::format(&mut h, &mut s);
        t.record(b"", 0);
        t.record(&[b'x'; MAX_KEY_BYTES + 1], 0);
        assert!(t.busiest(4).is_empty());
        t.record(&[0, 255, b'%'], 0);
        assert_eq!(t.busiest(4)[0].0, vec![0, 255, b'%']);
    }
}
