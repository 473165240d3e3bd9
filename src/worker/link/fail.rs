//! How a strict link ends: dropped after a failure, or closed by Redis
//! while idle.

use std::ptr;

use nginx_sys::ngx_close_connection;
use ratelimit_core::stats::Stats;

use super::Link;
use crate::backend::{Level, StrictAsk, StrictGroup};
use ratelimit_core::strict::Answer;

use crate::worker::reply::{main_conf, strict_answered, zone_log, zone_stats, Decided};

/// Why a link is dropped.
enum Drop<'a> {
    /// Redis closed it while nothing was out.
    Idle,
    /// Closed, unreadable, no answer within `timeout=`.
    Failed { why: &'a str, timed_out: bool },
}

impl Link {
    /// Redis closed the link while nothing was out (its `timeout`
    /// setting): not a failure (`Drop::Idle`).
    pub(super) fn closed_idle(&mut self) {
        self.drop_link(Drop::Idle);
    }

    /// Drops the connection: calls out get no answer, what waits goes to
    /// the thread, which checks the backend.
    pub(super) fn fail(&mut self, why: &str, timed_out: bool) {
        self.drop_link(Drop::Failed { why, timed_out });
    }

    /// Drops the connection (see `fail`). A link that Redis closed while
    /// nothing was out (`Drop::Idle`: its `timeout` setting) is not an
    /// error: no transport error is counted, the line is at `info`.
    fn drop_link(&mut self, how: Drop<'_>) {
        let timed_out = matches!(how, Drop::Failed { timed_out: true, .. });
        if self.c.is_null() {
            return;
        }
        let log = self.log();
        // SAFETY: our connection; nginx removes its events and timers.
        unsafe { ngx_close_connection(self.c) };
        self.c = ptr::null_mut();
        self.out.clear();
        self.written = 0;
        self.input.clear();
        let (flight, waiting) = self.calls.drain();
        let waiting: Vec<StrictAsk> =
            waiting.into_iter().flat_map(StrictGroup::into_asks).collect();
        let ch = self.channel();
        if let Some(ch) = ch {
            self.hand_over(ch, waiting);
            ch.link_lost(self.zone, timed_out);
        }
        let Some(mcf) = main_conf().filter(|_| ch.is_some()) else {
            for g in flight {
                crate::worker::waits::resolve(g.tickets(), |_| None, |_, _| None);
            }
            return;
        };
        let name = mcf.zones.get(self.zone).map_or("", |z| z.name.as_str());
        let Drop::Failed { why, .. } = how else {
            let message = format!(
                "redis_ratelimit: zone \"{name}\": Redis closed the strict link (its idle timeout, a restart or CLIENT KILL); a new one is made"
            );
            zone_log(mcf, log, self.zone as u32, Level::Info, &message);
            return;
        };
        if let Some(st) = zone_stats(mcf, self.zone) {
            Stats::bump(&st.errors_transport);
        }
        for g in flight {
            strict_answered(mcf, log, Decided::of(&g), g.tickets(), g.counted(), None::<&Answer>);
        }
        let message = format!(
            "redis_ratelimit: zone \"{name}\": the strict link to Redis failed: {why}; strict requests go through the background thread until a new one is made"
        );
        zone_log(mcf, log, self.zone as u32, Level::Error, &message);
    }
}
