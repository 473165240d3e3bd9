//! The preaccess phase handler: evaluates each zone's key, asks the engine
//! (`engine/`) for the decision on every limit of the location (strict
//! limits through `strict.rs`), and answers (`answer.rs`).

use nginx_sys::{ngx_http_request_t, ngx_int_t, NGX_DECLINED, NGX_LOG_ERR};
use ngx::http::{HttpModuleLocationConf, HttpModuleMainConf, Request};
use ngx::ngx_log_error;
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Stats;
use ratelimit_core::{cost, text};
use smallvec::SmallVec;

use crate::conf::module::Module;
use crate::conf::{Cost, Limit, LocConf, MainConf, RateSpec, Source};
use crate::engine::controls::{self, Said};
use crate::engine::{self, Ask, Decision, Strict, Take};
use crate::http::answer::{ask, debug_log, finish, state};
use crate::http::values::{key, read};
use crate::http::Failure;
use crate::http::{failed, request_log};
use crate::worker::time::now_ms;

/// Limits of one location, with their keys evaluated: few enough to stay
/// on the stack.
const INLINE: usize = 4;

pub unsafe extern "C" fn preaccess(r: *mut ngx_http_request_t) -> ngx_int_t {
    // SAFETY: nginx calls phase handlers with a valid request.
    let r = unsafe { &mut *r };
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let Some(lcf) = Module::location_conf(req) else {
        return NGX_DECLINED as ngx_int_t;
    };
    let rc = rates(r, lcf);
    match lcf.conns.as_deref() {
        // a request the rates let through takes its slots
        Some(c) if !c.is_empty() => crate::http::conn::after_rates(r, rc),
        _ => rc,
    }
}

/// The location's rate limits (`redis_ratelimit`).
#[inline(always)]
fn rates(r: &mut ngx_http_request_t, lcf: &LocConf) -> ngx_int_t {
    // decided once per request: a request nginx has not redirected
    // internally (nor a subrequest) runs this phase once, so only those
    // look for an earlier decision
    if r.internal() != 0 && state(r).is_some() || crate::http::delay::delayed(r) {
        return NGX_DECLINED as ngx_int_t;
    }
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
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
        if !in_redis(mcf, l, rate) && !controls::any(mcf, l.zone) {
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
    let now = now_ms();
    let (mut asks, blocked) = asks(r, mcf, limits, now)?;
    if asks.is_empty() {
        return Ok(NGX_DECLINED as ngx_int_t);
    }
    if let Some((i, until)) = blocked {
        let d = Decision::blocked(i, asks[i].rate, until);
        return finish(r, mcf, lcf, now, &asks, &d);
    }
    if asks.iter().any(|a| a.strict != Strict::Background) {
        return crate::http::strict::limit(r, mcf, lcf, &mut asks);
    }
    let decision = engine::decide(mcf, &asks, now, Take::IfAllowed, debug_log(r))?;
    finish(r, mcf, lcf, now, &asks, &decision)
}

/// A request's limits for the engine, and the first whose key its zone
/// has blocked (with the block's end).
type Asks<'r> = (SmallVec<[Ask<'r>; INLINE]>, Option<(usize, u64)>);

/// What the engine is asked for each line that applies: its rate (a line
/// whose rate is empty or `off` does not apply; a key's override replaces
/// it), its zone's key (evaluated once per zone; an empty key is not
/// limited) and its cost; a limit Redis decides (`in_redis`) is
/// `Strict::Asking`.
fn asks<'r>(
    r: &mut ngx_http_request_t,
    mcf: &'r MainConf,
    limits: &[Limit],
    now: u64,
) -> Result<Asks<'r>, Failure> {
    let mut keys: SmallVec<[(usize, &[u8], Said); INLINE]> = SmallVec::new();
    let mut asks = SmallVec::new();
    let mut blocked = None;
    for (line, l) in limits.iter().enumerate() {
        let Some(rate) = rate(r, mcf, l)? else {
            continue;
        };
        let (key, said) = match keys.iter().find(|(z, ..)| *z == l.zone) {
            Some((_, k, s)) => (*k, *s),
            None => {
                let k = key(r, mcf, l.zone)?;
                let said = if k.is_empty() {
                    Said::default()
                } else {
                    controls::look(mcf, l.zone, k, now)
                };
                keys.push((l.zone, k, said));
                if k.is_empty() {
                    not_limited(mcf, l.zone);
                }
                (k, said)
            }
        };
        if key.is_empty() {
            continue;
        }
        let rate = said.rate.unwrap_or(rate);
        if let (Some(until), None) = (said.blocked, blocked) {
            blocked = Some((asks.len(), until));
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
    Ok((asks, blocked))
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

/// Counts a request whose key for `zone` was empty (`not_limited`).
#[cold]
fn not_limited(mcf: &MainConf, zone: usize) {
    if let Some(s) = mcf.zones.get(zone).and_then(|z| z.shared.as_ref()) {
        Stats::bump(&s.stats().not_limited);
    }
}
