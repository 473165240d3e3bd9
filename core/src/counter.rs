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
#[inline]
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
    e.window = idx as u32;
    idx
}

/// The outcome of checking one limit against an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    pub allowed: bool,
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
            estimate,
            retry_at_ms: e.blocked_until_ms,
            window,
            window_start_ms,
        };
    }
    let allowed = estimate.below(rate.limit);
    Check {
        allowed,
        estimate,
        retry_at_ms: if allowed {
            now_ms
        } else {
            free_at(rate, e.prev, total, window_start_ms, now_ms.max(window_start_ms)).min(latest)
        },
        window,
        window_start_ms,
    }
}

/// Counts an allowed request: locally final without a backend, in flight
/// until Redis confirms it with one.
#[inline]
pub fn count(e: &mut Entry, backend: bool) {
    if backend {
        e.inflight = e.inflight.saturating_add(1);
    } else {
        e.cur = e.cur.saturating_add(1);
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
    /// How many increments it carried.
    pub sent: u32,
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

/// Increments Redis could not take (an error reply for that key, or a
/// connection lost with the outcome unknown): they stay counted on this
/// node alone, as final local counts instead of in flight.
pub fn keep_local(e: &mut Entry, window: u64, sent: u32) {
    if window == u64::from(e.window) {
        let n = sent.min(e.inflight);
        e.inflight -= n;
        e.cur = e.cur.saturating_add(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Rate = Rate { limit: 10, period: 60 };
    const T0: u64 = 1_700_000_040_000; // start of a minute

    fn fresh() -> Entry {
        Entry::default()
    }

    #[test]
    fn local_counting_allows_exactly_the_limit() {
        for backend in [false, true] {
            let mut e = fresh();
            let mut allowed = 0;
            for i in 0..30 {
                if check(&mut e, R, T0 + i).allowed {
                    count(&mut e, backend);
                    allowed += 1;
                }
            }
            assert_eq!(allowed, 10, "backend={backend}");
        }
    }

    #[test]
    fn confirmations_replace_inflight_with_global_counts() {
        let mut e = fresh();
        for _ in 0..3 {
            assert!(check(&mut e, R, T0).allowed);
            count(&mut e, true);
        }
        assert_eq!((e.cur, e.inflight), (0, 3));
        // Redis says the window holds 8: our 3 plus 5 from other nodes.
        let idx = window_index(T0, R.period_ms());
        confirm(&mut e, &Confirmation { window: idx, sent: 3, cur: 8, prev: Some(0) }, R, T0 + 5);
        assert_eq!((e.cur, e.inflight), (8, 0));
        assert!(check(&mut e, R, T0 + 6).allowed);
        count(&mut e, true);
        assert!(check(&mut e, R, T0 + 7).allowed);
        count(&mut e, true);
        let c = check(&mut e, R, T0 + 8);
        assert!(!c.allowed);
        assert!(c.retry_at_ms >= T0 + 60_000);
    }

    #[test]
    fn out_of_order_confirmations_keep_the_largest() {
        let mut e = fresh();
        let idx = window_index(T0, R.period_ms());
        for _ in 0..2 {
            check(&mut e, R, T0);
            count(&mut e, true);
        }
        confirm(&mut e, &Confirmation { window: idx, sent: 1, cur: 6, prev: Some(0) }, R, T0);
        confirm(&mut e, &Confirmation { window: idx, sent: 1, cur: 4, prev: Some(0) }, R, T0);
        assert_eq!((e.cur, e.inflight), (6, 0));
    }

    #[test]
    fn breaker_opens_when_the_global_count_reaches_the_limit() {
        let mut e = fresh();
        let idx = window_index(T0, R.period_ms());
        check(&mut e, R, T0);
        count(&mut e, true);
        confirm(&mut e, &Confirmation { window: idx, sent: 1, cur: 10, prev: Some(0) }, R, T0 + 1);
        assert_eq!(e.blocked_limit, 10);
        assert_eq!(e.blocked_until_ms, T0 + 60_000 + 1);
        let c = check(&mut e, R, T0 + 2);
        assert!(!c.allowed);
        assert_eq!(c.retry_at_ms, T0 + 60_000 + 1);
        // a looser limit on the same entry is not held by that breaker
        let loose = Rate { limit: 20, period: 60 };
        assert!(check(&mut e, loose, T0 + 3).allowed);
    }

    #[test]
    fn window_roll_carries_unconfirmed_counts_into_prev() {
        let mut e = fresh();
        for _ in 0..4 {
            check(&mut e, R, T0);
            count(&mut e, true);
        }
        // next minute, halfway: prev = 4 (all unconfirmed), weight 1/2
        let c = check(&mut e, R, T0 + 90_000);
        assert!(c.allowed);
        assert_eq!(e.prev, 4);
        assert!((c.estimate.value() - 2.0).abs() < 1e-9);
        // a late confirmation for the old window raises prev to the global count
        let old = window_index(T0, R.period_ms());
        confirm(
            &mut e,
            &Confirmation { window: old, sent: 4, cur: 12, prev: Some(0) },
            R,
            T0 + 90_001,
        );
        assert_eq!(e.prev, 12);
        assert_eq!(e.inflight, 0);
        // two windows later everything is forgotten
        let c = check(&mut e, R, T0 + 200_000);
        assert_eq!(e.prev, 0);
        assert!(c.allowed);
    }

    #[test]
    fn breaker_ignores_requests_counted_twice_in_flight() {
        // Two workers each allowed 5 (inflight 10 in shared memory). Worker
        // A's INCRBY reply already includes worker B's 5 (cur = 10) before
        // B's own reply is applied: the total is briefly 15, but only the
        // global 10 may arm the breaker, and a limit of 12 is not reached.
        let r = Rate { limit: 12, period: 60 };
        let mut e = fresh();
        for _ in 0..10 {
            assert!(check(&mut e, r, T0).allowed);
            count(&mut e, true);
        }
        let idx = window_index(T0, r.period_ms());
        confirm(&mut e, &Confirmation { window: idx, sent: 5, cur: 10, prev: Some(0) }, r, T0 + 1);
        assert_eq!((e.cur, e.inflight), (10, 5));
        assert_eq!(e.blocked_until_ms, 0, "no breaker from a double count");
        // until B's reply arrives decisions are conservative...
        assert!(!check(&mut e, r, T0 + 2).allowed);
        confirm(&mut e, &Confirmation { window: idx, sent: 5, cur: 10, prev: Some(0) }, r, T0 + 3);
        // ...then exact again: 2 more pass
        assert!(check(&mut e, r, T0 + 4).allowed);
    }

    const HOUR: u64 = 3_600_000;

    /// Requests every 10 ms for `ms` from `start`, each confirmed by an
    /// exact single-node Redis (so inflight drains): how many pass.
    fn run(
        e: &mut Entry,
        r: Rate,
        start: u64,
        ms: u64,
        redis: &mut std::collections::HashMap<u64, u64>,
    ) -> (u32, u64) {
        let mut allowed = 0;
        let mut worst_retry = 0;
        let mut t = start;
        while t < start + ms {
            let c = check(e, r, t);
            if c.allowed {
                count(e, true);
                allowed += 1;
                let cur = redis.entry(c.window).or_default();
                *cur += 1;
                let prev = redis.get(&(c.window.wrapping_sub(1))).copied().unwrap_or(0);
                let conf = Confirmation {
                    window: c.window,
                    sent: 1,
                    cur: *redis.get(&c.window).unwrap_or(&0),
                    prev: Some(prev),
                };
                confirm(e, &conf, r, t);
            } else {
                worst_retry = worst_retry.max(c.retry_at_ms - t);
            }
            t += 10;
        }
        (allowed, worst_retry)
    }

    #[test]
    fn clock_step_back_of_an_hour_neither_blocks_nor_floods() {
        let r = Rate { limit: 10, period: 1 };
        let mut e = fresh();
        let mut redis = std::collections::HashMap::new();
        let (a, _) = run(&mut e, r, T0, 3000, &mut redis);
        assert!((28..=31).contains(&a), "{a} in 3 s before the step");
        // an item sent just before the step comes back after it: ignored
        let late = Confirmation {
            window: window_index(T0 + 3000, 1000),
            sent: 1,
            cur: 99,
            prev: Some(99),
        };
        let back = T0 + 3000 - HOUR;
        confirm(&mut e, &late, r, back);
        let (a, worst) = run(&mut e, r, back, 10_000, &mut redis);
        assert!((95..=105).contains(&a), "{a} in 10 s after a 1 h step back");
        assert!(worst <= 1000, "Retry-After {worst} ms > the period");
    }

    #[test]
    fn clock_step_forward_of_an_hour_forgets_and_goes_on() {
        let r = Rate { limit: 10, period: 60 };
        let mut e = fresh();
        let mut redis = std::collections::HashMap::new();
        let (a, _) = run(&mut e, r, T0, 1000, &mut redis);
        assert_eq!(a, 10);
        let (a, worst) = run(&mut e, r, T0 + HOUR, 1000, &mut redis);
        assert_eq!(a, 10, "a fresh window after the step");
        assert!(worst <= 60_000);
        // and a step back to where it was: never more than a period blocked
        let (a, worst) = run(&mut e, r, T0 + 2000, 61_000, &mut redis);
        assert!(a <= 11, "{a}");
        assert!(worst <= 60_000, "{worst}");
    }

    #[test]
    fn a_worker_a_little_behind_keeps_the_entry() {
        let r = Rate { limit: 10, period: 1 };
        let mut e = fresh();
        let w = T0 / 1000 + 1;
        for _ in 0..10 {
            assert!(check(&mut e, r, w * 1000 + 5).allowed);
            count(&mut e, true);
        }
        // another worker's cached clock, 3 ms behind the window start
        let c = check(&mut e, r, w * 1000 - 3);
        assert!(!c.allowed);
        assert_eq!(c.window, w);
        assert_eq!(e.inflight, 10);
        // a breaker set far in the future (clock stepped back) is dropped
        e.blocked_until_ms = w * 1000 + HOUR;
        e.blocked_limit = 10;
        let c = check(&mut e, r, w * 1000 + 10);
        assert!(c.retry_at_ms <= w * 1000 + 10 + 1000);
    }

    #[test]
    fn failed_increments_stay_counted_here() {
        let mut e = fresh();
        let c = check(&mut e, R, T0);
        count(&mut e, true);
        count(&mut e, true);
        keep_local(&mut e, c.window, 2);
        assert_eq!((e.cur, e.inflight), (2, 0));
        keep_local(&mut e, c.window + 5, 2);
        assert_eq!((e.cur, e.inflight), (2, 0));
    }

    #[test]
    fn stale_confirmations_are_ignored() {
        let mut e = fresh();
        check(&mut e, R, T0 + 180_000);
        let old = window_index(T0, R.period_ms());
        confirm(
            &mut e,
            &Confirmation { window: old, sent: 1, cur: 99, prev: Some(99) },
            R,
            T0 + 180_000,
        );
        assert_eq!((e.prev, e.cur), (0, 0));
    }
}
