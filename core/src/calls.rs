//! Calls on one connection that answers in order (a worker's strict link):
//! what is waiting to be written, per key, and what was written and waits
//! for its answer. A key has at most one call out: requests of a key whose
//! call is out wait, and go together in its next call (one call answers
//! every request of the key that waited meanwhile). A call decides
//! several keys' groups, and is answered once for all of them.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hash};

use crate::batch::ItemHasher;

/// Keys are keyed hashes already: one multiply per word (`ItemHasher`).
type Fast = BuildHasherDefault<ItemHasher>;

#[derive(Debug)]
pub struct Calls<K, G> {
    /// Per key that has a group waiting or a call out (or both).
    keys: HashMap<K, Slot<G>, Fast>,
    /// The groups that can be written (their keys have no call out), in
    /// the order they became so.
    ready: Vec<(K, G)>,
    /// How many times `ready` was written: a key listed as ready in an
    /// earlier round has its call out.
    round: u64,
    /// How many groups wait (ready or behind a call out).
    waiting: usize,
    /// The groups of the calls written, oldest first; those before `head`
    /// are answered (dropped when all are, or when they are the most).
    flight: Vec<(K, G)>,
    head: usize,
    /// Per call out, oldest first: how many of `flight`'s groups it holds,
    /// and when it was written (the caller's clock).
    calls: VecDeque<(usize, u64)>,
}

#[derive(Debug)]
enum Slot<G> {
    /// Its group is `ready[at]` if `round` is the current one; else it was
    /// written then, and its call is out.
    Ready { round: u64, at: usize },
    /// Its call is out, and a group waits behind it.
    Behind(G),
}

impl<K: Hash + Eq + Copy, G> Default for Calls<K, G> {
    fn default() -> Self {
        Calls {
            keys: HashMap::default(),
            ready: Vec::new(),
            round: 0,
            waiting: 0,
            flight: Vec::new(),
            head: 0,
            calls: VecDeque::new(),
        }
    }
}

impl<K: Hash + Eq + Copy, G> Calls<K, G> {
    /// The group waiting for `key` (made by `make` if there is none).
    pub fn waiting(&mut self, key: K, make: impl FnOnce() -> G) -> &mut G {
        let (round, ready) = (self.round, &mut self.ready);
        let slot = match self.keys.entry(key) {
            Entry::Vacant(e) => {
                e.insert(Slot::Ready { round, at: ready.len() });
                self.waiting += 1;
                ready.push((key, make()));
                let last = ready.len() - 1;
                return &mut ready[last].1;
            }
            Entry::Occupied(e) => e.into_mut(),
        };
        if let Slot::Ready { round: r, at } = *slot {
            if r == round {
                return &mut ready[at].1;
            }
            // its call is out: the group waits behind it
            self.waiting += 1;
            *slot = Slot::Behind(make());
        }
        match slot {
            Slot::Behind(g) => g,
            Slot::Ready { at, .. } => &mut ready[*at].1,
        }
    }

    /// Moves every waiting group whose key has no call out to calls out
    /// (written `at`) of at most `max` groups, and of at most `max_weight`
    /// in all unless one group alone weighs more, and returns those
    /// calls' groups, call by call, in the order they are to be written.
    pub fn write(
        &mut self,
        at: u64,
        max: usize,
        max_weight: usize,
        weight: impl Fn(&G) -> usize,
    ) -> impl Iterator<Item = impl Iterator<Item = &G> + Clone> {
        let (start, first) = (self.flight.len(), self.calls.len());
        let (mut size, mut sum) = (0, 0);
        self.waiting -= self.ready.len();
        for (k, g) in self.ready.drain(..) {
            let w = weight(&g);
            if size > 0 && (size >= max || sum + w > max_weight) {
                self.calls.push_back((size, at));
                (size, sum) = (0, 0);
            }
            size += 1;
            sum += w;
            self.flight.push((k, g));
        }
        if size > 0 {
            self.calls.push_back((size, at));
        }
        self.round += 1;
        let flight = &self.flight;
        let mut from = start;
        self.calls.range(first..).map(move |&(n, _)| {
            let groups = flight[from..from + n].iter().map(|(_, g)| g);
            from += n;
            groups
        })
    }

