//! How a decided request is answered: the log line of a rejection, the
//! state the variables and the log phase read, the headers, the status —
//! for the preaccess handler (`handler.rs`) and strict requests that waited
//! (`strict.rs`) alike.

use std::ffi::c_void;
use std::fmt::Write;
use std::ptr;

use nginx_sys::{
    ngx_http_request_t, ngx_int_t, ngx_log_t, ngx_palloc, ngx_pnalloc, ngx_pool_cleanup_t,
    ngx_uint_t, NGX_DECLINED, NGX_LOG_INFO, NGX_LOG_NOTICE, NGX_LOG_WARN,
};
use ngx::http::Request;
use ngx::ngx_log_error;
use ratelimit_core::bucket;
use ratelimit_core::params::OnError;
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Outcome;
use ratelimit_core::stats::Stats;
use ratelimit_core::text;
use ratelimit_core::window::{quota_back_at, seconds_until, Estimate};
use ratelimit_core::{api, control};

use crate::conf::{Limit, LocConf, MainConf, HEADERS_LEGACY, HEADERS_OFF};
use crate::engine::{Ask, Decision, Strict};
use crate::http::{request_log, Failure};
use crate::worker::controls::Asked;

/// What the limiter decided for a request, kept for the variables. It hangs
/// off the main request's pool (as a cleanup entry) rather than the module
/// context, because an internal redirect wipes the context and the limiter
/// must neither run twice nor forget its answer.
#[derive(Clone, Copy)]
pub struct RequestState {
    pub outcome: Outcome,
    /// The tightest limit's estimate after the request, and its L (0 when
    /// rejected): `$redis_ratelimit_remaining` works the number out only
    /// when a configuration reads it.
    pub after: Estimate,
    pub limit: u32,
    /// The `count_if=` limits the log phase counts (null: none).
    pub deferred: *const Deferred,
}

/// The `count_if=` limits a request passed, as this phase checked them, in
/// the main request's pool: the location (its configuration lives as long
/// as the cycle, which outlives the request), then `n` entries. The log
/// phase counts these keys and rates, not values read again after an
/// internal redirect has changed the request's URI, arguments or
/// variables.
#[repr(C)]
pub struct Deferred {
    pub lcf: *const LocConf,
    pub n: usize,
}

/// One of them: its line in the location's list, and the key (a copy in
/// the main request's pool) and rate checked.
#[derive(Clone, Copy)]
pub struct Counted {
    pub line: u32,
    pub rate: Rate,
    pub key: *const u8,
    pub key_len: usize,
}

impl Deferred {
    /// The limits to count.
    pub fn counts(&self) -> &[Counted] {
        // SAFETY: `defer` wrote `n` entries right after the header, in one
        // allocation of the main request's pool.
        unsafe { std::slice::from_raw_parts(ptr::from_ref(self).add(1).cast::<Counted>(), self.n) }
    }
}

impl Counted {
    pub fn key(&self) -> &[u8] {
        // SAFETY: `key_len` bytes copied by `defer` into the main request's
        // pool (never empty: an empty key is not limited).
        unsafe { std::slice::from_raw_parts(self.key, self.key_len) }
    }
}

