//! The preaccess phase handler: evaluates each zone's key, asks the engine
//! (`engine/`) for the decision on every limit of the location (strict
//! limits through `strict.rs`), and answers (`answer.rs`).

use nginx_sys::{
    ngx_http_complex_value, ngx_http_complex_value_t, ngx_http_get_flushed_variable,
    ngx_http_request_t, ngx_int_t, ngx_str_t, ngx_uint_t, ngx_variable_value_t, NGX_DECLINED,
    NGX_HTTP_INTERNAL_SERVER_ERROR, NGX_LOG_ERR, NGX_OK,
};
use ngx::http::{HttpModuleLocationConf, HttpModuleMainConf, Request};
use ngx::ngx_log_error;
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Stats;
use ratelimit_core::{cost, text};
use smallvec::SmallVec;

use crate::conf::module::Module;
use crate::conf::{Cost, Limit, LocConf, MainConf, RateSpec, Source};
use crate::engine::{self, Ask, Strict, Take};
use crate::http::answer::{ask, debug_log, finish, request_log, state};
use crate::http::Failure;
use crate::worker::time::now_ms;

/// Limits of one location, with their keys evaluated: few enough to stay
/// on the stack.
const INLINE: usize = 4;

pub unsafe extern "C" fn preaccess(r: *mut ngx_http_request_t) -> ngx_int_t {
    // SAFETY: nginx calls phase handlers with a valid request.
    let r = unsafe { &mut *r };
    // decided once per request: a request nginx has not redirected
    // internally (nor a subrequest) runs this phase once, so only those
    // look for an earlier decision
    if r.internal() != 0 && state(r).is_some() || crate::http::delay::delayed(r) {
        return NGX_DECLINED as ngx_int_t;
    }
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let Some(lcf) = Module::location_conf(req) else {
        return NGX_DECLINED as ngx_int_t;
    };
    let Some(limits) = lcf.limits.as_deref().filter(|l| !l.is_empty()) else {
        return NGX_DECLINED as ngx_int_t;
    };
    let Some(mcf) = Module::main_conf(req) else {
        return NGX_DECLINED as ngx_int_t;
    };
    match limit(r, mcf, lcf, limits) {
        Ok(rc) => rc,
        Err(why) => failed(r, why),
    }
}

/// A request that could not be limited: said in the error log, answered
/// 500.
#[cold]
#[inline(never)]
fn failed(r: &ngx_http_request_t, why: Failure) -> ngx_int_t {
    ngx_log_error!(
        NGX_LOG_ERR,
        request_log(r),
        "redis_ratelimit: the request could not be limited: {}",
        why
    );
    NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t
}

/// Evaluates the request's limits (`asks`), asks the engine, and answers;
/// a request with a limit Redis decides waits for it (`strict::limit`).
/// A location's one background limit takes `limit_one`, the same steps
/// without the lists.
fn limit(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    limits: &[Limit],
) -> Result<ngx_int_t, Failure> {
    if let [l @ Limit { strict: false, .. }] = limits {
        let Some(rate) = rate(r, mcf, l)? else {
            return Ok(NGX_DECLINED as ngx_int_t);
        };
        if !in_redis(mcf, l, rate) {
            return limit_one(r, mcf, lcf, l, rate);
        }
    }
    limit_all(r, mcf, lcf, limits)
}

/// `limit_all` for a location's one limit, which this node decides.
#[inline(always)]
fn limit_one(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    l: &Limit,
    rate: Rate,
) -> Result<ngx_int_t, Failure> {
    let key = key(r, mcf, l.zone)?;
    if key.is_empty() {
        not_limited(mcf, l.zone);
        return Ok(NGX_DECLINED as ngx_int_t);
    }
    let cost = if l.count_if.is_some() { 0 } else { cost(r, mcf, l)? };
    let asks = [ask(mcf, l, 0, key, rate, cost)];
    let now = now_ms();
    let decision = engine::decide(mcf, &asks, now, Take::IfAllowed, debug_log(r))?;
    finish(r, mcf, lcf, now, &asks, &decision)
}

