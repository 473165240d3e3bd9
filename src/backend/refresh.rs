//! Keys near their limit are read again once after each flush that
//! counted them, shortly before their next request is expected, so that a
//! node's next decision sees what the other nodes counted meanwhile; within
//! a budget of Redis commands per second per zone and worker.

use ratelimit_core::batch::Item;
use ratelimit_core::counter::{Confirmation, Fresh};
use std::time::{Duration, Instant};

use super::event::Event;
use super::event::PIPELINE_ITEMS;
use super::state::Backend;

/// A key near its limit is read again this long after its last flush, once
/// per flush, so a node learns what the others counted.
pub const REFRESH_AFTER: Duration = Duration::from_millis(10);
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
            items.push((
                id,
                Item {
                    tag: w.tag.clone(),
                    period: w.period,
                    limit: w.limit,
                    n: 0,
                    carried: 0,
                    quiet: false,
                    fresh: Fresh::No,
                    due: 0,
                    room: 0,
                },
            ));
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
    let idx = ratelimit_core::window::window_index(now_ms, p);
    let prev = c.prev.unwrap_or(0);
    let (prev, cur) = if idx == c.window {
        (prev, c.cur)
    } else if idx == c.window + 1 {
        (c.cur, 0)
    } else {
        return false;
    };
    let clamp = |v: u64| v.min(u64::from(u32::MAX)) as u32;
    let est = ratelimit_core::window::Estimate::new(
        clamp(prev),
        clamp(cur),
        now_ms.saturating_sub(idx * p),
        p,
    );
    !est.below(limit.div_ceil(2))
}
