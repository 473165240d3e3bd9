//! Keys near their limit are read again once after each flush that
//! counted them, shortly before their next request is expected, so that a
//! node's next decision sees what the other nodes counted meanwhile; within
//! a budget of Redis commands per second per zone and worker.

use std::time::{Duration, Instant};

use super::flush::PIPELINE_ITEMS;
use super::{Backend, Event};
use crate::batch::Item;
use crate::counter::Confirmation;

/// A key near its limit is read again this long after its last flush, once
/// per flush, so a node learns what the others counted.
pub const REFRESH_AFTER: Duration = Duration::from_millis(10);
/// Redis commands per second the refreshes of one zone may spend, per
/// worker, whatever the keys.
pub const REFRESH_BUDGET: u32 = 200;
/// Most keys waiting for a refresh, per zone and worker.
pub(super) const WATCH_MAX: usize = 4096;

/// A key near its limit that this worker counts: read again once after
/// each flush that counted it, shortly before its next request is expected
/// (three quarters of the gap between its last two flushes, at least
/// `REFRESH_AFTER`), so that the next decision sees what the other nodes
/// counted meanwhile. At most one refresh per counted flush, within the
/// zone's budget.
pub(super) struct Watch {
    pub(super) tag: Box<[u8]>,
    pub(super) period: u32,
    pub(super) limit: u32,
    pub(super) window: u64,
    /// The last flush that counted the key.
    pub(super) last: Instant,
    /// When to read it again, if a refresh is owed.
    pub(super) due: Option<Instant>,
}

/// Forgotten after this long without a counted flush.
const WATCH_IDLE: Duration = Duration::from_secs(10);

/// When a key flushed now, after `gap` since its previous flush, is read
/// again.
pub(super) fn refresh_due(now: Instant, gap: Option<Duration>) -> Instant {
    let wait = gap.map_or(REFRESH_AFTER, |g| (g * 3 / 4).clamp(REFRESH_AFTER, WATCH_IDLE));
    now + wait
}

impl Backend {
    /// Reads the keys whose refresh is due (once each), within the budget.
    pub(super) fn refresh(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        self.watch
            .retain(|_, w| w.due.is_some() || now.saturating_duration_since(w.last) < WATCH_IDLE);
        let mut items = Vec::new();
        for (wid, w) in self.watch.iter_mut() {
            if w.due.is_none_or(|d| d > now) {
                continue;
            }
            w.due = None;
            let mut id = *wid;
            id.window = w.window;
            let cost = if self.prev.get(&id).is_some_and(|s| s.settled) { 1 } else { 2 };
            if !self.budget.take(cost, now) {
                continue;
            }
            items.push((id, Item { tag: w.tag.clone(), period: w.period, limit: w.limit, n: 0 }));
        }
        for chunk in items.chunks(PIPELINE_ITEMS) {
            if !self.health.is_up() {
                break;
            }
            self.send_chunk(chunk, None, None, events);
        }
    }
}

/// Whether counts put a key at or above half its limit.
pub(super) fn near_limit(c: &Confirmation, period: u32, limit: u32, now_ms: u64) -> bool {
    let p = u64::from(period) * 1000;
    let idx = crate::window::window_index(now_ms, p);
    let prev = c.prev.unwrap_or(0);
    let (prev, cur) = if idx == c.window {
        (prev, c.cur)
    } else if idx == c.window + 1 {
        (c.cur, 0)
    } else {
        return false;
    };
    let clamp = |v: u64| v.min(u64::from(u32::MAX)) as u32;
    let est =
        crate::window::Estimate::new(clamp(prev), clamp(cur), now_ms.saturating_sub(idx * p), p);
    !est.below(limit.div_ceil(2))
}
