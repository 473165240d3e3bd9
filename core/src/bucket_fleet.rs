//! The fleet's bucket (a bucket on a zone with Redis), as one node keeps
//! it: what it may decide on its own and what it owes Redis.
//!
//! Redis holds the fleet's level; the strict script decides what it is
//! asked and answers the level (`strict.lua`). A node keeps, in the key's
//! entry, its *view* (`level_of`: Redis's last level plus what this node
//! admitted since, drained as time goes: what it rejects on and delays
//! by), the *known* level (Redis's last answer plus what this node sent
//! since, drained), and what it *owes*: the requests it admitted on its
//! own and has not sent, in thousandths, not drained. The script adds a
//! debt as it comes (a `COUNTED` request whose cost is thousandths) and
//! drains the fleet's level once for everyone; a debt sent late only
//! makes the level higher than it is (by at most what was owed), never
//! lower.
//!
//! A request is decided here (`local`) only while this node has heard
//! from Redis lately (`FRESH_MS`) and what it owes with the request stays
//! within its *allowance*: its part of the room below half the burst,
//! `(C/2 − K) / (2 N)`, where `C` is the burst plus one request, `K` the
//! known level and `N` the nodes counting through the zone's Redis. What
//! all nodes owe together then stays within `(C/2 − K) / 2` (and within
//! `C − K` while `N` is seen up to four times too small), so the fleet's
//! level never passes the burst on requests no one asked Redis about:
//! past the allowance every request is decided by the script on the
//! fleet's exact level, with this node's debt ahead of it in the same
//! call. A debt is sent without a wait once it reaches half the allowance
//! (at least a request): a key's requests go a batch at a time.
//!
//! Fields of a fleet bucket's entry beyond the view (`level_of`): `prev`
//! what the node owes, `inflight` and `window` the known level's excess
//! and the low 32 bits of its time (ms), `blocked_limit` those of the time
//! of Redis's last answer (0: none).

use super::{before, Checked, Level, MILLI};
use crate::rate::Rate;
use crate::table::Entry;

/// How long Redis's last answer lets a node decide a key's bucket on its
/// own: past it, the key's next request asks Redis.
pub const FRESH_MS: u64 = 1000;

/// The known level: Redis's last plus what this node sent since.
fn known(e: &Entry, now_ms: u64) -> Level {
    let age = u64::from((now_ms as u32).wrapping_sub(e.window));
    Level { excess: u64::from(e.inflight), last_ms: now_ms.saturating_sub(age) }
}

fn set_known(e: &mut Entry, l: Level) {
    e.inflight = u32::try_from(l.excess).unwrap_or(u32::MAX);
    e.window = l.last_ms as u32;
}

/// A level of `excess` thousandths at `now_ms` (at least one request below
/// empty), as a `Level` keeps it: below empty is empty that much earlier.
fn level_at(excess: i128, rate: Rate, now_ms: u64) -> Level {
    let held = u64::try_from((excess + i128::from(MILLI)).max(0)).unwrap_or(u64::MAX);
    super::mirror(held, rate, now_ms)
}

/// Whether Redis answered for the key within `FRESH_MS`.
pub fn fresh(e: &Entry, now_ms: u64) -> bool {
    e.blocked_limit != 0 && u64::from((now_ms as u32).wrapping_sub(e.blocked_limit)) <= FRESH_MS
}

/// What this node owes Redis of the key (thousandths).
pub fn owed(e: &Entry) -> u64 {
    u64::from(e.prev)
}

/// The most this node may owe Redis of a bucket of `burst` before its
/// requests are decided by Redis (thousandths), `nodes` counting through
/// the zone's Redis.
fn allowance(e: &Entry, rate: Rate, burst: u32, nodes: u32, now_ms: u64) -> u64 {
    let k = before(Some(known(e, now_ms)), rate, now_ms).max(0);
    let half = (i128::from(burst) + 1) * i128::from(MILLI) / 2;
    let room = u64::try_from((half - k).max(0)).unwrap_or(0);
    room / (2 * u64::from(nodes.max(1)))
}

/// Whether a request of `cost` checked on this node's view (`c`) may be
/// decided here: Redis answered lately and what the node owes with the
/// request stays within its allowance.
pub fn local(
    e: &Entry,
    rate: Rate,
    burst: u32,
    c: &Checked,
    cost: u32,
    nodes: u32,
    now_ms: u64,
) -> bool {
    c.allowed
        && fresh(e, now_ms)
        && owed(e) + u64::from(cost) * MILLI <= allowance(e, rate, burst, nodes, now_ms)
}

/// A request of `cost` decided here: the node owes it. What it owes is
/// taken to be sent now (`take`) if it is half its allowance or more, at
/// least a request; 0 when it waits for more.
pub fn owe(e: &mut Entry, rate: Rate, burst: u32, cost: u32, nodes: u32, now_ms: u64) -> u64 {
    e.prev = e.prev.saturating_add(cost.saturating_mul(MILLI as u32));
    if owed(e) < MILLI.max(allowance(e, rate, burst, nodes, now_ms) / 2) {
        return 0;
    }
    take(e, rate, now_ms)
}

/// What the node owes, taken to be sent (ahead of a request that asks
/// Redis, or on its own): the known level grows by it.
pub fn take(e: &mut Entry, rate: Rate, now_ms: u64) -> u64 {
    let debt = std::mem::take(&mut e.prev);
    if debt > 0 {
        let k = before(Some(known(e, now_ms)), rate, now_ms) + i128::from(debt);
        set_known(e, level_at(k, rate, now_ms));
    }
    u64::from(debt)
}

/// Redis answered the key's level (`held`: its excess plus a request):
/// the view is that plus what this node still owes, the known level that.
pub fn answered(e: &mut Entry, held: u64, rate: Rate, now_ms: u64) {
    let redis = super::mirror(held, rate, now_ms);
    let view = before(Some(redis), rate, now_ms) + i128::from(owed(e));
    super::store(e, level_at(view, rate, now_ms));
    set_known(e, redis);
    e.blocked_limit = (now_ms as u32).max(1);
}

/// What the node sent (`milli`) did not reach Redis (no answer, an error
/// reply): it is owed again.
pub fn unanswered(e: &mut Entry, milli: u64, rate: Rate, now_ms: u64) {
    e.prev = e.prev.saturating_add(u32::try_from(milli).unwrap_or(u32::MAX));
    let k = before(Some(known(e, now_ms)), rate, now_ms) - i128::from(milli);
    set_known(e, level_at(k, rate, now_ms));
}

#[cfg(test)]
#[path = "bucket_fleet_tests.rs"]
mod tests;
