//! The sliding-window estimate (Cloudflare's): for a limit of `L` per period
//! `P`, at time `t` inside the window that started at `w`,
//!
//! ```text
//! estimate = prev * (P - (t - w)) / P + cur
//! ```
//!
//! A request is allowed iff the estimate before it is below `L`. All the
//! arithmetic here is integer, in milliseconds, scaled by `P` so that no
//! decision depends on floating point rounding.

use crate::rate::Rate;

/// Which window (counted from the epoch) contains `now_ms`.
#[inline]
pub fn window_index(now_ms: u64, period_ms: u64) -> u64 {
    now_ms / period_ms
}

/// Counts stored for window `stored`, seen from window `now`: returns the
/// (previous, current) counts for window `now`. A clock that went backwards
/// keeps the stored counts rather than forgetting them.
#[inline]
pub fn roll(stored: u64, prev: u32, cur: u32, now: u64) -> (u32, u32) {
    if now <= stored {
        (prev, cur)
    } else if now == stored + 1 {
        (cur, 0)
    } else {
        (0, 0)
    }
}

/// The estimate at one instant, kept scaled by the period in milliseconds.
/// With counts of at most `u32::MAX` and periods of at most a day
/// (8.64e7 ms < 2^27), every product below stays under 2^60: plain u64
/// arithmetic (saturating, should a caller pass more) is exact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Estimate {
    scaled: u64,
    period_ms: u64,
}

impl Estimate {
    /// `elapsed_ms` is the time since the current window started (`t - w`).
    #[inline]
    pub fn new(prev: u32, cur: u32, elapsed_ms: u64, period_ms: u64) -> Estimate {
        let elapsed = elapsed_ms.min(period_ms);
        let scaled = u64::from(prev)
            .saturating_mul(period_ms - elapsed)
            .saturating_add(u64::from(cur).saturating_mul(period_ms));
        Estimate { scaled, period_ms }
    }

    /// Is another request allowed under `limit`?
    #[inline]
    pub fn below(&self, limit: u32) -> bool {
        self.scaled < u64::from(limit).saturating_mul(self.period_ms)
    }

    /// Is a request weighing `cost` allowed under `limit`: estimate + cost
    /// − 1 < limit (cost 0 is checked as 1: a check that counts nothing).
    #[inline]
    pub fn below_cost(&self, limit: u32, cost: u32) -> bool {
        if cost <= 1 {
            return self.below(limit);
        }
        let extra = u64::from(cost - 1).saturating_mul(self.period_ms);
        self.scaled.saturating_add(extra) < u64::from(limit).saturating_mul(self.period_ms)
    }

    /// How many more requests `limit` allows right now (`ceil(L - estimate)`).
    #[inline]
    pub fn remaining(&self, limit: u32) -> u32 {
        let cap = u64::from(limit).saturating_mul(self.period_ms);
        if self.scaled >= cap {
            return 0;
        }
        ((cap - self.scaled).div_ceil(self.period_ms)).min(u64::from(u32::MAX)) as u32
    }

    /// Whether `remaining(limit) <= n`, without its division (the hot
    /// path asks this of every request near or far from the limit).
    #[inline(always)]
    pub fn remaining_at_most(&self, limit: u32, n: u32) -> bool {
        // ceil(a / p) <= n  <=>  a <= n * p, for a >= 0 and p > 0
        let cap = u64::from(limit).saturating_mul(self.period_ms);
        cap.saturating_sub(self.scaled) <= u64::from(n).saturating_mul(self.period_ms)
    }

    /// The estimate once `n` more requests are counted in the current
    /// window (what `new` gives with `cur + n`, without computing it again).
    #[inline]
    pub fn plus(&self, n: u32) -> Estimate {
        let scaled = self.scaled.saturating_add(u64::from(n).saturating_mul(self.period_ms));
        Estimate { scaled, period_ms: self.period_ms }
    }

    /// The estimate as a number of requests (for logs and Lua's `measure`).
    #[inline]
    pub fn value(&self) -> f64 {
        self.scaled as f64 / self.period_ms as f64
    }
}

