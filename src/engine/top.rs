//! A sample of the requests decided, into each zone's busiest keys
//! (`ratelimit_core::top`), for the API's `top`.

use std::cell::Cell;

use ratelimit_core::control::key_form;
use ratelimit_core::top::SAMPLE_EVERY;

use crate::conf::MainConf;
use crate::engine::Ask;

thread_local! {
    /// Requests this worker decided (one in `SAMPLE_EVERY` is sampled).
    static SEEN: Cell<u32> = const { Cell::new(0) };
}

/// Counts a decided request's keys, one request in `SAMPLE_EVERY`.
#[inline(always)]
pub fn sample(mcf: &MainConf, asks: &[Ask<'_>], now: u64) {
    let n = SEEN.with(|s| {
        let n = s.get().wrapping_add(1);
        s.set(n);
        n
    });
    if n.is_multiple_of(SAMPLE_EVERY) {
        record(mcf, asks, now);
    }
}

/// Each zone's key of the request (once per zone) into its sketch.
#[cold]
#[inline(never)]
fn record(mcf: &MainConf, asks: &[Ask<'_>], now: u64) {
    for (i, a) in asks.iter().enumerate() {
        if a.key.is_empty() || asks[..i].iter().any(|b| b.zone == a.zone) {
            continue;
        }
        if let Some(shared) = mcf.zones.get(a.zone).and_then(|z| z.shared.as_ref()) {
            shared.lock().top().record(&key_form(a.key), now);
        }
    }
}
