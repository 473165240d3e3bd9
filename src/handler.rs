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
use smallvec::SmallVec;

use crate::batch::ItemId;
use std::sync::Arc;

use crate::backend::Channel;
use crate::conf::{Limit, LocConf, MainConf, ZoneConf, DEFAULT_LOG_LEVEL, DEFAULT_STATUS};
use crate::counter;
use crate::params::OnError;
use crate::window::seconds_until;
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
pub fn now_ms() -> u64 {
    // SAFETY: nginx keeps `ngx_cached_time` pointing at a valid slot; reading
    // it through a volatile load is how nginx itself reads it.
    unsafe {
        let tp = ptr::read_volatile(ptr::addr_of!(ngx_cached_time));
        ((*tp).sec as u64) * 1000 + (*tp).msec as u64
    }
}

/// How a zone counts right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// In this node's shared memory only (no backend, or no thread).
    Local,
    /// Through the zone's Redis backend (also while it is down with
    /// `on_error=local`: the increments then stay counted locally).
    Remote,
    /// Backend down, `on_error=allow`: pass without counting.
    Allow,
    /// Backend down, `on_error=deny`: reject.
    Deny,
}

/// How long a request rejected by `on_error=deny` is told to wait.
const DENY_RETRY_MS: u64 = 1000;

impl Mode {
    /// What the zone's backend state makes of a decision from the counts.
    pub fn apply(self, result: &mut counter::Check, now: u64) {
        match self {
            Mode::Allow => result.allowed = true,
            Mode::Deny => {
                result.allowed = false;
                result.retry_at_ms = now + DENY_RETRY_MS;
            }
            Mode::Local | Mode::Remote => {}
        }
    }
}

/// Queues one counted request of `key` for the zone's Redis backend.
/// `limit` is the tightest limit counting it (for the breaker); `urgent`
/// when the key is near it.
#[allow(clippy::too_many_arguments)]
pub fn send(
    ch: &Channel,
    zone: usize,
    id: [u64; 2],
    namespace: &[u8],
    key: &[u8],
    period: u32,
    limit: u32,
    window: u64,
    urgent: bool,
) {
    let item = ItemId {
        zone: zone as u32,
        entry: id,
        window,
    };
    ch.push(item, namespace, key, period, limit, urgent);
}

pub fn mode(zone: &ZoneConf, index: usize, channel: Option<&Arc<Channel>>) -> Mode {
    let Some(on_error) = zone
        .params
        .as_ref()
        .and_then(|p| p.backend.as_ref().map(|_| p.on_error))
    else {
        return Mode::Local;
    };
    let Some(ch) = channel else {
        return Mode::Local;
    };
    if ch.is_up(index) {
        return Mode::Remote;
    }
    match on_error {
        OnError::Local => Mode::Remote,
        OnError::Allow => Mode::Allow,
        OnError::Deny => Mode::Deny,
    }
}

/// One limit being decided for this request.
struct Check {
    limit: Limit,
    /// position of the zone in `guards`
    guard: usize,
    entry: u32,
    id: [u64; 2],
    key: ngx_str_t,
    /// Counted through the zone's Redis backend (else locally).
    remote: bool,
    /// Not counted at all (the backend is down and `on_error=allow`).
    skip: bool,
    result: counter::Check,
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
    let decided = match limits {
        [one] => decide_one(r, mcf, lcf, one),
        _ => decide(r, mcf, lcf, limits),
    };
    match decided {
        Ok(rc) => rc,
        Err(()) => NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t,
    }
}

/// The common case, one limit in the location: the same steps as `decide`
/// without its bookkeeping for several zones and shared entries.
fn decide_one(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    l: &Limit,
) -> Result<ngx_int_t, ()> {
    let zone = &mcf.zones[l.zone];
    let mut key = ngx_str_t::empty();
    // SAFETY: the complex value was compiled at configuration time for this
    // cycle; the result lives in the request pool.
    if unsafe { ngx_http_complex_value(r, zone.key, &mut key) } != NGX_OK as ngx_int_t {
        return Err(());
    }
    if key.len == 0 {
        return Ok(NGX_DECLINED as ngx_int_t);
    }
    let shared = zone.shared.as_ref().ok_or(())?;
    let now = now_ms();
    let channel = crate::worker::channel();
    let how = mode(zone, l.zone, channel);
    let rate = l.rate;
    let id = shared
        .ids
        .id(zone.name.as_bytes(), rate.period, key.as_bytes());
    let (entry, result, remaining) = {
        let mut locked = shared.lock();
        let table = &mut locked.table;
        let (entry, _) = table.get_or_insert(id);
        let e = table.entry_mut(entry);
        let mut result = counter::check(e, rate, now);
        how.apply(&mut result, now);
        let mut remaining = 0;
        if result.allowed {
            if how != Mode::Allow {
                counter::count(e, how == Mode::Remote);
            }
            remaining = counter::estimate(e, rate, now).remaining(rate.limit);
        }
        (entry, result, remaining)
    };
    if result.allowed && how == Mode::Remote {
        if let Some(ch) = channel {
            let urgent = remaining <= rate.limit / 2;
            let name = zone.name.as_bytes();
            send(
                ch,
                l.zone,
                id,
                name,
                key.as_bytes(),
                rate.period,
                rate.limit,
                result.window,
                urgent,
            );
        }
    }
    let check = Check {
        limit: *l,
        guard: 0,
        entry,
        id,
        key,
        remote: how == Mode::Remote,
        skip: how == Mode::Allow,
        result,
    };
    let rejected = !result.allowed;
    let retry_at = if rejected {
        result.retry_at_ms.max(now)
    } else {
        now
    };
    finish(r, mcf, lcf, now, rejected, remaining, retry_at, &[check], 0)
}

