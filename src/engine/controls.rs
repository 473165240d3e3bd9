//! What a zone's controls say of a request's key: blocked until a time,
//! or limited at another rate (`ratelimit_core::control`). Looked at only
//! while the zone has any (`Shared::has_controls`).

use ratelimit_core::control::key_form;
use ratelimit_core::rate::Rate;

use crate::conf::MainConf;
use crate::shm::Shared;

/// The controls in force on a key.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Said {
    /// Blocked until then (ms since the epoch).
    pub blocked: Option<u64>,
    /// Its zone's rate limits take this rate.
    pub rate: Option<Rate>,
}

/// Whether zone `zone` has any control (one atomic read).
#[inline(always)]
pub fn any(mcf: &MainConf, zone: usize) -> bool {
    mcf.zones.get(zone).and_then(|z| z.shared.as_ref()).is_some_and(|s| s.has_controls())
}

/// What zone `zone`'s controls say of `key` at `now` (nothing, at the
/// cost of `any`, while the zone has none).
#[inline(always)]
pub fn look(mcf: &MainConf, zone: usize, key: &[u8], now: u64) -> Said {
    match mcf.zones.get(zone).and_then(|z| z.shared.as_ref()) {
        Some(shared) if shared.has_controls() => look_up(shared, key, now),
        _ => Said::default(),
    }
}

/// The key's entry in the zone's controls.
#[inline(never)]
fn look_up(shared: &Shared, key: &[u8], now: u64) -> Said {
    let id = shared.control_id(&key_form(key));
    let mut locked = shared.lock();
    match locked.controls().get(id) {
        Some(s) => Said { blocked: s.blocked(now), rate: s.rate(now) },
        None => Said::default(),
    }
}
