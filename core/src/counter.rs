//! What one (key, period) entry of a zone knows, and how it changes: the
//! decision for a request, counting it, and merging a confirmation from the
//! shared store. Pure logic over `table::Entry`.
//!
//! `cur` is the current window's count as last confirmed by Redis (or, in a
//! zone without Redis, simply this node's count); `inflight` holds the
//! requests this node allowed that Redis has not confirmed yet. Decisions
//! use `cur + inflight`, so a burst on one node cannot pass the limit while
//! Redis is answering.

use crate::rate::Rate;
use crate::table::Entry;
use crate::window::{free_at, window_index, Estimate};

/// How far back of an entry's window the clock may be before it counts as
/// stepped back: workers' cached clocks differ by a few milliseconds around
/// a window's start, and a request decided in such a worker must not reset
/// a key the others already moved on. Half a period, at most a second.
#[inline]
pub fn step_tolerance_ms(period_ms: u64) -> u64 {
    (period_ms / 2).min(1000)
}

/// Brings the entry to the window of `now_ms` and returns the window it is
/// in. Forwards: what the previous window ended with becomes `prev`,
/// anything older is forgotten. A clock a little behind the entry (another
/// worker's cached time) keeps the entry as it is. A clock stepped back
/// further starts the entry afresh in the earlier window: a key is never
/// held longer than a period by a clock step (nginx's `limit_req` forgets
/// backward steps the same way), and about `L` pass in that window.
#[inline(always)]
pub fn roll(e: &mut Entry, now_ms: u64, period_ms: u64) -> u64 {
    let idx = window_index(now_ms, period_ms);
    let stored = u64::from(e.window);
    if idx <= stored {
        let start = stored * period_ms;
        if now_ms.saturating_add(step_tolerance_ms(period_ms)) >= start {
            return stored;
        }
        e.prev = 0;
        e.cur = 0;
        e.inflight = 0;
        e.blocked_until_ms = 0;
        e.blocked_limit = 0;
        e.window = idx as u32;
        return idx;
    }
    e.prev = if idx == stored + 1 { e.cur.saturating_add(e.inflight) } else { 0 };
    e.cur = 0;
    e.inflight = 0;
    e.waiting = 0;
    e.window = idx as u32;
    idx
}

/// The outcome of checking one limit against an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    pub allowed: bool,
    /// The current window's count the estimate was made of (Redis's and
    /// this node's unconfirmed ones), before this request.
    pub cur: u32,
    pub estimate: Estimate,
    /// When rejected: the earliest time (ms) the limit allows a request,
    /// never more than a period away.
    pub retry_at_ms: u64,
    /// The window the entry is in (increments are sent for this window).
    pub window: u64,
    pub window_start_ms: u64,
}

/// Decides whether `rate` allows another request now. Rolls the entry to
/// the current window first. An open breaker for this limit rejects at once.
#[inline]
pub fn check(e: &mut Entry, rate: Rate, now_ms: u64) -> Check {
    check_cost(e, rate, now_ms, 1)
}

/// `check` for a request that weighs `cost`: allowed iff estimate + cost − 1
/// < L (cost 0 is checked like cost 1 and counts nothing). A cost above
/// the limit is never allowed; its retry time is a period away.
#[inline(always)]
pub fn check_cost(e: &mut Entry, rate: Rate, now_ms: u64, cost: u32) -> Check {
    let p = rate.period_ms();
    let window = roll(e, now_ms, p);
    let window_start_ms = window * p;
    let total = e.cur.saturating_add(e.inflight);
    let estimate = Estimate::new(e.prev, total, now_ms.saturating_sub(window_start_ms), p);
    let latest = now_ms.saturating_add(p);
    if e.blocked_until_ms > latest {
        // set before the clock stepped back: not a time this key can wait for
        e.blocked_until_ms = 0;
    }
    if e.blocked_until_ms > now_ms && rate.limit <= e.blocked_limit {
        return Check {
            allowed: false,
            cur: total,
            estimate,
            retry_at_ms: e.blocked_until_ms,
            window,
            window_start_ms,
        };
    }
    let allowed = estimate.below_cost(rate.limit, cost);
    Check {
        allowed,
        cur: total,
        estimate,
        retry_at_ms: if allowed {
            now_ms
        } else {
            // when the estimate leaves room for `cost`: under a limit
            // `cost - 1` lower (none: a period away)
            let room = Rate { limit: rate.limit.saturating_sub(cost.max(1) - 1), ..rate };
            if room.limit == 0 {
                latest
            } else {
                free_at(room, e.prev, total, window_start_ms, now_ms.max(window_start_ms))
                    .min(latest)
            }
        },
        window,
        window_start_ms,
    }
}

