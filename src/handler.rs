//! The preaccess phase handler: evaluates each zone's key, decides every
//! limit of the location under the zones' locks, counts the request only if
//! all of them pass, and answers with the configured status otherwise.

use std::ffi::c_void;
use std::fmt::Write;
use std::ptr;

use nginx_sys::{
    ngx_cached_time, ngx_http_complex_value, ngx_http_request_t, ngx_int_t, ngx_pool_cleanup_add,
    ngx_str_t, ngx_uint_t, NGX_DECLINED, NGX_HTTP_INTERNAL_SERVER_ERROR, NGX_OK,
};
use ngx::http::{HttpModuleLocationConf, HttpModuleMainConf, Request};
use ngx::ngx_log_error;

use crate::conf::{Limit, LocConf, MainConf, DEFAULT_LOG_LEVEL, DEFAULT_STATUS};
use crate::key::entry_id;
use crate::window::{free_at, roll, seconds_until, window_index, Estimate};
use crate::zone::Locked;
use crate::Module;

/// `$redis_ratelimit_status`
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Rejected,
    RejectedDryRun,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Passed => "PASSED",
            Outcome::Rejected => "REJECTED",
            Outcome::RejectedDryRun => "REJECTED_DRY_RUN",
        }
    }
}

/// What the limiter decided for a request, kept for the variables. It hangs
/// off the main request's pool (as a cleanup entry) rather than the module
/// context, because an internal redirect wipes the context and the limiter
/// must neither run twice nor forget its answer.
pub struct RequestState {
    pub outcome: Outcome,
    pub remaining: u32,
}

/// Marks our cleanup entry. Exported so that it has exactly one address:
/// a private empty function may be copied into several codegen units.
#[no_mangle]
pub unsafe extern "C" fn ngx_http_redis_ratelimit_state_marker(_data: *mut c_void) {}

/// The state recorded for this request (its main request), if any.
pub fn state(r: &ngx_http_request_t) -> Option<&RequestState> {
    // SAFETY: `r.main` and its pool are valid for the request's lifetime; the
    // cleanup list is only appended to, on this thread.
    unsafe {
        let mut c = (*(*r.main).pool).cleanup;
        while !c.is_null() {
            if (*c).handler.map(|h| h as *const () as usize)
                == Some(ngx_http_redis_ratelimit_state_marker as *const () as usize)
            {
                return (*c).data.cast::<RequestState>().as_ref();
            }
            c = (*c).next;
        }
    }
    None
}

fn record(r: &ngx_http_request_t, st: RequestState) -> bool {
    // SAFETY: allocates from the main request's pool; the cleanup entry and
    // its data live as long as the request.
    unsafe {
        let c = ngx_pool_cleanup_add((*r.main).pool, std::mem::size_of::<RequestState>());
        if c.is_null() {
            return false;
        }
        ptr::write((*c).data.cast::<RequestState>(), st);
        (*c).handler = Some(ngx_http_redis_ratelimit_state_marker);
    }
    true
}

/// Wall-clock milliseconds from nginx's cached time (windows are aligned to
/// the epoch, so every node agrees on them).
fn now_ms() -> u64 {
    // SAFETY: nginx keeps `ngx_cached_time` pointing at a valid slot; reading
    // it through a volatile load is how nginx itself reads it.
    unsafe {
        let tp = ptr::read_volatile(ptr::addr_of!(ngx_cached_time));
        ((*tp).sec as u64) * 1000 + (*tp).msec as u64
    }
}

/// One limit being decided for this request.
struct Check {
    limit: Limit,
    /// position of the zone in `guards`
    guard: usize,
    entry: u32,
    allowed: bool,
    estimate: Estimate,
    window_start_ms: u64,
    prev: u32,
    cur: u32,
}