impl RequestState {
    /// Requests left under the tightest limit, after this one (0 when
    /// rejected).
    pub fn remaining(&self) -> u32 {
        self.after.remaining(self.limit)
    }
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

/// A cleanup entry and the state it carries, in one allocation (what
/// `ngx_pool_cleanup_add` does with two).
#[repr(C)]
struct Recorded {
    cleanup: ngx_pool_cleanup_t,
    state: RequestState,
}

#[inline(always)]
fn record(r: &ngx_http_request_t, st: RequestState) -> bool {
    // SAFETY: allocates from the main request's pool (aligned for pointers,
    // as nginx's own cleanup entries are) and links the entry into its
    // cleanup list as `ngx_pool_cleanup_add` does; both live as long as the
    // request. The state needs no destructor: the handler does nothing.
    unsafe {
        let pool = (*r.main).pool;
        let rec = ngx_palloc(pool, std::mem::size_of::<Recorded>()).cast::<Recorded>();
        if rec.is_null() {
            return false;
        }
        ptr::write(
            rec,
            Recorded {
                cleanup: ngx_pool_cleanup_t {
                    handler: Some(ngx_http_redis_ratelimit_state_marker),
                    data: ptr::null_mut(),
                    next: (*pool).cleanup,
                },
                state: st,
            },
        );
        (*rec).cleanup.data = ptr::addr_of_mut!((*rec).state).cast();
        (*pool).cleanup = ptr::addr_of_mut!((*rec).cleanup);
    }
    true
}

/// The request's log for the engine's debug lines; none (and no cost) in a
/// module for nginx without `--with-debug`.
pub(super) fn debug_log(r: &ngx_http_request_t) -> *mut ngx_log_t {
    if !ngx::log::DEBUG {
        return std::ptr::null_mut();
    }
    request_log(r)
}

/// Counts the request in its zones' figures (`redis_ratelimit_metrics`):
/// a rejection in the zone whose limit said no, a pass in every zone that
/// was asked (once each).
#[inline]
fn count_outcome(mcf: &MainConf, limits: &[Ask<'_>], rejecting: usize, outcome: Outcome) {
    let stats = |z: usize| mcf.zones.get(z).and_then(|z| z.shared.as_ref()).map(|s| s.stats());
    if let [one] = limits {
        // one limit (most locations): its zone, without the loop
        if let Some(st) = stats(one.zone) {
            st.add(outcome);
        }
        return;
    }
    if outcome != Outcome::Passed {
        if let Some(st) = stats(rejecting) {
            st.add(outcome);
        }
        return;
    }
    for (i, a) in limits.iter().enumerate() {
        if limits[..i].iter().all(|o| o.zone != a.zone) {
            if let Some(st) = stats(a.zone) {
                st.add(outcome);
            }
        }
    }
}

/// What every decided request ends with: the log line of a rejection, the
/// recorded state (for the variables), the headers, and the status. A
/// request let through without headers takes the short way: its zone's
/// figure and the recorded state.
#[inline(always)]
pub(super) fn finish(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    now: u64,
    limits: &[Ask<'_>],
    d: &Decision,
) -> Result<ngx_int_t, Failure> {
    let rejected = !d.allowed;
    let dry_run = lcf.dry_run == 1;
    let delayed = d.delay_ms > 0;
    let outcome = match (rejected, delayed, dry_run) {
        (false, false, _) => Outcome::Passed,
        (false, true, false) => Outcome::Delayed,
        (false, true, true) => Outcome::DelayedDryRun,
        (true, _, false) => Outcome::Rejected,
        (true, _, true) => Outcome::RejectedDryRun,
    };
    let tightest = limits.get(d.tightest).ok_or(Failure::NoLimit)?;
    count_outcome(mcf, limits, tightest.zone, outcome);
    crate::engine::top::sample(mcf, limits, now);
    if rejected {
        log_rejection(r, mcf, lcf, tightest, d);
        if !d.blocked && !dry_run {
            penalize(r, mcf, lcf, tightest, now);
        }
    } else if delayed {
        log_delay(r, mcf, lcf, limits, d);
    }
    let deferred = if mcf.count_if && !rejected { defer(r, lcf, limits)? } else { ptr::null() };
    if !record(r, RequestState { outcome, after: d.checked.after, limit: d.limit, deferred }) {
        return Err(Failure::NoMemory);
    }
    let rc = if lcf.headers == HEADERS_OFF && !rejected {
        NGX_DECLINED as ngx_int_t
    } else {
        headers(r, mcf, lcf, now, limits, *d)?
    };
    if outcome == Outcome::Delayed {
        return crate::http::delay::delay(r, d.delay_ms);
    }
    Ok(rc)
}

/// The log line of a delayed request, one level below the rejection's
/// (as `limit_req` writes it: the excess of the bucket that delays it).
#[cold]
#[inline(never)]
fn log_delay(
    r: &ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    limits: &[Ask<'_>],
    d: &Decision,
) {
    let level = if lcf.log_level as ngx_uint_t >= NGX_LOG_INFO as ngx_uint_t {
        NGX_LOG_INFO as ngx_uint_t
    } else {
        lcf.log_level as ngx_uint_t + 1
    };
    let (Some(a), excess) = (limits.get(d.delaying), d.delay_excess) else {
        return;
    };
    ngx_log_error!(
        level,
        request_log(r),
        "delaying request{}, excess: {}.{:03}, by zone \"{}\"",
        if lcf.dry_run == 1 { ", dry run" } else { "" },
        excess / 1000,
        excess % 1000,
        mcf.zones[a.zone].name
    );
}

/// Keeps the `count_if=` limits the request passed, with their keys and
/// rates as checked, for the log phase (`count.rs`) (null: none).
#[cold]
#[inline(never)]
fn defer(
    r: &ngx_http_request_t,
    lcf: &LocConf,
    asks: &[Ask<'_>],
) -> Result<*const Deferred, Failure> {
    let Some(lines) = lcf.limits.as_deref() else {
        return Ok(ptr::null());
    };
    let later = |a: &&Ask<'_>| {
        lines.get(a.line as usize).is_some_and(|l| l.count_if.is_some()) && !a.key.is_empty()
    };
    let n = asks.iter().filter(later).count();
    if n == 0 {
        return Ok(ptr::null());
    }
    // SAFETY: the main request's pool lives as long as the request; the
    // header, its entries and the key copies are written before anything
    // reads them. The entries follow the header, aligned for them.
    unsafe {
        let pool = (*r.main).pool;
        let size = std::mem::size_of::<Deferred>() + n * std::mem::size_of::<Counted>();
        let d = ngx_palloc(pool, size).cast::<Deferred>();
        if d.is_null() {
            return Err(Failure::NoMemory);
        }
        ptr::write(d, Deferred { lcf, n });
        let counts = d.add(1).cast::<Counted>();
        for (i, a) in asks.iter().filter(later).enumerate() {
            let key = ngx_pnalloc(pool, a.key.len()).cast::<u8>();
            if key.is_null() {
                return Err(Failure::NoMemory);
            }
            ptr::copy_nonoverlapping(a.key.as_ptr(), key, a.key.len());
            ptr::write(
                counts.add(i),
                Counted { line: a.line, rate: a.rate, key, key_len: a.key.len() },
            );
        }
        Ok(d)
    }
}

/// A key rejected by a line with `block=` is blocked in the line's zone
/// for that long, on every node (`worker::controls`).
#[cold]
#[inline(never)]
fn penalize(r: &ngx_http_request_t, mcf: &MainConf, lcf: &LocConf, rejecting: &Ask<'_>, now: u64) {
    let Some(l) = lcf.limits.as_deref().and_then(|l| l.get(rejecting.line as usize)) else {
        return;
    };
    if l.block_ms == 0 {
        return;
    }
    let asked = Asked::Set(control::Kind::Block, l.block_ms);
    let zone = &mcf.zones[rejecting.zone];
    match crate::worker::controls::change(mcf, rejecting.zone, rejecting.key, asked, now) {
        Ok(_) => {
            if let Some(s) = zone.shared.as_ref() {
                Stats::bump(&s.stats().blocks);
            }
            ngx_log_error!(
                NGX_LOG_NOTICE,
                request_log(r),
                "redis_ratelimit: zone \"{}\": key \"{}\" blocked for {} (block=)",
                zone.name,
                api::key_text(rejecting.key, zone.binary_addr).escape_debug(),
                text::duration(l.block_ms)
            );
        }
        Err(control::Full) => {
            ngx_log_error!(
                NGX_LOG_WARN,
                request_log(r),
                "redis_ratelimit: zone \"{}\": no room for another blocked key (block=): the zone's controls are full",
                zone.name
            );
        }
    }
}

/// The log line of a rejected request (at `redis_ratelimit_log_level`).
#[cold]
#[inline(never)]
fn log_rejection(
    r: &ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    tightest: &Ask<'_>,
    d: &Decision,
) {
    let zone = &mcf.zones[tightest.zone];
    if d.blocked {
        ngx_log_error!(
            lcf.log_level as ngx_uint_t,
            request_log(r),
            "limiting requests{}, key blocked for {} more by zone \"{}\"",
            if lcf.dry_run == 1 { ", dry run" } else { "" },
            text::duration(d.retry_at_ms.saturating_sub(crate::worker::time::now_ms())),
            zone.name
        );
        return;
    }
    // a refusal made by on_error says so: its estimate is not Redis's
    let down = crate::worker::channel::channel()
        .is_some_and(|ch| !crate::engine::backend_up(mcf, ch, tightest.zone));
    let policy = match zone.params.as_ref().filter(|p| down && p.backend.is_some()) {
        Some(p) if p.on_error == OnError::Deny => ", Redis down (on_error=deny)",
        Some(p) if p.on_error == OnError::Share => {
            ", Redis down (on_error=share: this node's share)"
        }
        Some(_) => ", Redis down (on_error=local: this node's counts)",
        None => "",
    };
    let dry = if lcf.dry_run == 1 { ", dry run" } else { "" };
    if let Some(b) = d.checked.bucket {
        // a bucket's line, as `limit_req` writes it
        ngx_log_error!(
            lcf.log_level as ngx_uint_t,
            request_log(r),
            "limiting requests{}, excess: {}.{:03} by zone \"{}\"",
            dry,
            b.excess / 1000,
            b.excess % 1000,
            zone.name
        );
        return;
    }
    ngx_log_error!(
        lcf.log_level as ngx_uint_t,
        request_log(r),
        "limiting requests{}, estimate: {:.3} of {} by zone \"{}\"{}",
        dry,
        d.checked.check.estimate.value(),
        tightest.rate,
        zone.name,
        policy
    );
}

/// The headers of `redis_ratelimit_headers`, and a rejected request's
/// `Retry-After` and status.
#[inline(never)]
fn headers(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    now: u64,
    limits: &[Ask<'_>],
    d: Decision,
) -> Result<ngx_int_t, Failure> {
    let rejected = !d.allowed;
    let remaining = d.remaining();
    let retry_at = if rejected { d.retry_at_ms.max(now) } else { now };
    let tightest = &limits[d.tightest];
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    if lcf.headers != HEADERS_OFF {
        // seconds until the tightest limit's whole quota is back (what a
        // client reading X-RateLimit-Reset as GitHub's expects: after it,
        // Remaining is the limit); Retry-After says when one request may
        // pass
        let check = &d.checked.check;
        let counted = if rejected { 0 } else { tightest.cost };
        let back = match d.checked.bucket {
            // a bucket's burst is whole again once its excess has drained
            Some(b) => {
                // (a rejected request's excess is what it would have left)
                let cost = u64::from(tightest.cost) * bucket::MILLI;
                let excess = if rejected { b.excess.saturating_sub(cost) } else { b.excess };
                now + bucket::drain_ms(tightest.rate, excess).div_ceil(1000) * 1000
            }
            None => quota_back_at(
                now,
                check.window_start_ms,
                tightest.rate.period_ms(),
                u64::from(check.cur) + u64::from(counted),
                d.checked.after,
            ),
        };
        let reset = back.saturating_sub(now).div_ceil(1000);
        if lcf.headers == HEADERS_LEGACY {
            // GitHub's convention, which the clients of these headers
            // follow: the Unix time (s) the quota is back
            let at = if reset == 0 { now / 1000 } else { back.div_ceil(1000) };
            req.add_header_out("X-RateLimit-Limit", &quota(tightest).0.to_string())
                .ok_or(Failure::NoMemory)?;
            req.add_header_out("X-RateLimit-Remaining", &remaining.to_string())
                .ok_or(Failure::NoMemory)?;
            req.add_header_out("X-RateLimit-Reset", &at.to_string()).ok_or(Failure::NoMemory)?;
        } else {
            let name = |i: usize| {
                let mut s = String::new();
                policy_name(&mut s, mcf, limits, i);
                s
            };
            let mut policy = String::new();
            for (i, l) in limits.iter().enumerate() {
                if i > 0 {
                    policy.push_str(", ");
                }
                policy_name(&mut policy, mcf, limits, i);
                let (q, w) = quota(l);
                let _ = write!(policy, ";q={q};w={w}");
            }
            let state = format!("{};r={};t={}", name(d.tightest), remaining, reset);
            req.add_header_out("RateLimit-Policy", &policy).ok_or(Failure::NoMemory)?;
            req.add_header_out("RateLimit", &state).ok_or(Failure::NoMemory)?;
        }
    }

    if rejected && lcf.dry_run != 1 {
        let secs = seconds_until(now, retry_at);
        req.add_header_out("Retry-After", &secs.to_string()).ok_or(Failure::NoMemory)?;
        // the limit that rejected it, named as RateLimit-Policy names it
        return crate::http::problem::reject(r, lcf, || {
            vec![policy_label(mcf, limits, d.tightest)]
        });
    }
    Ok(NGX_DECLINED as ngx_int_t)
}

/// A limit's quota as `RateLimit-Policy` states it: `q` requests per `w`
/// seconds. A window's is its rate; a bucket's is its burst and the
/// request itself, per the time its rate takes to let that many through
/// (rounded up: `10r/s burst=20` is 21 per 3 s).
fn quota(l: &Ask<'_>) -> (u64, u64) {
    match l.bucket {
        None => (u64::from(l.rate.limit), u64::from(l.rate.period)),
        Some(b) => {
            let q = u64::from(b.burst) + 1;
            let w = (q * u64::from(l.rate.period)).div_ceil(u64::from(l.rate.limit.max(1)));
            (q, w.max(1))
        }
    }
}

/// The name of the `i`-th limit of a response in `RateLimit-Policy` and
/// `RateLimit`, as a structured-field string: its zone's name, or, when
/// another limit of the response has the same zone, the zone's name and
/// its rate (`"api-10r/m"`), so that a client can tell which policy
/// `RateLimit` speaks of; the limit's place is added (`"api-10r/m-2"`)
/// should two of one zone have the same rate too.
fn policy_name(out: &mut String, mcf: &MainConf, limits: &[Ask<'_>], i: usize) {
    out.push_str(&text::sf_string(&policy_label(mcf, limits, i)));
}

/// Limit `i`'s policy name: its zone's, with its rate (and its place) when
/// the zone has several limits on the request.
fn policy_label(mcf: &MainConf, limits: &[Ask<'_>], i: usize) -> String {
    let l = &limits[i];
    let mut name = mcf.zones[l.zone].name.clone();
    if limits.iter().filter(|o| o.zone == l.zone).count() > 1 {
        let _ = write!(name, "-{}", l.rate);
        if limits.iter().filter(|o| o.zone == l.zone && o.rate == l.rate).count() > 1 {
            let _ = write!(name, "-{}", i + 1);
        }
    }
    name
}

/// What the engine is asked for one limit of a request (`line`: its place
/// in the location's list): its zone, the zone's name as the key's
/// namespace, the key, the rate and the cost.
pub(super) fn ask<'a>(
    mcf: &'a MainConf,
    l: &Limit,
    line: u32,
    key: &'a [u8],
    rate: Rate,
    cost: u32,
) -> Ask<'a> {
    Ask {
        zone: l.zone,
        namespace: mcf.zones[l.zone].name.as_bytes(),
        zone_named: true,
        key,
        rate,
        cost,
        strict: Strict::Background,
        line,
        bucket: l.bucket,
    }
}
