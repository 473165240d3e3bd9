//! A zone's controls as the worker changes and reads them: a change (the
//! API's, Lua's, a `block=` line's) is in force on this node at once and,
//! on a zone with Redis, handed to the thread to write; what the node's
//! sender read of Redis is applied to the zone's table, and what Redis
//! still lacks of this node's changes is handed again
//! (`ratelimit_core::control`).

use nginx_sys::{ngx_log_t, NGX_LOG_WARN};
use ngx::ngx_log_error;
use ratelimit_core::control::{key_form, Change, Full, Held, Kind};

use crate::conf::{MainConf, ZoneConf};
use crate::shm::Shared;
use crate::worker::channel::channel;

/// A change asked of a zone's controls.
#[derive(Clone, Copy, Debug)]
pub enum Asked {
    /// Set `kind` for `ttl_ms`.
    Set(Kind, u64),
    /// Lift `kind`.
    Lift(Kind),
}

/// Makes a change to the controls of `key` (the request's key bytes) in
/// zone `zone` at `now`: in force here at once, in Redis soon on a zone
/// with Redis. `Ok(false)`: a lift of what was not in force.
pub fn change(
    mcf: &MainConf,
    zone: usize,
    key: &[u8],
    asked: Asked,
    now: u64,
) -> Result<bool, Full> {
    let Some((z, shared)) = zone_of(mcf, zone) else {
        return Err(Full);
    };
    let part = key_form(key);
    let id = shared.control_id(&part);
    let fleet = has_redis(z);
    let (changed, left) = {
        let mut locked = shared.lock();
        match asked {
            Asked::Set(kind, ttl) => {
                let until = now.saturating_add(ttl);
                locked.controls().set(id, &part, kind, until, fleet, now)?;
                (true, Some(ttl))
            }
            Asked::Lift(kind) => (locked.controls().clear(id, &part, kind, fleet, now), None),
        }
    };
    if fleet {
        let kind = match asked {
            Asked::Set(k, _) | Asked::Lift(k) => k,
        };
        if let Some(ch) = channel() {
            ch.push_control(zone, Change { key: part.into_owned(), kind, left_ms: left });
        }
    }
    Ok(changed)
}

/// The node's sender read the zone's controls: the table becomes what
/// Redis holds (when it moved), and this node's changes Redis does not
/// have are handed to the thread again. Redis without a version while
/// this node holds controls lost them (a restart without its data): the
/// node writes back what it holds.
/// Controls of the fleet's the zone has no room for are said at `warn`
/// (at most once a second per zone).
pub(super) fn read(
    mcf: &MainConf,
    log: *mut ngx_log_t,
    zone: usize,
    version: u64,
    held: Option<Vec<Held>>,
    now: u64,
) {
    let Some((z, shared)) = zone_of(mcf, zone) else {
        return;
    };
    let (unwritten, dropped) = {
        let mut locked = shared.lock();
        let mut dropped = 0;
        if let Some(held) = held {
            if version == 0 {
                locked.controls().rewrite_all(now);
            }
            let held: Vec<_> = held.into_iter().map(|h| (shared.control_id(&h.key), h)).collect();
            dropped = locked.controls().apply(&held, version, now);
            if dropped > 0 && !locked.table.claim_log(true, now / 1000) {
                dropped = 0;
            }
        } else {
            locked.controls().read_at(now);
        }
        (locked.controls().unwritten(now), dropped)
    };
    if dropped > 0 {
        ngx_log_error!(
            NGX_LOG_WARN,
            log,
            "redis_ratelimit: zone \"{}\": {} of the fleet's blocked or overridden keys do not fit in this node's zone: they are not in force here (a larger zone holds more)",
            z.name,
            dropped
        );
    }
    if let Some(ch) = channel() {
        for c in unwritten {
            ch.push_control(zone, c);
        }
    }
}

/// Redis took this node's change of `key`'s `kind` as `version`.
pub(super) fn written(mcf: &MainConf, zone: usize, key: &[u8], kind: Kind, version: u64) {
    if let Some((_, shared)) = zone_of(mcf, zone) {
        let id = shared.control_id(key);
        shared.lock().controls().written(id, kind, version);
    }
}

fn zone_of(mcf: &MainConf, zone: usize) -> Option<(&ZoneConf, &Shared)> {
    let z = mcf.zones.get(zone)?;
    Some((z, z.shared.as_ref()?))
}

fn has_redis(z: &ZoneConf) -> bool {
    z.params.as_ref().is_some_and(|p| p.backend.is_some())
}
