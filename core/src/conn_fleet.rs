//! A concurrency limit across the fleet (`redis_ratelimit_conn` on a zone
//! with `redis=`): what one holder (a worker) knows of a key's slots and
//! decides alone.
//!
//! Redis keeps, per key, a hash of leases: one field per holder, the
//! slots it holds and when its lease ends (Redis's clock). The strict
//! script (`Kind::Conn`) drops the leases past their end, grants the
//! holder what it asks within the number less the other holders' slots
//! (never less than it uses) and answers the others' slots. So the sum of
//! the leases never passes the number, and a holder that dies, freezes or
//! is cut off stops counting when its lease ends.
//!
//! A holder takes a slot without a round trip while it uses fewer than it
//! was granted (its lease), and asks for more ahead of need: what it asks
//! to hold is what it uses plus a spare of the free slots split between
//! the holders (`want`). A request it has no lease for (a key new to it,
//! or its lease used up) waits for the answer to its ask, one round trip,
//! unless Redis said a moment ago that every slot is leased (`Full`). A
//! `strict` holder asks for no spare: each request with no slot of its
//! lease left waits for Redis to grant it one. A
//! lease it has not renewed for two thirds of its length is not trusted
//! (Redis may have dropped it): `on_error` decides then. So the fleet's
//! requests in flight stay within the number, but for a holder cut off
//! from Redis longer than its lease (its slots are free to others by
//! then) until its requests end.

use crate::strict::CONN_SPLIT;

/// A holder's view of one key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Holding {
    /// Slots in use (its requests in flight).
    pub mine: u32,
    /// Slots Redis holds for it (its lease), at the last answer.
    pub granted: u32,
    /// The other holders' slots, and how many they are, at the last answer.
    pub others: u32,
    pub holders: u32,
    /// When the last answer came (ms; 0: none yet).
    pub answered_ms: u64,
    /// A call of it is out (or written soon): no second one.
    pub asked: bool,
    /// Requests waiting for the answer to its ask (each wants a slot).
    pub waiting: u32,
    /// `strict`: it asks for no spare, so each slot is taken in Redis.
    pub strict: bool,
    /// A slot was taken or refused since the last call: an idle key gives
    /// its lease back at its next renewal.
    pub demand: bool,
}

/// What `Holding::take` says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    /// Within its lease: taken.
    Taken,
    /// Its lease is used up and Redis said lately (`RECENT_MS`) that the
    /// fleet's slots are all leased.
    Full,
    /// No lease to take it of (a key new to it, or its lease used up and
    /// the fleet's not known to be all leased): the request waits for
    /// Redis's answer to the holder's ask, then takes it again.
    Wait,
    /// Its lease may have ended unrenewed: `on_error` decides.
    Unsure,
}

/// How long an answer that the fleet's slots are all leased refuses what
/// the holder has no lease for without asking again (ms).
pub const RECENT_MS: u64 = 100;

/// What a conn group's answer says (`Reply::of`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    pub others: u32,
    pub holders: u32,
    pub granted: u32,
    /// Leases the call found ended and dropped.
    pub expired: u32,
}

impl Reply {
    /// From the answer's two integers (`cur`, `prev`: each a low part plus
    /// a high part times `CONN_SPLIT`).
    pub fn of(cur: u64, prev: u64) -> Reply {
        let split =
            |v: u64| ((v % CONN_SPLIT) as u32, (v / CONN_SPLIT).min(u64::from(u32::MAX)) as u32);
        let (others, holders) = split(cur);
        let (granted, expired) = split(prev);
        Reply { others, holders, granted, expired }
    }
}

impl Holding {
    /// Whether its lease is trusted at `now_ms`: answered within two
    /// thirds of the lease (renewed every third, so one renewal may fail).
    #[inline]
    pub fn trusted(&self, lease_ms: u64, now_ms: u64) -> bool {
        self.answered_ms > 0 && now_ms < self.answered_ms + lease_ms * 2 / 3
    }

