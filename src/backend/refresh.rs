//! Keys near their limit are read again once after each flush that
//! counted them, shortly before their next request is expected, so that a
//! node's next decision sees what the other nodes counted meanwhile; within
//! a budget of Redis commands per second per zone and worker.

use ratelimit_core::key::EntryId;
use std::time::{Duration, Instant};

use ratelimit_core::batch::{Item, ItemId, ItemMap};
use ratelimit_core::counter::{Confirmation, Fresh};
use ratelimit_core::health::Budget;

/// A key near its limit is read again this long after its last flush, once
/// per flush, so a node learns what the others counted.
pub const REFRESH_AFTER: Duration = Duration::from_millis(10);
/// Forgotten after this long without a counted flush.
const WATCH_IDLE: Duration = Duration::from_secs(10);
/// Redis commands per second the refreshes of one zone may spend, per
/// worker, whatever the keys.
pub const REFRESH_BUDGET: u32 = 200;
/// Most keys waiting for a refresh, per zone and worker.
const WATCH_MAX: usize = 4096;

/// A key near its limit that this worker counts: read again once after
/// each flush that counted it, shortly before its next request is expected
/// (three quarters of the gap between its last two flushes, at least
/// `REFRESH_AFTER`), so that the next decision sees what the other nodes
/// counted meanwhile. At most one refresh per counted flush, within the
/// zone's budget.
struct Watch {
    tag: Box<[u8]>,
    period: u32,
    limit: u32,
    window: u64,
    /// The last flush that counted the key.
    last: Instant,
    /// When to read it again, if a refresh is owed.
    due: Option<Instant>,
}

/// The keys near their limit, by entry (window 0).
pub(super) struct Watches {
    keys: ItemMap<Watch>,
    budget: Budget,
}

impl Watches {
    pub(super) fn new(now: Instant) -> Watches {
        Watches { keys: ItemMap::default(), budget: Budget::new(REFRESH_BUDGET, now) }
    }

    /// When the next refresh is due, if one is owed.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.keys.values().filter_map(|w| w.due).min()
    }

    /// Forgets one entry (its key was reset).
    pub(super) fn forget(&mut self, entry: EntryId) {
        self.keys.retain(|id, _| id.entry != entry);
    }

    /// A confirmed count of `item`: a key near its limit is read again
    /// once, shortly before its next flush is expected.
    pub(super) fn counted(
        &mut self,
        id: ItemId,
        item: &Item,
        c: &Confirmation,
        now: Instant,
        now_ms: u64,
    ) {
        if item.total() == 0 || !near_limit(c, item.period, item.limit, now_ms) {
            return;
        }
        let mut wid = id;
        wid.window = 0;
        if let Some(w) = self.keys.get_mut(&wid) {
            w.due = Some(refresh_due(now, Some(now.saturating_duration_since(w.last))));
            w.last = now;
            w.window = id.window;
            w.limit = item.limit;
        } else if self.keys.len() < WATCH_MAX {
            self.keys.insert(
                wid,
                Watch {
                    tag: item.tag.clone(),
                    period: item.period,
                    limit: item.limit,
                    window: id.window,
                    last: now,
                    due: Some(refresh_due(now, None)),
                },
            );
        }
    }

    /// The keys whose refresh is due (once each), within the budget, as
    /// items that count nothing; `settled` says whether a key's previous
    /// window is final (its read costs one command, else two).
    pub(super) fn due(&mut self, settled: impl Fn(&ItemId) -> bool) -> Vec<(ItemId, Item)> {
        let now = Instant::now();
        self.keys
            .retain(|_, w| w.due.is_some() || now.saturating_duration_since(w.last) < WATCH_IDLE);
        let mut items = Vec::new();
        for (wid, w) in self.keys.iter_mut() {
            if w.due.is_none_or(|d| d > now) {
                continue;
            }
            w.due = None;
            let mut id = *wid;
            id.window = w.window;
            let cost = if settled(&id) { 1 } else { 2 };
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
        items
    }
}

/// When a key flushed now, after `gap` since its previous flush, is read
/// again.
fn refresh_due(now: Instant, gap: Option<Duration>) -> Instant {
    let wait = gap.map_or(REFRESH_AFTER, |g| (g * 3 / 4).clamp(REFRESH_AFTER, WATCH_IDLE));
    now + wait
}

/// Whether counts put a key at or above half its limit.
fn near_limit(c: &Confirmation, period: u32, limit: u32, now_ms: u64) -> bool {
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
