//! The C ABI that `lua/resty/redis_ratelimit.lua` binds with LuaJIT's FFI.
//! nginx loads modules with `RTLD_GLOBAL`, so `ffi.C` finds these symbols.
//! Callers run on a worker's main thread (Lua handlers and timers), like the
//! request path, and share its zones, breaker, counters and background
//! thread. Every function checks its pointers and never panics.

use std::ffi::c_int;

use nginx_sys::{ngx_cycle, ngx_process, ngx_uint_t, NGX_PROCESS_SINGLE, NGX_PROCESS_WORKER};
use ngx::http::HttpModuleMainConf;
use ratelimit_core::bucket::{self, Bucket, Delay, MAX_BURST};
use ratelimit_core::key::MAX_NAMESPACE_BYTES;
use ratelimit_core::rate::Rate;

use crate::conf::module::Module;
use crate::conf::{MainConf, ZoneConf, MAX_COST};
use crate::engine::controls;
use crate::engine::{self, Ask, Strict, Take, NO_LINE};
use crate::worker::time::now_ms;

pub const OK: c_int = 0;
pub const LIMITED: c_int = 1;
/// The zone is not usable (unknown index, or its memory is not mapped).
pub const ERR_ZONE: c_int = -1;
/// Empty key or invalid arguments.
pub const ERR_ARGS: c_int = -2;

/// `take` values: 0 (`is_rate_limited`) counts the request only if it is
/// allowed; `TAKE_ALWAYS` (`measure`) counts it whatever the estimate.
pub const TAKE_ALWAYS: c_int = 1;

/// The zone is declared but cannot be used from here: outside a worker
/// (`init_by_lua*` runs in the master, while the configuration is read).
pub const ERR_NOT_READY: c_int = -3;

/// The configuration of the running cycle, in a worker process (or nginx
/// without a master) only. `init_by_lua*` runs while the configuration is
/// being read, in the master on a reload (refused here) and before the
/// zones' shared memory exists (refused by the callers): nothing is
/// answered there.
pub(super) fn main_conf() -> Option<&'static MainConf> {
    // SAFETY: plain reads of nginx globals, on the thread nginx runs Lua on.
    let (process, cycle) = unsafe { (ngx_process, ngx_cycle) };
    if process != NGX_PROCESS_WORKER as ngx_uint_t && process != NGX_PROCESS_SINGLE as ngx_uint_t {
        return None;
    }
    // SAFETY: checked for null; the cycle lives while Lua code runs in it.
    let cycle = unsafe { cycle.as_ref()? };
    if cycle.conf_ctx.is_null() {
        return None;
    }
    Module::main_conf(cycle)
}

/// Starts this worker's Redis thread if no `init_process` did yet.
pub(super) fn worker_started() {
    // SAFETY: plain reads of nginx globals, on the worker's main thread.
    let (process, cycle) = unsafe { (ngx_process, ngx_cycle) };
    if process == NGX_PROCESS_WORKER as ngx_uint_t && !cycle.is_null() {
        // SAFETY: the worker's cycle, on its main thread.
        unsafe { crate::worker::process::start(cycle) };
    }
}

/// # Safety
/// `ptr` must be null or point at `len` readable bytes.
pub(super) unsafe fn bytes<'a>(ptr: *const u8, len: usize) -> Option<&'a [u8]> {
    if ptr.is_null() {
        return if len == 0 { Some(&[]) } else { None };
    }
    // SAFETY: per the function's contract.
    Some(unsafe { std::slice::from_raw_parts(ptr, len) })
}

/// What every per-key call checks first: its bytes, the period, the zone.
struct Call<'a> {
    mcf: &'a MainConf,
    index: usize,
    zone: &'a ZoneConf,
    ns: &'a [u8],
    key: &'a [u8],
}

impl<'a> Call<'a> {
    /// The namespace and the key come as (pointer, length) pairs.
    ///
    /// # Safety
    /// Pointers must be valid for their lengths.
    unsafe fn new(
        zone: c_int,
        (ns_ptr, ns_len): (*const u8, usize),
        period: u32,
        (key_ptr, key_len): (*const u8, usize),
    ) -> Result<Call<'a>, c_int> {
        // SAFETY: per the function's contract.
        let (Some(ns), Some(key)) =
            (unsafe { bytes(ns_ptr, ns_len) }, unsafe { bytes(key_ptr, key_len) })
        else {
            return Err(ERR_ARGS);
        };
        if key.is_empty()
            || ns.is_empty()
            || ns.len() > MAX_NAMESPACE_BYTES
            || !matches!(period, 1 | 60 | 3600 | 86400)
        {
            return Err(ERR_ARGS);
        }
        let mcf = main_conf().ok_or(ERR_ZONE)?;
        let index = usize::try_from(zone).map_err(|_| ERR_ZONE)?;
        let z = mcf.zones.get(index).ok_or(ERR_ZONE)?;
        // declared, but its shared memory is not set up yet (init_by_lua*)
        z.shared.as_ref().ok_or(ERR_NOT_READY)?;
        Ok(Call { mcf, index, zone: z, ns, key })
    }
}