/// The earliest millisecond `t >= now_ms` at which the estimate for `rate`
/// is below its limit again, assuming no further request is counted. `prev`
/// and `cur` are the counts of the window that started at `window_start_ms`.
#[inline]
pub fn free_at(rate: Rate, prev: u32, cur: u32, window_start_ms: u64, now_ms: u64) -> u64 {
    let p = rate.period_ms();
    let limit = u64::from(rate.limit);
    // While cur < L the estimate falls within this window as prev's weight
    // shrinks; otherwise it can only fall in the next one, where cur becomes
    // the previous count and nothing is current yet.
    let (weight, room, end) = if u64::from(cur) < limit {
        (u64::from(prev), limit - u64::from(cur), window_start_ms + p)
    } else {
        (u64::from(cur), limit, window_start_ms + 2 * p)
    };
    if weight == 0 {
        return now_ms;
    }
    // Need weight * (end - t) < room * p, i.e. t > end - room * p / weight.
    let need = u128::from(room) * u128::from(p);
    let q = (need / u128::from(weight)).min(u128::from(end)) as u64;
    let exact = need % u128::from(weight) == 0;
    let t = if exact { end - q + 1 } else { end - q };
    t.max(now_ms)
}

/// When the whole quota is back (the estimate at 0, as if no request came
/// after now): the current window's counts (`cur`, this request's
/// included) weigh on through the next window, so the end of the next
/// window if there are any; else the end of the current window, while the
/// previous window's still weigh (`estimate` above 0); else now.
pub fn quota_back_at(
    now_ms: u64,
    window_start_ms: u64,
    period_ms: u64,
    cur: u64,
    estimate: Estimate,
) -> u64 {
    if cur > 0 {
        window_start_ms.saturating_add(2 * period_ms)
    } else if estimate.scaled > 0 {
        window_start_ms.saturating_add(period_ms)
    } else {
        now_ms
    }
}