pub unsafe extern "C" fn preaccess(r: *mut ngx_http_request_t) -> ngx_int_t {
    // SAFETY: nginx calls phase handlers with a valid request.
    let r = unsafe { &mut *r };
    if state(r).is_some() {
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
    match decide(r, mcf, lcf, limits) {
        Ok(rc) => rc,
        Err(()) => NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t,
    }
}

fn decide(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    limits: &[Limit],
) -> Result<ngx_int_t, ()> {
    // Evaluate each zone's key once; an empty key is not limited.
    let mut keys: Vec<(usize, ngx_str_t)> = Vec::with_capacity(limits.len());
    for l in limits {
        if keys.iter().any(|(z, _)| *z == l.zone) {
            continue;
        }
        let zone = &mcf.zones[l.zone];
        let mut value = ngx_str_t::empty();
        // SAFETY: the complex value was compiled at configuration time for
        // this cycle; the result lives in the request pool.
        if unsafe { ngx_http_complex_value(r, zone.key, &mut value) } != NGX_OK as ngx_int_t {
            return Err(());
        }
        keys.push((l.zone, value));
    }

    // Lock the zones involved in index order (so two requests never wait on
    // each other), then decide and count under all the locks at once: a
    // request rejected by one limit consumes nothing from the others.
    let mut zones: Vec<usize> = keys
        .iter()
        .filter(|(_, k)| k.len > 0)
        .map(|(z, _)| *z)
        .collect();
    if zones.is_empty() {
        return Ok(NGX_DECLINED as ngx_int_t);
    }
    zones.sort_unstable();
    let mut guards: Vec<Locked<'_>> = Vec::with_capacity(zones.len());
    for &z in &zones {
        match &mcf.zones[z].shared {
            Some(shared) => guards.push(shared.lock()),
            None => return Err(()),
        }
    }

    let now = now_ms();
    let mut checks: Vec<Check> = Vec::with_capacity(limits.len());
    for l in limits {
        let Some((_, key)) = keys.iter().find(|(z, _)| *z == l.zone) else {
            continue;
        };
        if key.len == 0 {
            continue;
        }
        let Some(guard) = zones.iter().position(|z| *z == l.zone) else {
            continue;
        };
        let zone = &mcf.zones[l.zone];
        let key = key.as_bytes();
        let table = &mut guards[guard].table;
        let id = entry_id(table.seed(), zone.name.as_bytes(), l.rate.period, key);
        let (entry, _) = table.get_or_insert(id);
        let p = l.rate.period_ms();
        let idx = window_index(now, p);
        let e = table.entry_mut(entry);
        let (prev, cur) = roll(u64::from(e.window), e.prev, e.cur, idx);
        e.window = idx as u32;
        e.prev = prev;
        e.cur = cur;
        let window_start_ms = idx * p;
        let estimate = Estimate::new(prev, cur, now - window_start_ms, p);
        checks.push(Check {
            limit: *l,
            guard,
            entry,
            allowed: estimate.below(l.rate.limit),
            estimate,
            window_start_ms,
            prev,
            cur,
        });
    }

    let rejected = checks.iter().any(|c| !c.allowed);
    let dry_run = lcf.dry_run.unwrap_or(false);
    let mut remaining = u32::MAX;
    let mut tightest: Option<usize> = None;
    let mut retry_at = now;
    if rejected {
        for c in checks.iter().filter(|c| !c.allowed) {
            retry_at = retry_at.max(free_at(c.limit.rate, c.prev, c.cur, c.window_start_ms, now));
        }
        remaining = 0;
        tightest = checks.iter().position(|c| !c.allowed);
    } else {
        // Count once per (zone, period, key) entry, however many limits share it.
        for i in 0..checks.len() {
            let first = checks[..i]
                .iter()
                .all(|o| o.guard != checks[i].guard || o.entry != checks[i].entry);
            if first {
                let e = guards[checks[i].guard].table.entry_mut(checks[i].entry);
                e.cur = e.cur.saturating_add(1);
            }
        }
        for (i, c) in checks.iter().enumerate() {
            let e = guards[c.guard].table.entry(c.entry);
            let after = Estimate::new(
                c.prev,
                e.cur,
                now - c.window_start_ms,
                c.limit.rate.period_ms(),
            );
            let left = after.remaining(c.limit.rate.limit);
            if left < remaining {
                remaining = left;
                tightest = Some(i);
            }
        }
    }
    drop(guards);

    let Some(tightest) = tightest else {
        return Ok(NGX_DECLINED as ngx_int_t);
    };
    let outcome = match (rejected, dry_run) {
        (false, _) => Outcome::Passed,
        (true, false) => Outcome::Rejected,
        (true, true) => Outcome::RejectedDryRun,
    };

    if rejected {
        let c = &checks[tightest];
        let zone = &mcf.zones[c.limit.zone];
        let level = lcf.log_level.unwrap_or(DEFAULT_LOG_LEVEL);
        // SAFETY: the request's connection and its log are valid.
        let log = unsafe { (*r.connection).log };
        ngx_log_error!(
            level as ngx_uint_t,
            log,
            "limiting requests{}, estimate: {:.3} of {} by zone \"{}\"",
            if dry_run { ", dry run" } else { "" },
            c.estimate.value(),
            c.limit.rate,
            zone.name
        );
    }

    if !record(r, RequestState { outcome, remaining }) {
        return Err(());
    }

    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    if lcf.headers.unwrap_or(false) {
        let mut policy = String::new();
        for (i, c) in checks.iter().enumerate() {
            if i > 0 {
                policy.push_str(", ");
            }
            let _ = write!(
                policy,
                "\"{}\";q={};w={}",
                mcf.zones[c.limit.zone].name, c.limit.rate.limit, c.limit.rate.period
            );
        }
        let c = &checks[tightest];
        let reset = if rejected {
            seconds_until(now, retry_at)
        } else {
            seconds_until(now, c.window_start_ms + c.limit.rate.period_ms())
        };
        let state = format!(
            "\"{}\";r={};t={}",
            mcf.zones[c.limit.zone].name, remaining, reset
        );
        req.add_header_out("RateLimit-Policy", &policy).ok_or(())?;
        req.add_header_out("RateLimit", &state).ok_or(())?;
    }

    if rejected && !dry_run {
        let secs = seconds_until(now, retry_at);
        req.add_header_out("Retry-After", &secs.to_string())
            .ok_or(())?;
        return Ok(ngx_int_t::from(lcf.status.unwrap_or(DEFAULT_STATUS) as i16));
    }
    Ok(NGX_DECLINED as ngx_int_t)
}