/// `check_cost` on Redis's counts alone, leaving out this node's
/// increments Redis has not confirmed: what Redis would say, when it
/// decides the limit itself (`strict`, small limits).
#[inline]
pub fn check_known(e: &mut Entry, rate: Rate, now_ms: u64, cost: u32) -> Check {
    roll(e, now_ms, rate.period_ms());
    let held = std::mem::take(&mut e.inflight);
    let c = check_cost(e, rate, now_ms, cost);
    e.inflight = held;
    c
}

/// The least time a node waits for Redis's answer to increments it sent
/// promptly before its view of the key counts as stale; a zone whose
/// usual round trip is longer waits for two of them (`stale_after_ms`). A
/// node whose Redis thread does not get the CPU (a busy machine), or whose
/// Redis stalls, must not keep spending the headroom it last saw
/// (`share::cap_to_share`).
pub const STALE_MIN_MS: u64 = 5;

/// How long a node may wait for Redis's answer before its view counts as
/// stale, for a zone whose usual round trip is `rtt_us`
/// (`RoundTrip::usual_us`): `STALE_MIN_MS`, or two round trips when that
/// is longer (a flush may wait for the one before). Not both: each
/// millisecond of the wait is what a node flooding a fresh key passes
/// blind, and on a busy machine even the usual round trip takes a few.
#[inline]
pub fn stale_after_ms(rtt_us: u64) -> u64 {
    STALE_MIN_MS.max(2 * rtt_us.div_ceil(1000))
}

/// How long a slot of `RoundTrip` lasts.
pub const RTT_SLOT_MS: u64 = 1000;

/// A zone's usual round trip to Redis, for `stale_after_ms`: the shortest
/// of the current slot's and the last one's (one to two seconds of
/// exchanges). A stall makes some round trips long, and must not make the
/// nodes wait longer before their view of a key counts as stale: every
/// millisecond of that wait is what a node flooding a fresh key passes
/// blind (at 30 000 requests a second, 30 a millisecond). A Redis that is
/// slower for good (further away, busier) is followed within two slots.
/// After a pause in the traffic the last slot's shortest stays, so the
/// first exchange after it, which may meet a stall, does not set it alone.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RoundTrip {
    /// When the current slot began (the caller's clock, ms).
    slot_ms: u64,
    /// The shortest round trip of the current slot and of the one before
    /// (µs; 0: none).
    this_us: u64,
    last_us: u64,
}

impl RoundTrip {
    /// A round trip of `rtt_us` ended at `now_ms`.
    pub fn add(&mut self, rtt_us: u64, now_ms: u64) {
        if self.this_us == 0 || now_ms.saturating_sub(self.slot_ms) >= RTT_SLOT_MS {
            if self.this_us > 0 {
                self.last_us = self.this_us;
            }
            self.this_us = u64::MAX;
            self.slot_ms = now_ms;
        }
        self.this_us = self.this_us.min(rtt_us.max(1));
    }

    /// The usual round trip (µs; 0: none yet).
    pub fn usual_us(&self) -> u64 {
        match (self.this_us, self.last_us) {
            (0, l) => l,
            (t, 0) => t,
            (t, l) => t.min(l),
        }
    }
}

/// The node counted a request of the key and queued it to reach Redis
/// `prompt`ly (near the limit, or past what it may hold: `sync::when`):
/// from the first such request since Redis last answered, it waits.
/// Increments held far from the limit wait for nothing (`sync` bounds
/// them).
#[inline]
pub fn wait(e: &mut Entry, prompt: bool, now_ms: u64) {
    if prompt && e.waiting == 0 {
        e.waiting = 1;
        e.waiting_since = now_ms as u16;
    }
}

