//! When a node sends what it counted: the headroom-adaptive sync rule.
//!
//! A key far from its limit may wait; a key near it goes at once. Each
//! node keeps at most its share of a quarter of the key's remaining
//! headroom below half its limit unsent:
//!
//! - **near** (the estimate after this request is at half the limit or
//!   more): at once, as every request was sent before this rule. This is
//!   what keeps floods exact: from `L/2` on, every node hears of the others
//!   within a round trip (and spends no more than half its share of the
//!   headroom meanwhile: `share::cap_to_share`).
//! - **far**: the node may hold its unsent increments `u` of the key while
//!   `u ≤ f · (L/2 − g) / 4`, where `g` is what it knows of the key from
//!   Redis (its estimate less `u`) and `f` its share of the key's traffic,
//!   learnt from Redis's replies (its increments against the growth of the
//!   global count; one node in 32 until the first reply). Past that
//!   allowance, with the next flush. Otherwise they wait until `H` after
//!   the request (the zone's `hold=`, 5 s by default), also past the end of
//!   its window: a quiet key's held increments are carried into the
//!   counter of the window current when the key is next counted
//!   (`batch::Batch::add`), as long as they fit in the allowance that is
//!   left (`Due::Hold`'s room), so that a key seen a few times a window
//!   costs one `INCRBY` (and one `EXPIRE`) per several windows, not one
//!   per window.
//!
//! The bound: when the nodes' shares add up to at most 4 (they add up to 1
//! when measured right), the increments all of them hold together
//! (carried ones included) stay below `L/2 − g`, so the key reaches half
//! its limit before anyone could pass it blind, and the near-limit rule
//! takes over exactly as before. Shares measured before the traffic moved
//! can add up to more; a node then hides at most `f_i · L/8` of the key's
//! requests, and no more than it receives in `H`: allowed per window ≤
//! `L + N·(1 + r·RTT) + Σ_i min(f_i · L/8, r_i · H)` (the sum over the
//! nodes whose shares are stale), where the first two terms are the
//! near-limit rule's: each node's blind request and what it passes during
//! one round trip at its rate `r`. Carrying costs accuracy the other way
//! only: increments counted in one window and sent in a later one count
//! there in full (a key's estimate on other nodes is then too high by at
//! most what was carried, within the allowance), never too low.

use crate::counter::Fresh;
use crate::rate::Rate;
use crate::window::Estimate;

/// The share a node assumes of a key it has no reply for yet: one node in
/// 32. Up to 128 nodes meeting a key at once then hold no more than the
/// headroom below half its limit together.
pub const FIRST_SHARE: u16 = u16::MAX / 32;

/// When a counted request is to reach Redis.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Due {
    /// At once (the next flush, within milliseconds).
    Now,
    /// By this time (ms, the clock of `now_ms`).
    By(u64),
    /// Far from the limit: by this time, and the increments the node still
    /// holds of the key's earlier windows may be carried into this one's
    /// counter (`batch`) while they are at most this many (the node's
    /// allowance less what it holds of this window).
    Hold(u64, u32),
}

impl Due {
    /// Later than any other, with all the room there is: what `min` over
    /// nothing gives (a fold over the limits of an entry starts here).
    pub const LATEST: Due = Due::Hold(u64::MAX, u32::MAX);

    /// The earlier of two (held only if both are, with the smaller room).
    pub fn min(self, other: Due) -> Due {
        match (self, other) {
            (Due::Now, _) | (_, Due::Now) => Due::Now,
            (Due::Hold(a, r), Due::Hold(b, s)) => Due::Hold(a.min(b), r.min(s)),
            (Due::By(a) | Due::Hold(a, _), Due::By(b) | Due::Hold(b, _)) => Due::By(a.min(b)),
        }
    }

    /// Within a flush (at once, or past what the node may hold): the node
    /// then waits for Redis's answer (`counter::wait`).
    #[inline]
    pub fn prompt(self) -> bool {
        !matches!(self, Due::Hold(..))
    }

    /// The time to send by (ms; 0: at once).
    #[inline]
    pub fn due(self) -> u64 {
        match self {
            Due::Now => 0,
            Due::By(ms) | Due::Hold(ms, _) => ms.max(1),
        }
    }

    /// How many increments of earlier windows may be carried (`Hold` only).
    #[inline]
    pub fn room(self) -> Option<u32> {
        match self {
            Due::Hold(_, room) => Some(room),
            _ => None,
        }
    }
}

/// Whether a key's held increments of earlier windows (`held`, every one
/// of them pushed far from the limit) may go into a later window's counter
/// by a push that says `send`.
#[inline]
pub fn may_carry(held: u32, send: Due) -> bool {
    send.room().is_some_and(|room| held <= room)
}

/// How many increments a node may hold unsent: its share (out of
/// `u16::MAX`) of a quarter of the headroom below half the limit, given
/// what it knows from Redis (`known`).
#[inline]
pub fn allowance(limit: u32, known: f64, share: u16) -> u32 {
    let room = f64::from(limit / 2) - known;
    if room <= 0.0 || share == 0 {
        return 0;
    }
    (room * f64::from(share) / f64::from(u16::MAX) / 4.0) as u32
}

