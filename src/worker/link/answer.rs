//! A strict link's answers: each call's reply cut into its keys' answers
//! and applied, or its keys handed to the thread; a reset's `DEL` (a call
//! of no key) taken out in its turn.

use ratelimit_core::resp::Value;
use ratelimit_core::stats::Stats;
use ratelimit_core::strict::{Answers, Outcome};

use super::{Link, Reply, LOST};
use crate::backend::{Level, StrictAsk};
use crate::worker::reply::{main_conf, strict_answered, zone_log, zone_stats, Decided};
use crate::worker::time::{mono_us, now_ms};

impl Link {
    /// Applies the answer to the oldest call out; the error reply that
    /// drops the link, if it is one.
    pub(super) fn answer(&mut self, v: Reply) -> Option<String> {
        // the call's groups and requests (what its answer holds)
        let (n, requests) =
            self.calls.oldest().fold((0, 0), |(n, r), g| (n + 1, r + g.requests.len()));
        let (ch, log, zone) = (self.channel(), self.log(), self.zone);
        let Some(mcf) = main_conf() else {
            // not a worker of a loaded configuration (cannot happen while
            // a link lives): the call is taken out all the same
            self.calls.answered(|_| {});
            return None;
        };
        let ints: &[i64] = match &v {
            Reply::Ints(ints) => ints,
            Reply::Other(e @ Value::Error(text)) => {
                // it did not run: the thread deals with it as with its own
                let mut asks: Vec<StrictAsk> = Vec::new();
                let sent_at = self.calls.answered(|g| asks.extend(g.take_asks()))?;
                self.answered_at(mcf, sent_at);
                if let Some(ch) = ch {
                    self.hand_over(ch, asks);
                }
                if n == 0 {
                    // a reset's `DEL` (`link::reset`): the key keeps its counts
                    let name = mcf.zones.get(zone).map_or("", |z| z.name.as_str());
                    let text: String = text.chars().take(200).collect();
                    let message =
                        format!("redis_ratelimit: zone \"{name}\": a key's reset failed: {text}");
                    zone_log(mcf, log, zone as u32, Level::Error, &message);
                }
                let lost = LOST.contains(&e.error_code().unwrap_or_default());
                return lost.then(|| text.chars().take(200).collect());
            }
            // not an array of integers: `Bad` for every group
            Reply::Other(_) => &[],
        };
        let stats = zone_stats(mcf, zone);
        let mut answers = Answers::new(ints, n, requests);
        let (mut alone, mut bad) = (Vec::new(), false);
        let sent_at = self.calls.answered(|g| {
            let answer = match answers.next(g.requests.len()) {
                Outcome::Answer(a) => {
                    if let Some(st) = stats {
                        st.synced(now_ms());
                    }
                    Some(a)
                }
                Outcome::Alone => {
                    // nothing counted: called again alone, through the
                    // thread, which gets its error
                    alone.extend(g.take_asks());
                    return;
                }
                Outcome::Bad => {
                    if let Some(st) = stats {
                        Stats::bump(&st.errors_reply);
                    }
                    bad = true;
                    None
                }
            };
            strict_answered(mcf, log, Decided::of(g), g.tickets(), g.counted(), answer.as_ref());
        })?;
        self.answered_at(mcf, sent_at);
        if bad {
            // once per call, however many of its keys it failed
            let name = mcf.zones.get(zone).map_or("", |z| z.name.as_str());
            let message = format!(
                "redis_ratelimit: zone \"{name}\": the strict script's answer is not what it should be"
            );
            zone_log(mcf, log, zone as u32, Level::Error, &message);
        }
        if let Some(ch) = ch {
            self.hand_over(ch, alone);
        }
        None
    }

    /// The oldest call out, written at `sent_at` (`mono_us`), was
    /// answered now: the link's last answer, the zone's round trip.
    fn answered_at(&mut self, mcf: &crate::conf::MainConf, sent_at: u64) {
        let now_us = mono_us();
        self.answered_us = now_us;
        if let Some(st) = zone_stats(mcf, self.zone) {
            st.pipeline(1, now_us.saturating_sub(sent_at));
        }
    }
}