    /// Takes a slot of a key that may have `max` in flight.
    pub fn take(&mut self, max: u32, lease_ms: u64, now_ms: u64) -> Take {
        let holds = self.granted > 0 || self.mine > 0;
        let trusted = self.trusted(lease_ms, now_ms);
        if !trusted && !holds && self.answered_ms > 0 {
            // what it knew of a key it holds nothing of is old: as a key
            // never answered (an ask out, and the requests waiting for
            // it, stay)
            self.others = 0;
            self.holders = 0;
            self.answered_ms = 0;
        }
        self.demand = true;
        if !trusted {
            return if self.answered_ms == 0 { Take::Wait } else { Take::Unsure };
        }
        // the leases pass the number while a holder back from an outage
        // renews what it uses (Redis grants no less): a slot given back
        // then is not taken again until they are under it
        if self.mine < self.granted.min(max.saturating_sub(self.others)) {
            self.mine += 1;
            return Take::Taken;
        }
        let full = self.others.saturating_add(self.granted) >= max;
        if full && now_ms < self.answered_ms + RECENT_MS {
            Take::Full
        } else {
            Take::Wait
        }
    }

    /// A slot taken by `on_error`'s decision (its lease not trusted).
    pub fn take_unsure(&mut self) {
        self.mine += 1;
        self.demand = true;
    }

    /// A slot given back.
    pub fn give(&mut self) {
        self.mine = self.mine.saturating_sub(1);
    }

    /// The spare it asks to hold beyond what it uses: its part of half the
    /// free slots (none when `strict`; none near the number, where every
    /// slot is granted as it is asked for and no holder keeps one idle
    /// while another is refused; and none in a key's first ask, when it
    /// knows nothing of the other holders, which a burst on a fresh key
    /// has asking at the same time).
    fn spare(&self, max: u32) -> u32 {
        if self.strict || self.answered_ms == 0 {
            return 0;
        }
        let used = self.mine.saturating_add(self.waiting);
        let free = max.saturating_sub(self.others.saturating_add(used));
        free / (2 * (self.holders + 1))
    }

    /// What it asks to hold: what it uses, what its waiting requests
    /// want, and a spare; nothing for a key it neither uses nor was asked
    /// a slot of since its last call.
    pub fn want(&self, max: u32) -> u32 {
        if self.mine == 0 && self.waiting == 0 && !self.demand {
            return 0;
        }
        self.mine.saturating_add(self.waiting).saturating_add(self.spare(max)).min(max)
    }

    /// After a slot taken: ask now when what is left of its lease is half
    /// its spare or less (more is asked before it is needed).
    pub fn ask_after_take(&self, max: u32) -> bool {
        let spare = self.spare(max);
        spare > 0 && !self.asked && self.granted.saturating_sub(self.mine) * 2 <= spare
    }

    /// After a slot given back: ask now (to give spare slots back) when
    /// other holders are short (the fleet's slots all leased) and it holds
    /// more than it would ask.
    pub fn ask_after_give(&self, max: u32) -> bool {
        !self.asked
            && self.holders > 0
            && self.others.saturating_add(self.granted) >= max
            && self.granted > self.want(max)
    }

    /// Whether its lease is due for renewal (a third of it gone), or a key
    /// never answered has no call out.
    pub fn renewal_due(&self, lease_ms: u64, now_ms: u64) -> bool {
        !self.asked && now_ms >= self.answered_ms + lease_ms / 3
    }

    /// Nothing in use, nothing leased, and what it knew is old: it may be
    /// forgotten.
    pub fn idle(&self, lease_ms: u64, now_ms: u64) -> bool {
        self.mine == 0 && self.granted == 0 && !self.asked && !self.trusted(lease_ms, now_ms)
    }

    /// The call was written asking for `wants` while using `uses`: Redis
    /// grants what is asked if it shrinks the lease (the slots were its
    /// own), so the lease counts as that much from now on, not from the
    /// answer (a slot taken between would be one Redis does not count).
    pub fn sent(&mut self, uses: u32, wants: u32) {
        self.demand = false;
        self.granted = self.granted.min(wants.max(uses));
    }

    /// Redis's answer to its call.
    pub fn answered(&mut self, r: Reply, now_ms: u64) {
        self.granted = r.granted;
        self.others = r.others;
        self.holders = r.holders;
        self.answered_ms = now_ms.max(1);
        self.asked = false;
    }

    /// Its call got no answer: asked again when due.
    pub fn unanswered(&mut self) {
        self.asked = false;
    }
}

#[cfg(test)]
#[path = "conn_fleet_tests.rs"]
mod tests;