/// Index of the zone declared with `redis_ratelimit_zone ... zone=<name>:...`,
/// or -1.
///
/// # Safety
/// `name` must point at `len` readable bytes.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_zone_index(name: *const u8, len: usize) -> c_int {
    // SAFETY: per the function's contract.
    let Some(name) = (unsafe { bytes(name, len) }) else {
        return ERR_ARGS;
    };
    let Some(mcf) = main_conf() else {
        return ERR_NOT_READY;
    };
    match mcf.zones.iter().position(|z| z.declared && z.name.as_bytes() == name) {
        // init_by_lua* runs while the configuration is read, before the
        // zones' shared memory exists (lua-nginx-module points `ngx_cycle`
        // at the cycle being built)
        Some(i) if mcf.zones[i].shared.is_none() => ERR_NOT_READY,
        Some(i) => i as c_int,
        None => ERR_ZONE,
    }
}

/// Parses `N r/s|m|h|d` into a limit and a period in seconds.
///
/// # Safety
/// `s` must point at `len` readable bytes; `limit` and `period` must be
/// valid for writes.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_parse_rate(
    s: *const u8,
    len: usize,
    limit: *mut u32,
    period: *mut u32,
) -> c_int {
    // SAFETY: per the function's contract.
    let Some(s) = (unsafe { bytes(s, len) }) else {
        return ERR_ARGS;
    };
    if limit.is_null() || period.is_null() {
        return ERR_ARGS;
    }
    match Rate::parse(s) {
        Ok(r) => {
            // SAFETY: checked non-null; the caller provides the storage.
            unsafe {
                *limit = r.limit;
                *period = r.period;
            }
            OK
        }
        Err(_) => ERR_ARGS,
    }
}

/// Decides one request for `key` under `limit` per `period` seconds in the
/// zone, with `namespace` in place of the zone name (Redis key and table
/// identity), the request weighing `cost` (0 to 1000000; 0 checks without
/// counting). Returns `OK` (allowed), `LIMITED`, or a negative error. Writes
/// the estimate (after counting), the requests left, and when limited the
/// milliseconds until a request is allowed again.
///
/// # Safety
/// Pointers must be valid for their lengths; the out-pointers may be null.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_take(
    zone: c_int,
    namespace: *const u8,
    namespace_len: usize,
    limit: u32,
    period: u32,
    key: *const u8,
    key_len: usize,
    take: c_int,
    cost: u32,
    estimate: *mut f64,
    remaining: *mut u32,
    retry_ms: *mut u64,
) -> c_int {
    // SAFETY: per the function's contract.
    let call = match unsafe { Call::new(zone, (namespace, namespace_len), period, (key, key_len)) }
    {
        Ok(c) => c,
        Err(rc) => return rc,
    };
    let rate = Rate { limit, period };
    let (d, now) = match decide(call, rate, take, cost, None) {
        Ok(d) => d,
        Err(rc) => return rc,
    };
    let after = d.checked.after;
    // SAFETY: out-pointers are checked for null; the caller owns them.
    unsafe {
        if !estimate.is_null() {
            *estimate = after.value();
        }
        if !remaining.is_null() {
            *remaining = if d.allowed { after.remaining(limit) } else { 0 };
        }
        if !retry_ms.is_null() {
            *retry_ms = if d.allowed { 0 } else { d.retry_at_ms.saturating_sub(now) };
        }
    }
    if d.allowed {
        OK
    } else {
        LIMITED
    }
}

/// `delay` of `ngx_http_redis_ratelimit_take_bucket` for `nodelay`.
pub const NODELAY: u32 = u32::MAX;

/// What `ngx_http_redis_ratelimit_take_bucket` answers besides its return
/// value.
#[repr(C)]
pub struct BucketAnswer {
    /// The bucket's excess after the request, in requests.
    pub excess: f64,
    /// Requests left in the burst after this one (0 when limited).
    pub remaining: u32,
    /// When limited: ms until a request would pass without waiting.
    pub retry_ms: u64,
    /// When allowed: ms the caller waits before going on (`delay=`).
    pub delay_ms: u64,
}

