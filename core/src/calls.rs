//! Calls on one connection that answers in order (a worker's strict link):
//! what is waiting to be written, per key, and what was written and waits
//! for its answer. A key has at most one call out: requests of a key whose
//! call is out wait, and go together in its next call (one call answers
//! every request of the key that waited meanwhile).

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash};
use std::time::Instant;

use crate::batch::ItemHasher;

/// Keys are keyed hashes already: one multiply per word (`ItemHasher`).
type Fast = BuildHasherDefault<ItemHasher>;

#[derive(Debug)]
pub struct Calls<K, G> {
    /// Per key that has a group waiting or a call out (or both).
    keys: HashMap<K, Slot<G>, Fast>,
    /// The keys whose waiting group can be written (no call out), in the
    /// order they became so.
    ready: Vec<K>,
    /// How many groups wait (ready or behind a call out).
    waiting: usize,
    flight: VecDeque<(K, G, Instant)>,
}

#[derive(Debug)]
struct Slot<G> {
    waiting: Option<G>,
    out: bool,
}

impl<K: Hash + Eq + Copy, G> Default for Calls<K, G> {
    fn default() -> Self {
        Calls { keys: HashMap::default(), ready: Vec::new(), waiting: 0, flight: VecDeque::new() }
    }
}

impl<K: Hash + Eq + Copy, G> Calls<K, G> {
    /// The group waiting for `key` (made by `make` if there is none).
    pub fn waiting(&mut self, key: K, make: impl FnOnce() -> G) -> &mut G {
        let slot = self.keys.entry(key).or_insert(Slot { waiting: None, out: false });
        if slot.waiting.is_none() {
            self.waiting += 1;
            if !slot.out {
                self.ready.push(key);
            }
        }
        slot.waiting.get_or_insert_with(make)
    }

    /// Moves every waiting group whose key has no call out to the calls
    /// out (written `at`), and returns those, in the order they are to be
    /// written.
    pub fn write(&mut self, at: Instant) -> impl Iterator<Item = &G> {
        let start = self.flight.len();
        for k in self.ready.drain(..) {
            if let Some(g) = self.keys.get_mut(&k).and_then(|s| {
                s.out = true;
                s.waiting.take()
            }) {
                self.waiting -= 1;
                self.flight.push_back((k, g, at));
            }
        }
        self.flight.range(start..).map(|(_, g, _)| g)
    }

    /// The oldest call out, answered (the connection answers in order),
    /// with when it was written.
    pub fn answered(&mut self) -> Option<(G, Instant)> {
        let (k, g, at) = self.flight.pop_front()?;
        if let Some(s) = self.keys.get_mut(&k) {
            s.out = false;
            if s.waiting.is_some() {
                self.ready.push(k);
            } else {
                self.keys.remove(&k);
            }
        }
        Some((g, at))
    }

    /// Something waits to be written.
    pub fn has_waiting(&self) -> bool {
        self.waiting > 0
    }

    /// Some call is out.
    pub fn in_flight(&self) -> bool {
        !self.flight.is_empty()
    }

    /// Everything, taken out: the calls out (in order), then what waited.
    pub fn drain(&mut self) -> (Vec<G>, Vec<G>) {
        self.ready.clear();
        self.waiting = 0;
        let out = self.flight.drain(..).map(|(_, g, _)| g).collect();
        let waiting = self.keys.drain().filter_map(|(_, s)| s.waiting).collect();
        (out, waiting)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_has_one_call_out_and_the_rest_wait_together() {
        let t = Instant::now();
        let mut c: Calls<u32, Vec<u32>> = Calls::default();
        c.waiting(1, Vec::new).push(10);
        c.waiting(1, Vec::new).push(11);
        c.waiting(2, Vec::new).push(20);
        let mut first: Vec<Vec<u32>> = c.write(t).cloned().collect();
        first.sort();
        assert_eq!(first, [vec![10, 11], vec![20]]);
        assert!(!c.has_waiting() && c.in_flight());
        // key 1 is out: its new requests wait, key 3 goes
        c.waiting(1, Vec::new).push(12);
        c.waiting(1, Vec::new).push(13);
        c.waiting(3, Vec::new).push(30);
        let second: Vec<Vec<u32>> = c.write(t).cloned().collect();
        assert_eq!(second, [vec![30]]);
        assert!(c.has_waiting());
        // answers in order free their keys
        let (a, _) = c.answered().unwrap();
        let (b, _) = c.answered().unwrap();
        let mut ab = vec![a, b];
        ab.sort();
        assert_eq!(ab, first);
        let third: Vec<Vec<u32>> = c.write(t).cloned().collect();
        assert_eq!(third, [vec![12, 13]]);
        assert_eq!(c.answered().map(|x| x.0), Some(vec![30]));
        assert_eq!(c.answered().map(|x| x.0), Some(vec![12, 13]));
        assert_eq!(c.answered().map(|x| x.0), None);
        assert!(!c.in_flight());
    }

    #[test]
    fn keys_are_written_in_the_order_they_became_ready() {
        let t = Instant::now();
        let mut c: Calls<u32, Vec<u32>> = Calls::default();
        for k in [5, 1, 9, 3] {
            c.waiting(k, Vec::new).push(k);
        }
        let order: Vec<u32> = c.write(t).map(|g| g[0]).collect();
        assert_eq!(order, [5, 1, 9, 3]);
        // 9 and 5 wait behind their calls; 5's answer comes first
        c.waiting(9, Vec::new).push(90);
        c.waiting(5, Vec::new).push(50);
        assert_eq!(c.write(t).count(), 0);
        assert_eq!(c.answered().map(|x| x.0), Some(vec![5]));
        assert_eq!(c.write(t).cloned().collect::<Vec<_>>(), [vec![50]]);
        for _ in 0..3 {
            c.answered();
        }
        assert_eq!(c.write(t).cloned().collect::<Vec<_>>(), [vec![90]]);
        assert!(!c.has_waiting());
        c.answered();
        c.answered();
        assert!(!c.in_flight() && c.keys.is_empty(), "no key left behind");
    }

    #[test]
    fn drain_takes_everything_and_frees_the_keys() {
        let t = Instant::now();
        let mut c: Calls<u32, Vec<u32>> = Calls::default();
        c.waiting(1, Vec::new).push(1);
        let _ = c.write(t).count();
        c.waiting(1, Vec::new).push(2);
        c.waiting(2, Vec::new).push(3);
        let (out, mut waiting) = c.drain();
        waiting.sort();
        assert_eq!(out, [vec![1]]);
        assert_eq!(waiting, [vec![2], vec![3]]);
        assert!(!c.in_flight() && !c.has_waiting());
        // key 1 is free again
        c.waiting(1, Vec::new).push(4);
        assert_eq!(c.write(t).count(), 1);
    }
}