    /// A command of no group written (`at`) after the calls written so
    /// far (a reset's `DEL`): its reply comes in its turn, and
    /// `answered` takes it out with no group.
    pub fn other(&mut self, at: u64) {
        self.calls.push_back((0, at));
    }

    /// The groups of the oldest call out (none when no call is out).
    pub fn oldest(&self) -> impl Iterator<Item = &G> + Clone {
        let n = self.calls.front().map_or(0, |c| c.0);
        self.flight[self.head..self.head + n].iter().map(|(_, g)| g)
    }

    /// The oldest call out, answered (the connection answers in order):
    /// each of its groups handed to `f` in order, where it is (dropped
    /// later); when it was written.
    pub fn answered(&mut self, mut f: impl FnMut(&mut G)) -> Option<u64> {
        let (n, at) = self.calls.pop_front()?;
        let (round, ready) = (self.round, &mut self.ready);
        for (k, g) in &mut self.flight[self.head..self.head + n] {
            // one lookup: the key stays only while a group waits for it
            if let Entry::Occupied(mut e) = self.keys.entry(*k) {
                if matches!(e.get(), Slot::Behind(_)) {
                    let slot =
                        std::mem::replace(e.get_mut(), Slot::Ready { round, at: ready.len() });
                    if let Slot::Behind(behind) = slot {
                        ready.push((*k, behind));
                    }
                } else {
                    e.remove();
                }
            }
            f(g);
        }
        self.head += n;
        if self.head == self.flight.len() {
            self.flight.clear();
            self.head = 0;
        } else if self.head > 64 && self.head * 2 > self.flight.len() {
            self.flight.drain(..self.head);
            self.head = 0;
        }
        Some(at)
    }

    /// Something waits to be written.
    pub fn has_waiting(&self) -> bool {
        self.waiting > 0
    }

    /// When the oldest call out was written (none out: `None`).
    pub fn oldest_at(&self) -> Option<u64> {
        self.calls.front().map(|c| c.1)
    }

    /// Whether what waits is to be written now rather than at the end of
    /// the turn: `early` groups can be written (their keys have no call
    /// out) and fewer than `max_out` calls are out.
    pub fn write_early(&self, early: usize, max_out: usize) -> bool {
        self.ready.len() >= early && self.calls.len() < max_out
    }

    /// Some call is out.
    pub fn in_flight(&self) -> bool {
        !self.calls.is_empty()
    }

    /// Everything, taken out: the groups of the calls out (in order), then
    /// what waited.
    pub fn drain(&mut self) -> (Vec<G>, Vec<G>) {
        self.waiting = 0;
        self.calls.clear();
        self.round += 1;
        let out = self.flight.drain(self.head..).map(|(_, g)| g).collect();
        self.flight.clear();
        self.head = 0;
        let mut waiting: Vec<G> = self.ready.drain(..).map(|(_, g)| g).collect();
        waiting.extend(self.keys.drain().filter_map(|(_, s)| match s {
            Slot::Behind(g) => Some(g),
            Slot::Ready { .. } => None,
        }));
        (out, waiting)
    }
}

/// Calls of a connection's keys handed to another way to Redis (a worker's
/// link hands them to its thread: made before the link was there, or
/// failed on it), counted until they are answered: meanwhile new calls
/// follow them that way, so that the calls reach Redis in the order they
/// were made.
#[derive(Clone, Copy, Debug, Default)]
pub struct Handed {
    n: usize,
    at_ms: u64,
}

impl Handed {
    /// `n` more handed over at `now_ms`.
    pub fn note(&mut self, n: usize, now_ms: u64) {
        self.n += n;
        self.at_ms = now_ms;
    }

    /// `n` of them answered.
    pub fn answered(&mut self, n: usize) {
        self.n = self.n.saturating_sub(n);
    }

    /// Whether new calls go the other way too at `now_ms`: some handed
    /// over are not answered yet, and the last went at most `stale_ms` ago
    /// (every call is answered within a bound; past it the rest are taken
    /// as lost).
    #[inline]
    pub fn first(&mut self, now_ms: u64, stale_ms: u64) -> bool {
        if self.n == 0 {
            return false;
        }
        if now_ms.saturating_sub(self.at_ms) > stale_ms {
            self.n = 0;
            return false;
        }
        true
    }
}

#[cfg(test)]
#[path = "calls_tests.rs"]
mod tests;
