//! Calls on one connection that answers in order (a worker's strict link):
//! what is waiting to be written, per key, and what was written and waits
//! for its answer. A key has at most one call out: requests of a key whose
//! call is out wait, and go together in its next call (one call answers
//! every request of the key that waited meanwhile). A call decides
//! several keys' groups, and is answered once for all of them.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hash};

use crate::batch::ItemHasher;

/// Keys are keyed hashes already: one multiply per word (`ItemHasher`).
type ItemHashing = BuildHasherDefault<ItemHasher>;

#[derive(Debug)]
pub struct Calls<K, G> {
    /// Per key that has a group waiting or a call out (or both), or had
    /// one lately (`Idle`: a hot key's next request finds its key here,
    /// rather than inserting it again).
    keys: HashMap<K, Slot, ItemHashing>,
    /// How many of `keys` are `Idle` (taken out once they are the most).
    idle: usize,
    /// Every group, waiting or out, where it stays until it is answered;
    /// then its place is free (`free`), and made new for another group
    /// (`waiting`'s `renew`): writing a call or answering it moves places,
    /// not groups.
    groups: Vec<(K, G)>,
    free: Vec<u32>,
    /// The groups that can be written (their keys have no call out), in
    /// the order they became so.
    ready: Vec<u32>,
    /// How many times `ready` was written: a key listed as ready in an
    /// earlier round has its call out.
    round: u64,
    /// How many groups wait (ready or behind a call out).
    waiting: usize,
    /// The groups of the calls written, oldest first; those before `head`
    /// are answered (dropped when all are, or when they are the most).
    flight: Vec<u32>,
    head: usize,
    /// Per call written, oldest first: how many of `flight`'s groups it
    /// holds, and when it was written (the caller's clock); those before
    /// `calls_done` are answered (dropped as `flight`'s are).
    calls: Vec<(usize, u64)>,
    calls_done: usize,
}

#[derive(Clone, Copy, Debug)]
enum Slot {
    /// Its group is `groups[at]`, ready if `round` is the current one;
    /// else it was written then, and its call is out.
    Ready { round: u64, at: u32 },
    /// Its call is out, and the group `groups[at]` waits behind it.
    Behind(u32),
    /// Nothing waits and no call is out.
    Idle,
}

impl<K: Hash + Eq + Copy, G> Default for Calls<K, G> {
    fn default() -> Self {
        Calls {
            keys: HashMap::default(),
            idle: 0,
            groups: Vec::new(),
            free: Vec::new(),
            ready: Vec::new(),
            round: 0,
            waiting: 0,
            flight: Vec::new(),
            head: 0,
            calls: Vec::new(),
            calls_done: 0,
        }
    }
}

/// Where a new group of `key` goes: a free place made new by `renew`, or
/// a new one with `make`'s group.
#[inline(always)]
fn place<K, G>(
    groups: &mut Vec<(K, G)>,
    free: &mut Vec<u32>,
    key: K,
    make: impl FnOnce() -> G,
    renew: impl FnOnce(&mut G),
) -> u32 {
    match free.pop() {
        Some(i) => {
            let (k, g) = &mut groups[i as usize];
            *k = key;
            renew(g);
            i
        }
        None => {
            groups.push((key, make()));
            (groups.len() - 1) as u32
        }
    }
}

/// Drops the first `done` of `v` (those dealt with) when they are all of
/// it, or when they are the most.
#[inline(always)]
fn drop_done<T>(v: &mut Vec<T>, done: &mut usize) {
    if *done == v.len() {
        v.clear();
        *done = 0;
    } else if *done > 64 && *done * 2 > v.len() {
        v.drain(..*done);
        *done = 0;
    }
}

impl<K: Hash + Eq + Copy, G> Calls<K, G> {
    /// The group waiting for `key`; if there is none, a new one: `make`'s,
    /// or a free place's group made new by `renew` (which makes it what
    /// `make` would: a group's place is used again without moving one).
    pub fn waiting(
        &mut self,
        key: K,
        make: impl FnOnce() -> G,
        renew: impl FnOnce(&mut G),
    ) -> &mut G {
        let round = self.round;
        let (groups, free, idle) = (&mut self.groups, &mut self.free, &mut self.idle);
        // a key not seen lately is as one answered: idle
        let slot = self.keys.entry(key).or_insert_with(|| {
            *idle += 1;
            Slot::Idle
        });
        let i = match *slot {
            Slot::Ready { round: r, at } if r == round => at,
            Slot::Behind(i) => i,
            Slot::Idle => {
                let i = place(groups, free, key, make, renew);
                *slot = Slot::Ready { round, at: i };
                *idle -= 1;
                self.ready.push(i);
                self.waiting += 1;
                i
            }
            Slot::Ready { .. } => {
                // its call is out: the group waits behind it
                let i = place(groups, free, key, make, renew);
                *slot = Slot::Behind(i);
                self.waiting += 1;
                i
            }
        };
        &mut groups[i as usize].1
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
        for &i in &self.ready {
            let w = weight(&self.groups[i as usize].1);
            if size > 0 && (size >= max || sum + w > max_weight) {
                self.calls.push((size, at));
                (size, sum) = (0, 0);
            }
            size += 1;
            sum += w;
            self.flight.push(i);
        }
        self.ready.clear();
        if size > 0 {
            self.calls.push((size, at));
        }
        self.round += 1;
        let (flight, groups) = (&self.flight, &self.groups);
        let mut from = start;
        self.calls[first..].iter().map(move |&(n, _)| {
            let call = flight[from..from + n].iter().map(|&i| &groups[i as usize].1);
            from += n;
            call
        })
    }

