//! What a node may pass without hearing from Redis: its share of a key's
//! headroom, near the limit or while its view of the key is stale
//! (`cap_to_share`), and while Redis cannot be reached with
//! `on_error=share` (`cap_to_fleet_share`). Pure logic over `table::Entry`
//! and a `counter::Check`.

use crate::counter::{waited_ms, Check};
use crate::rate::Rate;
use crate::table::Entry;
use crate::window::Estimate;

/// How many nodes a node that has waited too long for its first reply of a
/// key assumes flood it with it (`cap_to_share`).
pub const UNHEARD_NODES: u16 = 8;

/// Unconfirmed requests a node may always have near the limit, whatever
/// its share (`cap_to_share`): a lone client's few requests in flight are
/// never refused for a share learnt too small.
pub const CAP_FLOOR: u64 = 4;

/// Near the limit a node spends no more than half its share of the
/// headroom Redis confirmed before it hears back. With the near-limit rule
/// every node sends at once from `L/2` on, but each would otherwise pass
/// all of the headroom it sees during a round trip, and `N` nodes together
/// up to `N` times it. A node whose share of the key's traffic is `f`
/// keeps its unconfirmed requests within `max(CAP_FLOOR, ⌈f/2 · (L − g)⌉)`
/// (`g`: the estimate from Redis's counts alone): what all of them pass
/// blind then adds up to the headroom (plus `CAP_FLOOR` a node) while the
/// shares add up to 2 or less. They add up to 1 when measured over the
/// same traffic, and to more when the nodes' replies land in different
/// orders: the first node to be answered after a stall sees its own
/// increments and few of the others', and learns a share too large. A
/// request past the cap is rejected; the next reply (within a round trip)
/// moves `g` and the cap on, so the last of the headroom goes in halves. A
/// node alone learns a share near 1 within a few replies (each one alone
/// moves it a quarter of the way).
///
/// Fresh (not waiting for Redis longer than `stale_ms`): no cap far from
/// the limit, nor before the first reply (a lone client's burst on a fresh
/// key gets the limit while Redis answers in time). Stale (waiting longer)
/// and far from the limit: the node's share of the headroom below `L/2`,
/// or an eighth of it before a first reply (`UNHEARD_NODES`): a node that
/// has not heard back (first contact, a thread that did not run, a Redis
/// that stalls) may be one of many flooding the key, which all take the
/// same shares of the same stale headroom, and with their shares adding
/// up to 2 or less they do not take the key past `L` together before
/// they hear from Redis. Four nodes flooding a fresh key while Redis
/// stalls then pass a quarter of `L` blind together, not `L` each; two
/// nodes that learnt half each from their first reply pass `L/2`
/// together, not `L`; a lone client at a modest rate whose node has heard
/// of its key (its share all of the traffic) goes on through a stall of
/// seconds. Near the limit a stale share shrinks further by
/// `stale_ms / waited`: the headroom a node last saw is the older, and the
/// more of it the others have spent, the longer it waits (nodes whose
/// threads are starved in turn would otherwise each spend a share of a
/// different, stale headroom).
/// A node holding increments far from the limit waits for nothing (`wait`),
/// and is never capped for it; nor is one whose backend is known down
/// (`on_error` decides then: the caller passes an endless `stale_ms`).
///
/// Turns an allowed `c` into a rejection with a retry time of `retry_ms`
/// from now.
///
/// The test that lets most requests go (fresh, and far from the limit or
/// before a first reply) is inline, the cap itself is not.
#[inline(always)]
pub fn cap_to_share(
    e: &Entry,
    rate: Rate,
    now_ms: u64,
    cost: u32,
    retry_ms: u64,
    stale_ms: u64,
    c: &mut Check,
) {
    if c.allowed
        && e.inflight > 0
        && (waited_ms(e, now_ms) > stale_ms || e.share > 0 && near(c, rate, cost))
    {
        cap(e, rate, now_ms, cost, retry_ms, stale_ms, c);
    }
}

/// Whether a key is near its limit: half of it or less left.
#[inline(always)]
fn near(c: &Check, rate: Rate, cost: u32) -> bool {
    c.estimate.remaining_at_most(rate.limit, (rate.limit / 2).saturating_add(cost))
}

/// `cap_to_share` past its fast test.
#[inline(never)]
fn cap(e: &Entry, rate: Rate, now_ms: u64, cost: u32, retry_ms: u64, stale_ms: u64, c: &mut Check) {
    let waited = waited_ms(e, now_ms);
    let (stale, near) = (waited > stale_ms, near(c, rate, cost));
    // stale before a first reply: as one of `UNHEARD_NODES`
    let mut share = u64::from(if e.share == 0 { u16::MAX / UNHEARD_NODES } else { e.share });
    if near {
        // half of it: shares learnt from replies that land in different
        // orders add up to more than 1
        share /= 2;
        if stale {
            // the headroom seen is older the longer the wait: the others
            // spent it meanwhile
            share = share * stale_ms / waited;
        }
    }
    let p = rate.period_ms();
    let known = Estimate::new(e.prev, e.cur, now_ms.saturating_sub(c.window_start_ms), p);
    let mut headroom = u64::from(known.remaining(rate.limit));
    if stale && !near {
        // far from the limit and stale: the share of the headroom below
        // half the limit
        headroom = headroom.saturating_sub(u64::from(rate.limit - rate.limit / 2));
    }
    let most = (headroom * share).div_ceil(u64::from(u16::MAX)).max(CAP_FLOOR);
    if u64::from(e.inflight) + u64::from(cost.max(1)) > most {
        c.allowed = false;
        c.retry_at_ms = now_ms.saturating_add(retry_ms);
    }
}

/// While Redis cannot be reached, with `on_error=share`: the node lets a
/// key through only within its share of what Redis last left of the
/// limit (`L − g`, `g` the estimate from Redis's counts alone): the share
/// it learnt from Redis's replies (`Entry::share`), or `1/nodes` for a key
/// it has none of (`nodes`: the nodes that counted through this Redis
/// lately; 1 when not known). What all nodes pass blind then adds up to
/// the headroom when the shares add up to 1, and a key first seen during
/// the outage gets `L/N` on each node, not `L`. Never less than one
/// request a window per node. This node's requests not confirmed by Redis
/// (`inflight`: the outage's, and any sent before it without an answer)
/// count against it; a new window starts with the previous one's count.
///
/// Turns an allowed `c` into a rejection until the window ends.
#[inline]
pub fn cap_to_fleet_share(
    e: &Entry,
    rate: Rate,
    now_ms: u64,
    cost: u32,
    nodes: u32,
    c: &mut Check,
) {
    if !c.allowed {
        return;
    }
    let p = rate.period_ms();
    let known = Estimate::new(e.prev, e.cur, now_ms.saturating_sub(c.window_start_ms), p);
    let headroom = u64::from(known.remaining(rate.limit));
    let share = if e.share == 0 {
        u64::from(u16::MAX) / u64::from(nodes.clamp(1, u32::from(u16::MAX)))
    } else {
        u64::from(e.share)
    };
    let cap = (headroom * share).div_ceil(u64::from(u16::MAX)).max(1);
    if u64::from(e.inflight) + u64::from(cost.max(1)) > cap {
        c.allowed = false;
        c.retry_at_ms = c.window_start_ms.saturating_add(p).max(now_ms);
    }
}

#[cfg(test)]
#[path = "share_tests.rs"]
mod tests;
