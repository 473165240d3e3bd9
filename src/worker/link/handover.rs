//! Asks a link hands to the thread (made before the link was there, or
//! after a call failed on it), counted until the thread answers them:
//! meanwhile the zone's new asks follow them (`Link::thread_first`).

use super::{made, Link};
use crate::backend::{Channel, StrictAsk};
use crate::worker::time::mono_ms;

/// The thread answered `asks` of `zone` (an `Event::Strict`).
pub fn thread_answered(zone: usize, asks: usize) {
    if let Some(l) = made(zone) {
        // SAFETY: links live for the worker's life; this thread only.
        let link = unsafe { &mut *l };
        link.handed.answered(asks);
    }
}

impl Link {
    /// Hands asks to the thread (counted: `thread_first`).
    pub(super) fn hand_over(&mut self, ch: &Channel, asks: Vec<StrictAsk>) {
        if !asks.is_empty() {
            self.handed.note(asks.len(), mono_ms());
            ch.push_strict(asks);
        }
    }

    /// Whether new asks go through the thread although the link is up:
    /// asks handed to it earlier are not answered yet (those written down
    /// the link now could reach Redis first: a count made before a check
    /// would miss it). The thread answers every ask within a few of the
    /// zone's `timeout=`; past that the rest are taken as lost, and the
    /// link is used again.
    #[inline]
    pub(super) fn thread_first(&mut self) -> bool {
        self.handed.first(mono_ms(), 2 * self.timeout_ms + 1000)
    }
}