/// Whole seconds (rounded up, at least 1) from `now_ms` until `at_ms`.
pub fn seconds_until(now_ms: u64, at_ms: u64) -> u64 {
    at_ms.saturating_sub(now_ms).div_ceil(1000).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(limit: u32, period: u32) -> Rate {
        Rate { limit, period }
    }

    /// A straightforward model of one key on one node, used to check the
    /// integer arithmetic against the formula in floating point.
    struct Key {
        index: u64,
        prev: u32,
        cur: u32,
    }

    impl Key {
        fn hit(&mut self, r: Rate, now_ms: u64) -> bool {
            let p = r.period_ms();
            let idx = window_index(now_ms, p);
            let (prev, cur) = roll(self.index, self.prev, self.cur, idx);
            self.index = idx;
            self.prev = prev;
            self.cur = cur;
            let est = Estimate::new(prev, cur, now_ms - idx * p, p);
            if est.below(r.limit) {
                self.cur += 1;
                true
            } else {
                false
            }
        }
    }

    #[test]
    fn fresh_key_gets_exactly_the_limit() {
        let r = rate(10, 60);
        let start = 1_700_000_040_000; // 0 s into a minute
        let mut k = Key { index: 0, prev: 0, cur: 0 };
        let allowed = (0..100).filter(|i| k.hit(r, start + i * 10)).count();
        assert_eq!(allowed, 10);
    }

    #[test]
    fn previous_window_weighs_in_linearly() {
        // 10 in the previous minute, none yet in this one: at 30 s in, the
        // estimate is 5, so exactly 5 more pass.
        let p = 60_000;
        let est = Estimate::new(10, 0, 30_000, p);
        assert!((est.value() - 5.0).abs() < 1e-9);
        assert_eq!(est.remaining(10), 5);
        assert!(est.below(6));
        assert!(!est.below(5));
    }

    #[test]
    fn remaining_rounds_up() {
        let p = 1000;
        // estimate 3.4 under 10: requests at 3.4, 4.4, ... 9.4 pass: 7.
        let est = Estimate::new(4, 3, 900, p);
        assert!((est.value() - 3.4).abs() < 1e-9);
        assert_eq!(est.remaining(10), 7);
        assert_eq!(Estimate::new(0, 10, 0, p).remaining(10), 0);
        assert_eq!(Estimate::new(0, 11, 0, p).remaining(10), 0);
        assert_eq!(Estimate::new(0, 0, 0, p).remaining(10), 10);
    }

    #[test]
    fn remaining_at_most_agrees_with_remaining() {
        for p in [1000u64, 60_000, 86_400_000] {
            for prev in [0u32, 1, 3, 7, 10, 11, 1000] {
                for cur in [0u32, 1, 2, 5, 9, 10, 12, 999] {
                    for elapsed in [0u64, 1, p / 3, p / 2, p - 1, p] {
                        let est = Estimate::new(prev, cur, elapsed, p);
                        for limit in [1u32, 2, 5, 10, 20, 1000] {
                            for n in [0u32, 1, 2, 5, 10, 500, u32::MAX] {
                                assert_eq!(
                                    est.remaining_at_most(limit, n),
                                    est.remaining(limit) <= n,
                                    "p {p} prev {prev} cur {cur} t {elapsed} L {limit} n {n}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn plus_counts_more_in_the_current_window() {
        for (prev, cur, elapsed, n) in [(4, 3, 900, 1), (10, 0, 30_000, 5), (0, 0, 0, 0)] {
            let p = if elapsed > 1000 { 60_000 } else { 1000 };
            let before = Estimate::new(prev, cur, elapsed, p);
            assert_eq!(before.plus(n), Estimate::new(prev, cur + n, elapsed, p));
        }
        assert_eq!(Estimate::new(0, 9, 0, 1000).plus(1).remaining(10), 0);
    }

    #[test]
    fn roll_forwards_and_backwards() {
        assert_eq!(roll(5, 1, 2, 5), (1, 2));
        assert_eq!(roll(5, 1, 2, 6), (2, 0));
        assert_eq!(roll(5, 1, 2, 7), (0, 0));
        assert_eq!(roll(5, 1, 2, 4), (1, 2));
    }

    #[test]
    fn free_at_is_the_first_allowed_millisecond() {
        // Brute force over many shapes: free_at must be allowed, and the
        // millisecond before it (if not before now) must not be.
        for (limit, period) in [(1, 1), (3, 1), (10, 60), (7, 3600)] {
            let r = rate(limit, period);
            let p = r.period_ms();
            let w = 1000 * p;
            for prev in [0, 1, 2, limit - 1, limit, limit + 3, 5 * limit] {
                for cur in [0, 1, limit.saturating_sub(1), limit, limit + 2] {
                    for now in [w, w + p / 3, w + p / 2, w + p - 1] {
                        let t = free_at(r, prev, cur, w, now);
                        assert!(t >= now);
                        let allowed_at = |t: u64| {
                            let idx = window_index(t, p);
                            let (pv, cu) = roll(window_index(w, p), prev, cur, idx);
                            Estimate::new(pv, cu, t - idx * p, p).below(limit)
                        };
                        assert!(
                            allowed_at(t),
                            "L={limit} P={period} prev={prev} cur={cur} now={now} t={t}"
                        );
                        if t > now {
                            assert!(!allowed_at(t - 1), "L={limit} prev={prev} cur={cur} t={t}");
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn seconds_round_up() {
        assert_eq!(seconds_until(1000, 1000), 1);
        assert_eq!(seconds_until(1000, 1001), 1);
        assert_eq!(seconds_until(1000, 2000), 1);
        assert_eq!(seconds_until(1000, 2001), 2);
        assert_eq!(seconds_until(0, 60_000), 60);
    }

    #[test]
    fn steady_overload_passes_the_limit_rate() {
        // 2x overload at 100 r/s for 10 s, evenly spaced: the sliding window
        // admits close to the limit.
        let r = rate(100, 1);
        let mut k = Key { index: 0, prev: 0, cur: 0 };
        let start = 1_700_000_000_000;
        let allowed = (0..2000u64).filter(|i| k.hit(r, start + i * 5)).count();
        let ratio = allowed as f64 / 1000.0;
        assert!((0.97..=1.03).contains(&ratio), "ratio {ratio}");
    }

    #[test]
    fn the_whole_quota_is_back_when_the_current_windows_counts_have_decayed() {
        let p = 60_000;
        let w = 600_000;
        let est = |prev, cur, e| Estimate::new(prev, cur, e, p);
        // counted in this window: back at the end of the next one
        assert_eq!(quota_back_at(w + 10_000, w, p, 3, est(0, 3, 10_000)), w + 2 * p);
        // only the previous window weighs: back at the end of this one
        assert_eq!(quota_back_at(w + 10_000, w, p, 0, est(5, 0, 10_000)), w + p);
        // nothing: now
        assert_eq!(quota_back_at(w + 10_000, w, p, 0, est(0, 0, 10_000)), w + 10_000);
    }
}