fn decide(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    limits: &[Limit],
) -> Result<ngx_int_t, ()> {
    // Evaluate each zone's key once; an empty key is not limited.
    let mut keys: SmallVec<[(usize, ngx_str_t); 4]> = SmallVec::new();
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

    // Lock the zones involved in the order of their shared memory (the same
    // in every process, old or new after a reload that reordered the
    // declarations: two workers never wait on each other), then decide and
    // count under all the locks at once: a request rejected by one limit
    // consumes nothing from the others.
    let mut zones: SmallVec<[usize; 4]> = keys
        .iter()
        .filter(|(_, k)| k.len > 0)
        .map(|(z, _)| *z)
        .collect();
    if zones.is_empty() {
        return Ok(NGX_DECLINED as ngx_int_t);
    }
    zones.sort_unstable_by_key(|&z| mcf.zones[z].shared.as_ref().map_or(0, |s| s.order()));
    let mut guards: SmallVec<[Locked<'_>; 4]> = SmallVec::new();
    for &z in &zones {
        match &mcf.zones[z].shared {
            Some(shared) => guards.push(shared.lock()),
            None => return Err(()),
        }
    }

    let now = now_ms();
    let channel = crate::worker::channel();
    let mut checks: SmallVec<[Check; 4]> = SmallVec::new();
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
        let how = mode(zone, l.zone, channel);
        let Some(shared) = zone.shared.as_ref() else {
            continue;
        };
        let id = shared
            .ids
            .id(zone.name.as_bytes(), l.rate.period, key.as_bytes());
        let table = &mut guards[guard].table;
        let (entry, _) = table.get_or_insert(id);
        let mut result = counter::check(table.entry_mut(entry), l.rate, now);
        how.apply(&mut result, now);
        let skip = how == Mode::Allow;
        checks.push(Check {
            limit: *l,
            guard,
            entry,
            id,
            key: *key,
            remote: how == Mode::Remote,
            skip,
            result,
        });
    }

    let rejected = checks.iter().any(|c| !c.result.allowed);
    let mut remaining = u32::MAX;
    let mut tightest: Option<usize> = None;
    let mut retry_at = now;
    // (check index, limit, near its limit) of each distinct entry to send
    let mut sends: SmallVec<[(usize, u32, bool); 4]> = SmallVec::new();
    if rejected {
        for c in checks.iter().filter(|c| !c.result.allowed) {
            retry_at = retry_at.max(c.result.retry_at_ms);
        }
        remaining = 0;
        tightest = checks.iter().position(|c| !c.result.allowed);
    } else {
        // Count once per (zone, period, key) entry, however many limits share it.
        for i in 0..checks.len() {
            let c = &checks[i];
            if c.skip {
                continue;
            }
            match checks[..i]
                .iter()
                .position(|o| o.guard == c.guard && o.entry == c.entry)
            {
                None => {
                    let e = guards[c.guard].table.entry_mut(c.entry);
                    counter::count(e, c.remote);
                    if c.remote {
                        sends.push((i, c.limit.rate.limit, false));
                    }
                }
                Some(first) => {
                    if let Some(s) = sends.iter_mut().find(|s| s.0 == first) {
                        s.1 = s.1.min(c.limit.rate.limit);
                    }
                }
            }
        }
        for (i, c) in checks.iter().enumerate() {
            let e = guards[c.guard].table.entry(c.entry);
            let left = counter::estimate(e, c.limit.rate, now).remaining(c.limit.rate.limit);
            if left <= c.limit.rate.limit / 2 {
                if let Some(s) = sends
                    .iter_mut()
                    .find(|s| checks[s.0].entry == c.entry && checks[s.0].guard == c.guard)
                {
                    s.2 = true;
                }
            }
            if left < remaining {
                remaining = left;
                tightest = Some(i);
            }
        }
    }
    drop(guards);

    if let Some(ch) = channel {
        for &(i, limit, urgent) in &sends {
            let c = &checks[i];
            let name = mcf.zones[c.limit.zone].name.as_bytes();
            let period = c.limit.rate.period;
            send(
                ch,
                c.limit.zone,
                c.id,
                name,
                c.key.as_bytes(),
                period,
                limit,
                c.result.window,
                urgent,
            );
        }
    }

    let Some(tightest) = tightest else {
        return Ok(NGX_DECLINED as ngx_int_t);
    };
    finish(
        r, mcf, lcf, now, rejected, remaining, retry_at, &checks, tightest,
    )
}

/// What every decided request ends with: the log line of a rejection, the
/// recorded state (for the variables), the headers, and the status.
#[allow(clippy::too_many_arguments)]
fn finish(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    now: u64,
    rejected: bool,
    remaining: u32,
    retry_at: u64,
    checks: &[Check],
    tightest: usize,
) -> Result<ngx_int_t, ()> {
    let dry_run = lcf.dry_run.unwrap_or(false);
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
            c.result.estimate.value(),
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
            seconds_until(now, c.result.window_start_ms + c.limit.rate.period_ms())
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
