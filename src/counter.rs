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

/// Brings the entry to window `idx`. What the previous window ended with
/// becomes `prev`; anything older is forgotten.
pub fn roll(e: &mut Entry, idx: u64) {
    let stored = u64::from(e.window);
    if idx <= stored {
        return;
    }
    e.prev = if idx == stored + 1 {
        e.cur.saturating_add(e.inflight)
    } else {
        0
    };
    e.cur = 0;
    e.inflight = 0;
    e.window = idx as u32;
}

/// The outcome of checking one limit against an entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Check {
    pub allowed: bool,
    pub estimate: Estimate,
    /// When rejected: the earliest time (ms) the limit allows a request.
    pub retry_at_ms: u64,
    pub window_start_ms: u64,
}

/// Decides whether `rate` allows another request now. Rolls the entry to
/// the current window first. An open breaker for this limit rejects at once.
pub fn check(e: &mut Entry, rate: Rate, now_ms: u64) -> Check {
    let p = rate.period_ms();
    let idx = window_index(now_ms, p);
    roll(e, idx);
    let window_start_ms = idx * p;
    let total = e.cur.saturating_add(e.inflight);
    let estimate = Estimate::new(e.prev, total, now_ms - window_start_ms, p);
    if e.blocked_until_ms > now_ms && rate.limit <= e.blocked_limit {
        return Check {
            allowed: false,
            estimate,
            retry_at_ms: e.blocked_until_ms,
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
            free_at(rate, e.prev, total, window_start_ms, now_ms)
        },
        window_start_ms,
    }
}

/// Counts an allowed request: locally final without a backend, in flight
/// until Redis confirms it with one.
pub fn count(e: &mut Entry, backend: bool) {
    if backend {
        e.inflight = e.inflight.saturating_add(1);
    } else {
        e.cur = e.cur.saturating_add(1);
    }
}

/// The estimate after counting (for `$redis_ratelimit_remaining`).
pub fn estimate(e: &Entry, rate: Rate, now_ms: u64) -> Estimate {
    let p = rate.period_ms();
    let ws = window_index(now_ms, p) * p;
    Estimate::new(
        e.prev,
        e.cur.saturating_add(e.inflight),
        now_ms.saturating_sub(ws),
        p,
    )
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
    /// `GET` of the window before: its global count (0 when absent).
    pub prev: u64,
}

fn clamp(v: u64) -> u32 {
    v.min(u64::from(u32::MAX)) as u32
}

/// Merges a confirmation, then arms the breaker for `rate` (the tightest
/// limit that uses this entry) when the global count puts the estimate at
/// the limit.
/// Counts only grow within a window, so replies applied out of order (from
/// several workers) keep the largest.
pub fn confirm(e: &mut Entry, c: &Confirmation, rate: Rate, now_ms: u64) {
    let p = rate.period_ms();
    let now_idx = window_index(now_ms, p);
    if c.window > u64::from(e.window) {
        roll(e, c.window);
    }
    let w = u64::from(e.window);
    if c.window == w {
        e.inflight = e.inflight.saturating_sub(c.sent);
        e.cur = e.cur.max(clamp(c.cur));
        e.prev = e.prev.max(clamp(c.prev));
    } else if c.window + 1 == w {
        // A late answer for the window that just ended: it is our `prev`.
        e.prev = e.prev.max(clamp(c.cur));
    } else {
        return;
    }
    if now_idx != w {
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
        e.blocked_until_ms = free_at(rate, e.prev, e.cur, ws, now_ms);
        e.blocked_limit = rate.limit;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R: Rate = Rate {
        limit: 10,
        period: 60,
    };
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
        confirm(
            &mut e,
            &Confirmation {
                window: idx,
                sent: 3,
                cur: 8,
                prev: 0,
            },
            R,
            T0 + 5,
        );
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
        confirm(
            &mut e,
            &Confirmation {
                window: idx,
                sent: 1,
                cur: 6,
                prev: 0,
            },
            R,
            T0,
        );
        confirm(
            &mut e,
            &Confirmation {
                window: idx,
                sent: 1,
                cur: 4,
                prev: 0,
            },
            R,
            T0,
        );
        assert_eq!((e.cur, e.inflight), (6, 0));
    }

    #[test]
    fn breaker_opens_when_the_global_count_reaches_the_limit() {
        let mut e = fresh();
        let idx = window_index(T0, R.period_ms());
        check(&mut e, R, T0);
        count(&mut e, true);
        confirm(
            &mut e,
            &Confirmation {
                window: idx,
                sent: 1,
                cur: 10,
                prev: 0,
            },
            R,
            T0 + 1,
        );
        assert_eq!(e.blocked_limit, 10);
        assert_eq!(e.blocked_until_ms, T0 + 60_000 + 1);
        let c = check(&mut e, R, T0 + 2);
        assert!(!c.allowed);
        assert_eq!(c.retry_at_ms, T0 + 60_000 + 1);
        // a looser limit on the same entry is not held by that breaker
        let loose = Rate {
            limit: 20,
            period: 60,
        };
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
            &Confirmation {
                window: old,
                sent: 4,
                cur: 12,
                prev: 0,
            },
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
        let r = Rate {
            limit: 12,
            period: 60,
        };
        let mut e = fresh();
        for _ in 0..10 {
            assert!(check(&mut e, r, T0).allowed);
            count(&mut e, true);
        }
        let idx = window_index(T0, r.period_ms());
        confirm(
            &mut e,
            &Confirmation {
                window: idx,
                sent: 5,
                cur: 10,
                prev: 0,
            },
            r,
            T0 + 1,
        );
        assert_eq!((e.cur, e.inflight), (10, 5));
        assert_eq!(e.blocked_until_ms, 0, "no breaker from a double count");
        // until B's reply arrives decisions are conservative...
        assert!(!check(&mut e, r, T0 + 2).allowed);
        confirm(
            &mut e,
            &Confirmation {
                window: idx,
                sent: 5,
                cur: 10,
                prev: 0,
            },
            r,
            T0 + 3,
        );
        // ...then exact again: 2 more pass
        assert!(check(&mut e, r, T0 + 4).allowed);
    }

    #[test]
    fn stale_confirmations_are_ignored() {
        let mut e = fresh();
        check(&mut e, R, T0 + 180_000);
        let old = window_index(T0, R.period_ms());
        confirm(
            &mut e,
            &Confirmation {
                window: old,
                sent: 1,
                cur: 99,
                prev: 99,
            },
            R,
            T0 + 180_000,
        );
        assert_eq!((e.prev, e.cur), (0, 0));
    }
}