/// `ngx_http_redis_ratelimit_take` for limit_req's bucket: `burst`
/// requests (0 to 1000000) and `delay` (at most `burst`, or `NODELAY`).
/// On a zone with Redis the fleet's bucket, decided on this node's view
/// (a Lua caller does not wait), what it owes sent to Redis in batches.
///
/// # Safety
/// Pointers must be valid for their lengths; `out` may be null.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_take_bucket(
    zone: c_int,
    namespace: *const u8,
    namespace_len: usize,
    limit: u32,
    period: u32,
    key: *const u8,
    key_len: usize,
    take: c_int,
    cost: u32,
    burst: u32,
    delay: u32,
    out: *mut BucketAnswer,
) -> c_int {
    // SAFETY: per the function's contract.
    let call = match unsafe { Call::new(zone, (namespace, namespace_len), period, (key, key_len)) }
    {
        Ok(c) => c,
        Err(rc) => return rc,
    };
    let rate = Rate { limit, period };
    let delay = match delay {
        NODELAY => Delay::Never,
        d if d <= burst => Delay::Above(d),
        _ => return ERR_ARGS,
    };
    if burst > MAX_BURST || bucket::id_period(rate).is_none() {
        return ERR_ARGS;
    }
    let b = Bucket { burst, delay };
    let (d, now) = match decide(call, rate, take, cost, Some(b)) {
        Ok(d) => d,
        Err(rc) => return rc,
    };
    let c = d.checked.bucket;
    if !out.is_null() {
        // SAFETY: checked for null; the caller owns it.
        unsafe {
            *out = BucketAnswer {
                excess: c.map_or(0.0, |c| c.excess as f64 / bucket::MILLI as f64),
                remaining: match c {
                    Some(c) if d.allowed => c.remaining(&b),
                    _ => 0,
                },
                retry_ms: if d.allowed { 0 } else { d.retry_at_ms.saturating_sub(now) },
                delay_ms: if d.allowed { d.delay_ms } else { 0 },
            };
        }
    }
    if d.allowed {
        OK
    } else {
        LIMITED
    }
}

/// The decision for a Lua caller's request, and when it was made.
fn decide(
    call: Call<'_>,
    rate: Rate,
    take: c_int,
    cost: u32,
    bucket: Option<Bucket>,
) -> Result<(engine::Decision, u64), c_int> {
    if rate.limit == 0 || cost > MAX_COST {
        return Err(ERR_ARGS);
    }
    // counts made before this module's `init_process` (Lua's
    // `init_worker_by_lua*`) go to Redis too: the thread starts now
    worker_started();
    let Call { mcf, index, ns, key, .. } = call;
    let now = now_ms();
    // the zone's controls of the key: a block rejects, an override is the
    // rate
    let said = controls::look(mcf, index, key, now);
    if let Some(until) = said.blocked {
        return Ok((engine::Decision::blocked(0, rate, until), now));
    }
    let rate = said.rate.unwrap_or(rate);
    let how = if take == TAKE_ALWAYS { Take::Always } else { Take::IfAllowed };
    // a limit the directive has Redis decide is decided here (a Lua caller
    // does not wait), and counted down the strict link, ahead of the
    // worker's next strict check of the key (`Strict::CountOnly`)
    let strict = if engine::in_redis(mcf, index, rate, bucket.is_some()) {
        Strict::CountOnly
    } else {
        Strict::Background
    };
    let ask = Ask {
        zone: index,
        namespace: ns,
        zone_named: false,
        key,
        rate,
        cost,
        strict,
        line: NO_LINE,
        bucket,
    };
    // SAFETY: `ngx_cycle` is the running cycle (checked by `Call::new`).
    let log = unsafe { (*ngx_cycle).log };
    let d = engine::decide(mcf, &[ask], now, how, log).map_err(|_| ERR_ZONE)?;
    Ok((d, now))
}

/// Forgets `key` (for the period) in this node's zone and in Redis.
///
/// # Safety
/// Pointers must be valid for their lengths.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_reset(
    zone: c_int,
    namespace: *const u8,
    namespace_len: usize,
    period: u32,
    key: *const u8,
    key_len: usize,
) -> c_int {
    // SAFETY: per the function's contract.
    match unsafe { Call::new(zone, (namespace, namespace_len), period, (key, key_len)) } {
        Ok(call) => reset(call, period, None),
        Err(rc) => rc,
    }
}

/// Forgets `key`'s bucket of `limit` per `period` seconds (a bucket
/// limiter's `reset`) in this node's zone and in Redis.
///
/// # Safety
/// Pointers must be valid for their lengths.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_reset_bucket(
    zone: c_int,
    namespace: *const u8,
    namespace_len: usize,
    limit: u32,
    period: u32,
    key: *const u8,
    key_len: usize,
) -> c_int {
    // SAFETY: per the function's contract.
    match unsafe { Call::new(zone, (namespace, namespace_len), period, (key, key_len)) } {
        Ok(call) => reset(call, period, Some(limit)),
        Err(rc) => rc,
    }
}

/// Forgets a key's windows of `period`, or its bucket of `bucket`
/// requests per period: its entry here, its keys in Redis.
fn reset(call: Call<'_>, period: u32, bucket: Option<u32>) -> c_int {
    let Call { mcf, index, zone: z, ns, key, .. } = call;
    if z.params.as_ref().is_some_and(|p| p.backend.is_some()) {
        worker_started();
    }
    engine::reset(mcf, index, ns, key, period, bucket);
    OK
}