    /// Hands each group `write` would write next (its key has no call
    /// out) to `f`, to be brought up to date first.
    pub fn each_ready(&mut self, mut f: impl FnMut(&mut G)) {
        let (ready, groups) = (&self.ready, &mut self.groups);
        for &i in ready {
            f(&mut groups[i as usize].1);
        }
    }

    /// A command of no group written (`at`) after the calls written so
    /// far (a reset's `DEL`): its reply comes in its turn, and
    /// `answered` takes it out with no group.
    pub fn other(&mut self, at: u64) {
        self.calls.push((0, at));
    }

    /// The groups of the oldest call out (none when no call is out).
    pub fn oldest(&self) -> impl Iterator<Item = &G> + Clone {
        let n = self.calls.get(self.calls_done).map_or(0, |c| c.0);
        let groups = &self.groups;
        self.flight[self.head..self.head + n].iter().map(move |&i| &groups[i as usize].1)
    }

    /// The oldest call out, answered (the connection answers in order):
    /// each of its groups handed to `f` in order, its place then free;
    /// when it was written.
    pub fn answered(&mut self, mut f: impl FnMut(&mut G)) -> Option<u64> {
        let &(n, at) = self.calls.get(self.calls_done)?;
        self.calls_done += 1;
        let round = self.round;
        for &i in &self.flight[self.head..self.head + n] {
            let (k, g) = &mut self.groups[i as usize];
            if let Some(slot) = self.keys.get_mut(k) {
                if let Slot::Behind(b) = *slot {
                    *slot = Slot::Ready { round, at: b };
                    self.ready.push(b);
                } else {
                    *slot = Slot::Idle;
                    self.idle += 1;
                }
            }
            f(g);
            self.free.push(i);
        }
        if self.idle > 64 && self.idle * 2 > self.keys.len() {
            self.keys.retain(|_, s| !matches!(s, Slot::Idle));
            self.idle = 0;
        }
        self.head += n;
        drop_done(&mut self.flight, &mut self.head);
        drop_done(&mut self.calls, &mut self.calls_done);
        Some(at)
    }

    /// Something waits to be written.
    pub fn has_waiting(&self) -> bool {
        self.waiting > 0
    }

    /// When the oldest call out was written (none out: `None`).
    pub fn oldest_at(&self) -> Option<u64> {
        self.calls.get(self.calls_done).map(|c| c.1)
    }

    /// Whether what waits is to be written now rather than at the end of
    /// the turn: `early` groups can be written (their keys have no call
    /// out) and fewer than `max_out` calls are out.
    pub fn write_early(&self, early: usize, max_out: usize) -> bool {
        self.ready.len() >= early && self.calls.len() - self.calls_done < max_out
    }

    /// Some call is out.
    pub fn in_flight(&self) -> bool {
        self.calls_done < self.calls.len()
    }

    /// Everything, taken out: the groups of the calls out (in order), then
    /// what waited.
    pub fn drain(&mut self) -> (Vec<G>, Vec<G>) {
        self.waiting = 0;
        self.idle = 0;
        self.calls.clear();
        self.calls_done = 0;
        self.round += 1;
        self.free.clear();
        let mut groups: Vec<Option<G>> = self.groups.drain(..).map(|(_, g)| Some(g)).collect();
        let mut take = |i: &u32| groups.get_mut(*i as usize).and_then(Option::take);
        let out = self.flight[self.head..].iter().filter_map(&mut take).collect();
        let mut waiting: Vec<G> = self.ready.iter().filter_map(&mut take).collect();
        waiting.extend(self.keys.drain().filter_map(|(_, s)| match s {
            Slot::Behind(i) => take(&i),
            Slot::Ready { .. } | Slot::Idle => None,
        }));
        self.flight.clear();
        self.ready.clear();
        self.head = 0;
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