/// The general path: every limit (out of line: `limit_one` stays small).
#[inline(never)]
fn limit_all(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    limits: &[Limit],
) -> Result<ngx_int_t, Failure> {
    let mut asks = asks(r, mcf, limits)?;
    if asks.is_empty() {
        return Ok(NGX_DECLINED as ngx_int_t);
    }
    if asks.iter().any(|a| a.strict != Strict::Background) {
        return crate::http::strict::limit(r, mcf, lcf, &mut asks);
    }
    let now = now_ms();
    let decision = engine::decide(mcf, &asks, now, Take::IfAllowed, debug_log(r))?;
    finish(r, mcf, lcf, now, &asks, &decision)
}

/// What the engine is asked for each line that applies: its rate (a line
/// whose rate is empty or `off` does not apply), its zone's key (evaluated
/// once per zone; an empty key is not limited) and its cost; a limit
/// Redis decides (`in_redis`) is `Strict::Asking`.
fn asks<'r>(
    r: &mut ngx_http_request_t,
    mcf: &'r MainConf,
    limits: &[Limit],
) -> Result<SmallVec<[Ask<'r>; INLINE]>, Failure> {
    let mut keys: SmallVec<[(usize, &[u8]); INLINE]> = SmallVec::new();
    let mut asks = SmallVec::new();
    for (line, l) in limits.iter().enumerate() {
        let Some(rate) = rate(r, mcf, l)? else {
            continue;
        };
        let key = match keys.iter().find(|(z, _)| *z == l.zone) {
            Some((_, k)) => *k,
            None => {
                let k = key(r, mcf, l.zone)?;
                keys.push((l.zone, k));
                if k.is_empty() {
                    not_limited(mcf, l.zone);
                }
                k
            }
        };
        if key.is_empty() {
            continue;
        }
        // a `count_if=` limit is only checked now: counted after the
        // response (`count.rs`)
        let cost = if l.count_if.is_some() { 0 } else { cost(r, mcf, l)? };
        let mut a = ask(mcf, l, line as u32, key, rate, cost);
        if in_redis(mcf, l, rate) {
            a.strict = Strict::Asking;
        }
        asks.push(a);
    }
    Ok(asks)
}

/// Whether Redis decides limit `l` at `rate`: `strict`, a small limit, or
/// a bucket on a zone with Redis.
#[inline]
pub(super) fn in_redis(mcf: &MainConf, l: &Limit, rate: Rate) -> bool {
    l.strict || engine::in_redis(mcf, l.zone, rate, l.bucket.is_some())
}

/// The rate of `l` for this request: written out, or its variables
/// evaluated now. `None`: the line does not apply (an empty value or `off`,
/// or a value that is not a rate, which is logged at most once a second per
/// zone, all workers together).
#[inline]
pub(super) fn rate(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    l: &Limit,
) -> Result<Option<Rate>, Failure> {
    match l.rate {
        RateSpec::Fixed(rate) => Ok(Some(rate)),
        RateSpec::Var(src) => rate_of(r, mcf, l, src),
    }
}

/// `rate` from variables (out of line: a fixed rate stays cheap).
#[inline(never)]
fn rate_of(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    l: &Limit,
    src: Source,
) -> Result<Option<Rate>, Failure> {
    let bytes = read(r, src)?;
    if bytes.is_empty() || bytes == b"off" {
        return Ok(None);
    }
    if let Ok(rate) = l.cache.get(bytes, Rate::parse) {
        return Ok(Some(rate));
    }
    log_bad_value(r, mcf, l, "rate", bytes, "is not valid, does not apply");
    Ok(None)
}

/// A value with variables, for this request.
pub(super) fn read<'r>(r: &mut ngx_http_request_t, src: Source) -> Result<&'r [u8], Failure> {
    match src {
        Source::Index(i) => Ok(variable(r, i)),
        Source::Complex(cv) => eval(r, cv),
    }
}

/// An indexed variable's value for this request (empty when not found).
fn variable<'r>(r: &mut ngx_http_request_t, index: ngx_uint_t) -> &'r [u8] {
    // SAFETY: the index was obtained at configuration time for this cycle;
    // the value lives as long as the request.
    let v = unsafe { ngx_http_get_flushed_variable(r, index) };
    // SAFETY: non-null values point at nginx's value for this request.
    let Some(v) = (unsafe { v.as_ref() }) else {
        return &[];
    };
    let (len, not_found) = len_and_not_found(v);
    if not_found || len == 0 || v.data.is_null() {
        return &[];
    }
    // SAFETY: `len` bytes at `data`, in the request's pool or static.
    unsafe { std::slice::from_raw_parts(v.data, len) }
}