/// How long the node has waited for Redis's answer (0: not waiting). Ages
/// wrap after 65.5 s, far beyond any wait that matters here.
#[inline]
pub fn waited_ms(e: &Entry, now_ms: u64) -> u64 {
    if e.waiting == 0 {
        return 0;
    }
    u64::from((now_ms as u16).wrapping_sub(e.waiting_since))
}

/// Whether this node's increments of the entry's window probably create
/// its Redis counter: no count of the window from Redis yet, the last
/// count Redis gave grew by this node's increments alone (no one else
/// counted the key meanwhile), and the node's share of the key is three
/// quarters or more (so no one else is likely to make the counter first). A
/// quiet counter is then created with its TTL in one command; a wrong guess
/// costs an `INCRBY` after it (`batch::Item::fresh`).
#[inline]
pub fn counter_is_new(e: &Entry) -> bool {
    e.cur == 0 && e.alone != 0 && e.share >= u16::MAX / 4 * 3
}

/// What a node knows of a window's Redis counter when it queues an
/// increment of the key (`batch::Item::fresh`). Ordered from the least
/// sure: the pushes of one item merge by `min`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fresh {
    /// Redis counted the window already, or others count the key too.
    No,
    /// Probably new, not known: no count of the key from Redis yet (first
    /// contact), or the last one grew by this node's increments alone
    /// while its share is still being learnt (a key seen again a while
    /// later). Whether the node makes the counter is guessed from how the
    /// zone's such counts went lately (`sync::FirstCounts`).
    Maybe,
    /// The node made the key's last count alone and sends three quarters
    /// or more of its traffic (`counter_is_new`).
    Alone,
}

/// `Fresh` for an entry about to be queued.
#[inline]
pub fn fresh(e: &Entry) -> Fresh {
    if e.cur != 0 {
        Fresh::No
    } else if counter_is_new(e) {
        Fresh::Alone
    } else if e.share == 0 || e.alone != 0 {
        Fresh::Maybe
    } else {
        Fresh::No
    }
}

/// Counts an allowed request: locally final without a backend, in flight
/// until Redis confirms it with one.
#[inline]
pub fn count(e: &mut Entry, backend: bool) {
    count_cost(e, backend, 1);
}

/// `count` for a request that weighs `cost`.
#[inline]
pub fn count_cost(e: &mut Entry, backend: bool, cost: u32) {
    if backend {
        e.inflight = e.inflight.saturating_add(cost);
    } else {
        e.cur = e.cur.saturating_add(cost);
    }
}

/// The estimate after counting (for `$redis_ratelimit_remaining`).
#[inline]
pub fn estimate(e: &Entry, rate: Rate, now_ms: u64) -> Estimate {
    let p = rate.period_ms();
    let ws = u64::from(e.window) * p;
    Estimate::new(e.prev, e.cur.saturating_add(e.inflight), now_ms.saturating_sub(ws), p)
}

/// Redis's answer to one coalesced increment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Confirmation {
    /// Window index the increment was for.
    pub window: u64,
    /// How many increments it carried of this node's in this window.
    pub sent: u32,
    /// Increments of earlier windows it carried into this one's counter
    /// (`batch`): already in `prev` here, so they leave nothing in flight.
    pub carried: u32,
    /// `INCRBY` result: that window's global count, ours included.
    pub cur: u64,
    /// `GET` of the window before: its global count (0 when absent), or
    /// `None` when it was not read this time.
    pub prev: Option<u64>,
}

fn clamp(v: u64) -> u32 {
    v.min(u64::from(u32::MAX)) as u32
}

/// The window a reply may speak of at `now_ms`: replies for a later one
/// (sent before the clock stepped back, or by a thread whose clock is a
/// little ahead) are not applied.
fn reply_window_ok(window: u64, now_ms: u64, p: u64) -> bool {
    window <= window_index(now_ms.saturating_add(step_tolerance_ms(p)), p)
}

/// Merges a confirmation, then arms the breaker for `rate` (the tightest
/// limit that uses this entry) when the global count puts the estimate at
/// the limit.
/// Counts only grow within a window, so replies applied out of order (from
/// several workers) keep the largest.
/// Whether the key's breaker opening now (its window `e.window`) is the
/// first of that window: counted once per key and window, however many
/// replies open it again as its estimate hovers at the limit.
pub fn opened(e: &mut Entry) -> bool {
    let mark = 0x8000 | (e.window & 0x7fff) as u16;
    if e.opened_in == mark {
        return false;
    }
    e.opened_in = mark;
    true
}