/// When a request just counted for `rate` goes to Redis: `after` is the
/// key's estimate with it, `unsent` the node's increments of the key that
/// Redis has not confirmed (this one included), `share` the node's share of
/// the key (`Entry::share`), `hold_ms` the zone's `hold=`. Near the limit: at once. Past the
/// allowance, or with `hold=0`: the next flush (`By(now)`).
#[inline]
pub fn when(
    rate: Rate,
    after: Estimate,
    unsent: u32,
    share: u16,
    now_ms: u64,
    hold_ms: u64,
) -> Due {
    if after.remaining_at_most(rate.limit, rate.limit / 2) {
        return Due::Now;
    }
    let known = after.value() - f64::from(unsent);
    let share = if share == 0 { FIRST_SHARE } else { share };
    let room = allowance(rate.limit, known, share);
    if hold_ms == 0 || unsent > room {
        return Due::By(now_ms);
    }
    Due::Hold(now_ms.saturating_add(hold_ms), room - unsent)
}

/// How a zone's first counts of keys whose counters are probably new make
/// them, learnt from what they found. A key this node has no count of
/// from Redis yet (`Fresh::Maybe`: first contact, most keys of real
/// traffic; or one seen again whose last count was this node's alone) may
/// be the first of its window anywhere, or another node may have counted
/// it already. `SET NX EX` costs one command in the first case and two in the
/// second (`SET`, then `INCRBY`, one round trip later); `INCRBY` costs two
/// in the first (then `EXPIRE`) and one in the second. So first counts go
/// as `SET NX EX` while at least half of the recent ones made their
/// counter: behind a load balancer that sends a client to one node they
/// all do, behind one that spreads a client over many nodes most do not.
/// Whichever command a first count went as, its reply says whether it made
/// the counter, so the rule keeps learning both ways.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FirstCounts {
    /// Made minus found, within ±`FIRST_COUNTS_SPAN`.
    score: i8,
}

/// How far `FirstCounts` remembers: this many first counts one way undo
/// as many the other way.
pub const FIRST_COUNTS_SPAN: i8 = 8;

impl FirstCounts {
    /// Whether an item far from its limit (`batch::Item::far`) that knows
    /// `fresh` of its window's counter makes it with `SET NX EX`.
    #[inline]
    pub fn create(&self, fresh: Fresh) -> bool {
        match fresh {
            Fresh::Alone => true,
            Fresh::Maybe => self.score >= 0,
            Fresh::No => false,
        }
    }

