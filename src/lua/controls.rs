//! The C ABI of a zone's controls for Lua (`block`, `unblock`, `override`,
//! `inspect` of `lua/resty/redis_ratelimit.lua`): the same changes as the
//! API's (`worker::controls`), on keys as Lua passes them.

use std::ffi::c_int;

use ratelimit_core::control::{key_form, Kind, MAX_TTL_MS};
use ratelimit_core::rate::Rate;

use super::ffi::{bytes, main_conf, worker_started, ERR_ARGS, ERR_NOT_READY, ERR_ZONE, OK};
use crate::worker::controls::{change, Asked};
use crate::worker::time::now_ms;

/// `op` of `ngx_http_redis_ratelimit_control`.
pub const BLOCK: c_int = 1;
pub const UNBLOCK: c_int = 2;
pub const OVERRIDE: c_int = 3;
pub const UNOVERRIDE: c_int = 4;

/// A lift of what was not in force.
pub const NOT_IN_FORCE: c_int = 1;
/// The zone holds no more controlled keys.
pub const ERR_FULL: c_int = -4;

/// Blocks (`BLOCK`), overrides (`OVERRIDE`: `limit` per `period` s) or
/// lifts either for the key in zone `zone`, for `ttl_ms` (1 s to 30 days)
/// when set; on every node of a zone with Redis.
///
/// # Safety
/// `key` must be valid for `key_len` bytes.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_control(
    zone: c_int,
    key: *const u8,
    key_len: usize,
    op: c_int,
    limit: u32,
    period: u32,
    ttl_ms: u64,
) -> c_int {
    // SAFETY: per the function's contract.
    let Some(key) = (unsafe { bytes(key, key_len) }).filter(|k| !k.is_empty()) else {
        return ERR_ARGS;
    };
    let Some(mcf) = main_conf() else {
        return ERR_NOT_READY;
    };
    let Some(index) = usize::try_from(zone).ok().filter(|&i| i < mcf.zones.len()) else {
        return ERR_ZONE;
    };
    if mcf.zones[index].shared.is_none() {
        return ERR_NOT_READY;
    }
    let ttl_ok = (1000..=MAX_TTL_MS).contains(&ttl_ms);
    let rate_ok = limit > 0 && matches!(period, 1 | 60 | 3600 | 86400);
    let asked = match op {
        BLOCK if ttl_ok => Asked::Set(Kind::Block, ttl_ms),
        OVERRIDE if ttl_ok && rate_ok => Asked::Set(Kind::Override(Rate { limit, period }), ttl_ms),
        UNBLOCK => Asked::Lift(Kind::Block),
        UNOVERRIDE => Asked::Lift(Kind::ANY_OVERRIDE),
        _ => return ERR_ARGS,
    };
    // the change goes to Redis through this worker's thread
    worker_started();
    match change(mcf, index, key, asked, now_ms()) {
        Ok(true) => OK,
        Ok(false) => NOT_IN_FORCE,
        Err(_) => ERR_FULL,
    }
}

/// What `ngx_http_redis_ratelimit_inspect` answers: the time left of a
/// block and of an override (0: none), and the override's rate.
#[repr(C)]
pub struct Controls {
    pub blocked_ms: u64,
    pub override_ms: u64,
    pub limit: u32,
    pub period: u32,
}

/// The controls in force on the key in zone `zone`, as this node knows
/// them.
///
/// # Safety
/// `key` must be valid for `key_len` bytes; `out` must point at a
/// `Controls`.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_inspect(
    zone: c_int,
    key: *const u8,
    key_len: usize,
    out: *mut Controls,
) -> c_int {
    // SAFETY: per the function's contract.
    let (Some(key), Some(out)) = (unsafe { bytes(key, key_len) }, unsafe { out.as_mut() }) else {
        return ERR_ARGS;
    };
    let Some(mcf) = main_conf() else {
        return ERR_NOT_READY;
    };
    let Some(shared) =
        usize::try_from(zone).ok().and_then(|i| mcf.zones.get(i)).map(|z| z.shared.as_ref())
    else {
        return ERR_ZONE;
    };
    let Some(shared) = shared else {
        return ERR_NOT_READY;
    };
    *out = Controls { blocked_ms: 0, override_ms: 0, limit: 0, period: 0 };
    let now = now_ms();
    let id = shared.control_id(&key_form(key));
    if let Some(s) = shared.lock().controls().get(id) {
        if let Some(until) = s.blocked(now) {
            out.blocked_ms = until - now;
        }
        if let Some(rate) = s.rate(now) {
            out.override_ms = s.override_until - now;
            out.limit = rate.limit;
            out.period = rate.period;
        }
    }
    OK
}