/// A variable value's `len:28` and `not_found:1` bit fields. The generated
/// accessors take them apart a bit at a time, on every request; on a
/// little-endian target the C compiler packs them from
/// the lowest bit of the first 32-bit word (`len`, `valid`, `no_cacheable`,
/// `not_found`, `escape`), so one load and two masks read them.
#[inline(always)]
fn len_and_not_found(v: &ngx_variable_value_t) -> (usize, bool) {
    #[cfg(target_endian = "little")]
    {
        // SAFETY: the struct begins with its bit fields' 4 bytes, aligned for
        // a u32 (`_bitfield_align_1`).
        let word = unsafe { std::ptr::from_ref(v).cast::<u32>().read() };
        ((word & 0x0fff_ffff) as usize, word & (1 << 30) != 0)
    }
    #[cfg(not(target_endian = "little"))]
    {
        (v.len() as usize, v.not_found() != 0)
    }
}

/// A complex value evaluated for this request (in its pool).
fn eval<'r>(
    r: &mut ngx_http_request_t,
    cv: *mut ngx_http_complex_value_t,
) -> Result<&'r [u8], Failure> {
    let mut value = ngx_str_t::empty();
    // SAFETY: the complex value was compiled at configuration time for this
    // cycle; the result lives in the request pool.
    if unsafe { ngx_http_complex_value(r, cv, &mut value) } != NGX_OK as ngx_int_t {
        return Err(Failure::Variable);
    }
    if value.len == 0 {
        return Ok(&[]);
    }
    // SAFETY: non-empty, allocated in the request's pool, which outlives
    // the phase handler that asks for it.
    Ok(unsafe { std::slice::from_raw_parts(value.data, value.len) })
}

/// A value of a limit's variable that is not what it should be, logged at
/// most once a second per zone (all workers together).
fn log_bad_value(
    r: &ngx_http_request_t,
    mcf: &MainConf,
    l: &Limit,
    what: &str,
    bytes: &[u8],
    what_then: &str,
) {
    let zone = &mcf.zones[l.zone];
    let claimed =
        zone.shared.as_ref().is_some_and(|s| s.lock().table.claim_log(true, now_ms() / 1000));
    if claimed {
        ngx_log_error!(
            NGX_LOG_ERR,
            request_log(r),
            "redis_ratelimit: zone \"{}\": {} \"{}\" {}",
            zone.name,
            what,
            text::printable(bytes, 64),
            what_then
        );
    }
}

/// What the request weighs under `l`: its `cost=`, a variable evaluated
/// now (`ratelimit_core::cost`): empty weighs 1; digits above the maximum
/// weigh the maximum; anything else (a sign, a fraction, hex, text) weighs
/// one. Both of the latter are logged, at most once a second per zone (all
/// workers together).
#[inline]
pub(super) fn cost(r: &mut ngx_http_request_t, mcf: &MainConf, l: &Limit) -> Result<u32, Failure> {
    match l.cost {
        Cost::Fixed(c) => Ok(c),
        Cost::Var(src) => cost_of(r, mcf, l, src),
    }
}

/// `cost` from a variable (out of line: a fixed cost stays cheap).
#[inline(never)]
fn cost_of(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    l: &Limit,
    src: Source,
) -> Result<u32, Failure> {
    let bytes = read(r, src)?;
    let value = cost::of_value(bytes);
    match value {
        cost::Value::Given(_) | cost::Value::Empty => {}
        cost::Value::Saturated => {
            log_bad_value(r, mcf, l, "cost", bytes, "is above 1000000, counted as 1000000")
        }
        cost::Value::Malformed => {
            log_bad_value(r, mcf, l, "cost", bytes, "is not valid, counted as 1")
        }
    }
    Ok(value.weight())
}

/// The zone's key for this request (empty: not limited). The bytes live in
/// the request's pool.
pub(super) fn key<'r>(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    zone: usize,
) -> Result<&'r [u8], Failure> {
    let zone = mcf.zones.get(zone).ok_or(Failure::NoZone)?;
    read(r, zone.key)
}

/// Counts a request whose key for `zone` was empty (`not_limited`).
#[cold]
fn not_limited(mcf: &MainConf, zone: usize) {
    if let Some(s) = mcf.zones.get(zone).and_then(|z| z.shared.as_ref()) {
        Stats::bump(&s.stats().not_limited);
    }
}