    /// A first count's reply: it made the window's counter (`made`), or
    /// found it made by another.
    #[inline]
    pub fn learn(&mut self, made: bool) {
        self.score = if made {
            (self.score + 1).min(FIRST_COUNTS_SPAN)
        } else {
            (self.score - 1).max(-FIRST_COUNTS_SPAN)
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_counts_follow_what_most_of_them_found() {
        let mut f = FirstCounts::default();
        assert!(f.create(Fresh::Maybe), "a zone starts by guessing its keys new");
        assert!(f.create(Fresh::Alone));
        assert!(!f.create(Fresh::No));
        // another node made the counters: after one miss, INCRBY
        f.learn(false);
        assert!(!f.create(Fresh::Maybe));
        assert!(f.create(Fresh::Alone), "a node alone on a key still guesses");
        // half and half: SET NX EX again (it costs no more)
        f.learn(true);
        assert!(f.create(Fresh::Maybe));
        // a long run one way is undone by as long a run the other way, not more
        for _ in 0..100 {
            f.learn(false);
        }
        for _ in 0..FIRST_COUNTS_SPAN - 1 {
            f.learn(true);
        }
        assert!(!f.create(Fresh::Maybe));
        f.learn(true);
        assert!(f.create(Fresh::Maybe));
        for _ in 0..100 {
            f.learn(true);
        }
        f.learn(false);
        assert!(f.create(Fresh::Maybe), "one miss after many made: still SET NX EX");
    }

    fn est(prev: u32, cur: u32, elapsed_ms: u64, p: u64) -> Estimate {
        Estimate::new(prev, cur, elapsed_ms, p)
    }

    const PER_MIN: Rate = Rate { limit: 6000, period: 60 };
    const PER_SEC: Rate = Rate { limit: 100, period: 1 };
    const H: u64 = 5_000;
    /// A node alone on its keys.
    const ALL: u16 = u16::MAX;

    #[test]
    fn far_from_the_limit_waits_up_to_the_hold_even_past_the_window_end() {
        // 10 s into a minute window, 100 counted, 1 of them unsent: alone,
        // (3000 - 99) / 4 = 725 may wait, 724 more
        let now = 600_000 + 10_000;
        let s = when(PER_MIN, est(0, 100, 10_000, 60_000), 1, ALL, now, H);
        assert_eq!(s, Due::Hold(now + H, 724));
        // 58 s in: still the hold (what is held then goes into the next
        // window's counter, or into its own after the hold)
        let now = 600_000 + 58_000;
        assert_eq!(
            when(PER_MIN, est(0, 100, 58_000, 60_000), 1, ALL, now, H),
            Due::Hold(now + H, 724)
        );
        // a per-second window: the hold too, beyond the window
        let now = 5_000_300;
        assert_eq!(when(PER_SEC, est(8, 3, 300, 1000), 1, ALL, now, H), Due::Hold(now + H, 9));
    }

    #[test]
    fn near_the_limit_goes_at_once() {
        // 50 of 100 after this request: half the limit
        assert_eq!(when(PER_SEC, est(0, 50, 500, 1000), 1, ALL, 500, H), Due::Now);
        // the previous window's weight counts too: 80 * 0.5 + 10
        assert_eq!(when(PER_SEC, est(80, 10, 500, 1000), 1, ALL, 500, H), Due::Now);
    }

    #[test]
    fn past_its_share_of_the_headroom_goes_with_the_next_flush() {
        // alone, known 10 of 100: (50 - 10) / 4 = 10 may wait
        assert_eq!(allowance(100, 10.0, ALL), 10);
        let now = 100;
        assert_eq!(when(PER_SEC, est(0, 20, 100, 1000), 10, ALL, now, H), Due::Hold(now + H, 0));
        assert_eq!(when(PER_SEC, est(0, 21, 100, 1000), 11, ALL, now, H), Due::By(now));
        // half of the key's traffic: half of that
        assert_eq!(allowance(100, 10.0, ALL / 2), 4);
        assert_eq!(when(PER_SEC, est(0, 15, 100, 1000), 5, ALL / 2, now, H), Due::By(now));
        // a key new to the node (no share yet): one node in 32
        assert_eq!(allowance(6000, 0.0, 0), 0);
        assert_eq!(allowance(6000, 0.0, FIRST_SHARE), 23);
        assert_eq!(when(PER_MIN, est(0, 23, 100, 60_000), 23, 0, 100, H), Due::Hold(5100, 0));
        assert_eq!(when(PER_MIN, est(0, 24, 100, 60_000), 24, 0, 100, H), Due::By(100));
        // ... which under a low limit is nothing: at once, as before
        assert_eq!(when(PER_SEC, est(0, 1, 100, 1000), 1, 0, 100, H), Due::By(100));
        // a low limit has no allowance: every request at once, as before
        let low = Rate { limit: 3, period: 60 };
        assert_eq!(allowance(3, 0.0, ALL), 0);
        assert_eq!(allowance(8, 0.0, ALL), 1);
        assert_eq!(when(low, est(0, 1, 100, 60_000), 1, ALL, 100, H), Due::By(100));
        // a request that weighs more than the allowance
        assert_eq!(when(PER_MIN, est(0, 800, 100, 60_000), 800, ALL, 100, H), Due::By(100));
        // hold=0: every request in the next flush
        assert_eq!(when(PER_MIN, est(0, 1, 100, 60_000), 1, ALL, 100, 0), Due::By(100));
    }

    #[test]
    fn the_held_requests_of_nodes_whose_shares_add_up_to_four_stay_below_half_the_limit() {
        for limit in [8u32, 10, 100, 999, 6000, 1_000_000] {
            for g in [0u32, 1, limit / 8, limit / 4, limit / 2 - 1] {
                for n in [1u32, 2, 3, 10, 100] {
                    // n nodes whose shares add up to 4 (at most 1 each)
                    let share = (4 * u32::from(u16::MAX) / n).min(u32::from(u16::MAX)) as u16;
                    let a = allowance(limit, f64::from(g), share);
                    let held = u64::from(n) * u64::from(a);
                    assert!(
                        u64::from(g) + held <= u64::from(limit / 2),
                        "limit {limit}, known {g}, {n} nodes: {held} held passes half"
                    );
                }
            }
        }
    }

    #[test]
    fn send_min() {
        assert_eq!(Due::By(5).min(Due::By(3)), Due::By(3));
        assert_eq!(Due::By(5).min(Due::Now), Due::Now);
        assert_eq!(Due::Now.min(Due::By(1)), Due::Now);
        assert_eq!(Due::Hold(5, 2).min(Due::Hold(7, 1)), Due::Hold(5, 1));
        assert_eq!(Due::Hold(5, 2).min(Due::By(7)), Due::By(5));
        assert_eq!(Due::By(9).min(Due::Hold(7, 1)), Due::By(7));
        assert_eq!(Due::Hold(5, 2).min(Due::Now), Due::Now);
        assert_eq!((Due::Now.due(), Due::By(0).due(), Due::Hold(8, 1).due()), (0, 1, 8));
        assert!(may_carry(3, Due::Hold(1, 3)) && !may_carry(4, Due::Hold(1, 3)));
        assert!(!may_carry(0, Due::By(1)) && !may_carry(0, Due::Now));
        // the identity of `min`: a fold over one held limit stays held
        for s in [Due::Hold(5, 2), Due::By(5), Due::Now] {
            assert_eq!(Due::LATEST.min(s), s);
            assert_eq!(s.min(Due::LATEST), s);
        }
    }
}