pub fn confirm(e: &mut Entry, c: &Confirmation, rate: Rate, now_ms: u64) {
    let p = rate.period_ms();
    if !reply_window_ok(c.window, now_ms, p) {
        return;
    }
    if c.window > u64::from(e.window) {
        roll(e, c.window * p, p);
    }
    let w = u64::from(e.window);
    if c.window == w {
        // answered: what the node sends next starts a new wait
        e.waiting = 0;
        learn_share(e, c);
        let mine = u64::from(c.sent) + u64::from(c.carried);
        if mine > 0 {
            // the count grew by this node's increments alone since the last
            e.alone = u8::from(c.cur.saturating_sub(u64::from(e.cur)) == mine);
        }
        e.inflight = e.inflight.saturating_sub(c.sent);
        e.cur = e.cur.max(clamp(c.cur));
        if let Some(prev) = c.prev {
            e.prev = e.prev.max(clamp(prev));
        }
    } else if c.window + 1 == w {
        // A late answer for the window that just ended: it is our `prev`.
        e.prev = e.prev.max(clamp(c.cur));
    } else {
        return;
    }
    // The breaker follows the global counts alone. This node's unconfirmed
    // requests may already be in a count Redis returned (sent by another
    // worker, reply not applied yet): adding them would count them twice
    // and could hold the breaker shut for the rest of the window. Decisions
    // (`check`) still add them, which only errs on the side of the limit
    // until the replies are in.
    let ws = w * p;
    let est = Estimate::new(e.prev, e.cur, now_ms.saturating_sub(ws), p);
    if !est.below(rate.limit) {
        let at = free_at(rate, e.prev, e.cur, ws, now_ms.max(ws));
        e.blocked_until_ms = at.min(now_ms.saturating_add(p));
        e.blocked_limit = rate.limit;
    }
}

/// What a reply says of this node's share of the key's traffic: its
/// increments against the growth of the global count since the last reply
/// (the whole window's count after a roll). Believed at once when it is
/// smaller, slowly when larger; the first one only half (nodes that meet a
/// key together each see their own increments first). Other workers of
/// this node count as other nodes here, which only makes the share smaller
/// (and the node send sooner).
fn learn_share(e: &mut Entry, c: &Confirmation) {
    let mine = u64::from(c.sent) + u64::from(c.carried);
    if mine == 0 {
        return;
    }
    let grew = c.cur.saturating_sub(u64::from(e.cur)).max(mine);
    let sample = (mine * u64::from(u16::MAX) / grew) as u32;
    let old = u32::from(e.share);
    let next = if old == 0 {
        sample / 2
    } else if sample < old {
        sample
    } else {
        (3 * old + sample) / 4
    };
    e.share = next.clamp(1, u32::from(u16::MAX)) as u16;
}

/// Increments Redis could not take (an error reply for that key, or a
/// connection lost with the outcome unknown): they stay counted on this
/// node alone, as final local counts instead of in flight.
pub fn keep_local(e: &mut Entry, window: u64, sent: u32) {
    if window == u64::from(e.window) {
        // answered, if not with a count: the wait is over
        e.waiting = 0;
        let n = sent.min(e.inflight);
        e.inflight -= n;
        e.cur = e.cur.saturating_add(n);
    }
}

/// A sender that held some of this node's unconfirmed increments is gone
/// without saying what became of them (its worker was killed): which of
/// the entry's requests in flight it held is not known, so all of them
/// become this node's final local counts, and the node waits for no
/// answer. Returns how many there were. Answers still to come for the
/// ones a live sender holds find nothing left in flight and keep the
/// larger of the counts (`confirm`): the key errs on the side of its
/// limit until they are in, never by more than these requests.
pub fn orphan(e: &mut Entry) -> u32 {
    let n = std::mem::take(&mut e.inflight);
    e.cur = e.cur.saturating_add(n);
    e.waiting = 0;
    n
}

#[cfg(test)]
#[path = "counter_tests.rs"]
pub(crate) mod tests;
