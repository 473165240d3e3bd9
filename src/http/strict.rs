//! Strict limits: the request waits for Redis's decision, the worker does
//! not. The preaccess handler first checks every limit against what this
//! node knows (a key known to be over its limit is answered at once, no
//! round trip), then sends the strict limits to Redis (`worker::link`) and
//! suspends the request (`NGX_AGAIN`, as `limit_req` does for a delay): a
//! timer of the zone's `timeout=` on its write event, the client watched
//! for closing meanwhile. The answer (from the worker's strict link or its
//! Redis thread), applied on the worker's own thread, posts the write
//! event; the handler runs again and decides every limit through the
//! engine with Redis's verdicts (a strict limit without one, after the
//! timeout or an error, is decided by `on_error`), except for a request of
//! one limit (below).
//!
//! A waiting request is found by its ticket in a list of this worker (the
//! worker's thread only); its place in the list goes with the request's
//! pool, so a client that closes while waiting leaves nothing behind, and
//! a late answer finds no one. A request of one limit is decided as
//! Redis's answer is applied, and answered when it wakes without its
//! handler running again (`answer_evaluated`).

use ratelimit_core::key::EntryId;
use std::ffi::c_void;
use std::ptr;

use nginx_sys::{
    ngx_add_timer, ngx_event_t, ngx_http_core_run_phases, ngx_http_finalize_request,
    ngx_http_post_request, ngx_http_request_empty_handler, ngx_http_request_t,
    ngx_http_run_posted_requests, ngx_int_t, ngx_pool_cleanup_add, NGX_AGAIN,
    NGX_HTTP_INTERNAL_SERVER_ERROR, NGX_OK,
};
use ngx::http::{HttpModule, HttpModuleLocationConf, HttpModuleMainConf, Request};
use ratelimit_core::batch::ItemId;
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Stats;
use ratelimit_core::strict::Kind;
use ratelimit_core::window::window_index;

use crate::backend::Channel;
use crate::conf::module::Module;
use crate::conf::{LocConf, MainConf, MAX_STRICT};
use crate::engine::{self, Ask, Strict, Take};
use crate::http::answer::{ask, debug_log, finish};
use crate::http::Failure;
use crate::worker::link;
use crate::worker::time::now_ms;
use crate::worker::waits::{self, OneLimit, Verdict, Wait};

/// The request's wait, through the module's context slot (set while it
/// waits and until the handler ran again).
fn ctx(r: &ngx_http_request_t) -> *mut Wait {
    let i = Module::module().ctx_index;
    // SAFETY: every request has a context array with a slot per module.
    unsafe { (*r.ctx.add(i)).cast::<Wait>() }
}

fn set_ctx(r: &mut ngx_http_request_t, w: *mut Wait) {
    let i = Module::module().ctx_index;
    // SAFETY: as in `ctx`.
    unsafe { *r.ctx.add(i) = w.cast::<c_void>() };
}

/// A waiting request's state, in its pool: its wait (first: the pool
/// cleanup, the waits' list and the request's context see a `Wait`) and,
/// for a request of one limit, that limit as the handler evaluated it, so
/// that the request is answered when it wakes without its handler
/// running again (`answer_evaluated`).
#[repr(C)]
struct PooledWait {
    wait: Wait,
    evaluated: Option<Evaluated>,
}

/// One limit as evaluated: its `redis_ratelimit` line, its key (the
/// bytes in the request's memory, which live as long as the request),
/// rate and cost.
#[derive(Clone, Copy)]
struct Evaluated {
    line: u32,
    key: *const u8,
    key_len: usize,
    rate: Rate,
    cost: u32,
}

/// Decides a request with limits Redis decides (those not
/// `Strict::Background`); out of line, so that the handler's path without
/// them stays small. The
/// steps: a woken request is answered from Redis's verdicts (`woken`);
/// else each strict limit is asked of Redis if its backend is up (else
/// `on_error` decides it), what this node knows decides first (a key over
/// its limit needs no round trip), and the request waits (`wait`).
#[inline(never)]
pub(super) fn limit(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    asks: &mut [Ask<'_>],
) -> Result<ngx_int_t, Failure> {
    let w = ctx(r);
    if !w.is_null() {
        set_ctx(r, ptr::null_mut());
        // SAFETY: the wait lives in the request's pool until the request ends.
        return woken(r, mcf, lcf, asks, unsafe { &*w });
    }
    // without a thread for the zone, or a backend down, a strict limit is
    // decided by `on_error` at once
    let channel = crate::worker::channel::channel();
    let mut asking = 0;
    for a in asks.iter_mut().filter(|a| a.strict != Strict::Background) {
        if channel.is_some_and(|ch| engine::backend_up(mcf, ch, a.zone)) {
            a.strict = Strict::Asking;
            asking += 1;
        } else {
            a.strict = Strict::Failed;
        }
    }
    let Some(ch) = channel.filter(|_| asking > 0) else {
        return decide(r, mcf, lcf, asks, Take::IfAllowed);
    };
    // what this node knows first
    let now = now_ms();
    let (one, many);
    let (d, ids): (_, &[EntryId]) = if let [a] = &*asks {
        let (d, id) = engine::check_one(mcf, a, now, debug_log(r))?;
        one = [id];
        (d, &one)
    } else {
        let (d, i) = engine::decide_with_ids(mcf, asks, now, Take::Never, debug_log(r))?;
        many = i;
        (d, &many)
    };
    if !d.allowed {
        return finish(r, mcf, lcf, now, asks, &d);
    }
    if let ([a], Some(b)) = (&mut *asks, d.checked.bucket) {
        // a `strict` line is decided in Redis whatever the level
        let strict_line = lcf.limits.as_deref().and_then(|ls| ls.get(a.line as usize));
        if b.local && !strict_line.is_some_and(|l| l.strict) {
            // a fleet's bucket far from its burst: decided here, what the
            // node owes Redis sent without a wait (`bucket::fleet`)
            a.strict = Strict::CountOnly;
            return decide(r, mcf, lcf, asks, Take::IfAllowed);
        }
        if let Some(&id) = ids.first() {
            // what the node owes goes ahead of the request, in its call
            let owed = engine::take_owed(mcf, a, id, now);
            if owed > 0 {
                crate::engine::owe(a, id, owed);
            }
        }
    }
    wait(r, mcf, ch, asks, ids, now)
}

/// A request woken with Redis's verdicts (or none, after the timeout):
/// answered as decided when Redis's answer was applied (a request of one
/// limit), or decided now with them.
fn woken(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    asks: &mut [Ask<'_>],
    wait: &Wait,
) -> Result<ngx_int_t, Failure> {
    if let (Some(d), [a]) = (wait.decided, &mut *asks) {
        a.strict = if d.allowed { Strict::Allowed } else { Strict::Rejected };
        engine::trace_answered(debug_log(r), mcf, a, &d);
        return finish(r, mcf, lcf, now_ms(), asks, &d);
    }
    let mut k = 0;
    for a in asks.iter_mut().filter(|a| a.strict != Strict::Background) {
        a.strict = match wait.verdicts[k] {
            Verdict::Allowed => Strict::Allowed,
            Verdict::Rejected => Strict::Rejected,
            Verdict::NotAsked | Verdict::Waiting | Verdict::Failed => Strict::Failed,
        };
        k += 1;
    }
    // a wait that ended without Redis's decision (timeout=, a failed
    // exchange, an error reply)
    if wait.verdicts[..k].iter().any(|v| matches!(v, Verdict::Waiting | Verdict::Failed)) {
        count_undecided(mcf, asks);
    }
    decide(r, mcf, lcf, asks, Take::IfAllowed)
}

/// Makes the request wait for Redis's verdicts on the limits it asks
/// (`Strict::Asking`), as long as its slowest zone's timeout= (past it,
/// `on_error` decides, and a script that runs later counts nothing), and
/// sends them down the worker's strict link.
fn wait(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    ch: &Channel,
    asks: &[Ask<'_>],
    ids: &[EntryId],
    now: u64,
) -> Result<ngx_int_t, Failure> {
    let mut verdicts = [Verdict::NotAsked; MAX_STRICT];
    let (mut timeout, mut sent, mut k) = (0, 0u8, 0);
    for a in asks.iter().filter(|a| a.strict != Strict::Background) {
        k += 1;
        if a.strict != Strict::Asking || k > verdicts.len() {
            continue; // decided by `on_error`
        }
        let z = mcf.zones.get(a.zone).filter(|z| z.shared.is_some()).ok_or(Failure::NoZone)?;
        timeout = z.params.as_ref().map_or(timeout, |p| timeout.max(p.timeout_ms));
        verdicts[k - 1] = Verdict::Waiting;
        sent += 1;
    }
    let one_limit = asks.len() == 1 && sent == 1;
    let evaluated = one_limit.then(|| Evaluated {
        line: asks[0].line,
        key: asks[0].key.as_ptr(),
        key_len: asks[0].key.len(),
        rate: asks[0].rate,
        cost: asks[0].cost,
    });
    let awaiting = Awaiting {
        verdicts,
        waiting: sent,
        one_limit: one_limit.then(|| OneLimit {
            cost: asks[0].cost,
            bucket: asks[0].bucket,
            decide: engine::answered,
        }),
    };
    let wait = suspend(r, awaiting, evaluated, timeout)?;
    let base = waits::register(wait);
    let deadline_ms = now + timeout.max(1);
    let mut k = 0;
    for (i, a) in asks.iter().enumerate() {
        if a.strict == Strict::Background {
            continue;
        }
        k += 1;
        let Some(&entry) = ids.get(i) else {
            continue;
        };
        if verdicts.get(k - 1) != Some(&Verdict::Waiting) {
            continue;
        }
        if let Some(shared) = mcf.zones.get(a.zone).and_then(|z| z.shared.as_ref()) {
            Stats::bump(&shared.stats().strict_waits);
        }
        let ask = link::Ask {
            ticket: base.for_limit((k - 1) as u64),
            id: ItemId {
                zone: a.zone as u32,
                entry,
                // a bucket has no window
                window: if a.bucket.is_some() { 0 } else { window_index(now, a.rate.period_ms()) },
            },
            namespace: a.namespace,
            key: a.key,
            period: a.rate.period,
            limit: a.rate.limit,
            kind: Kind::of_burst(a.bucket.map(|b| b.burst)),
            cost: a.cost,
            deadline_ms,
        };
        link::send_one(ch, &ask);
    }
    Ok(NGX_AGAIN as ngx_int_t)
}

fn decide(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    asks: &[Ask<'_>],
    take: Take,
) -> Result<ngx_int_t, Failure> {
    let now = now_ms();
    let d = engine::decide(mcf, asks, now, take, debug_log(r))?;
    finish(r, mcf, lcf, now, asks, &d)
}

/// Counts a wait that ended without Redis's decision, in each strict zone.
#[cold]
fn count_undecided(mcf: &MainConf, asks: &[Ask<'_>]) {
    for a in asks.iter().filter(|a| a.strict != Strict::Background) {
        if let Some(s) = mcf.zones.get(a.zone).and_then(|z| z.shared.as_ref()) {
            Stats::bump(&s.stats().strict_timeouts);
        }
    }
}

/// What a request waits for: a verdict per strict limit (`Waiting` for
/// those sent), how many are sent, and for a request of one limit what
/// decides it as the answer is applied.
struct Awaiting {
    verdicts: [Verdict; MAX_STRICT],
    waiting: u8,
    one_limit: Option<OneLimit>,
}

/// Makes the request wait: its wait in the pool (taken out of the list
/// with it), the handlers `limit_req` uses for a delay, the timer.
fn suspend(
    r: &mut ngx_http_request_t,
    awaiting: Awaiting,
    evaluated: Option<Evaluated>,
    timeout_ms: u64,
) -> Result<*mut Wait, Failure> {
    let sub = !ptr::eq(r.main, r);
    // SAFETY: allocates from the request's pool; the cleanup runs when the
    // pool is destroyed (the request ends, however it ends). `PooledWait`
    // starts with its `Wait` (`repr(C)`), which is what the cleanup gets.
    // Each field is written where it lives, except a main request's
    // `Wait::ev` (left uninitialised: a subrequest's only).
    let w = unsafe {
        let c = ngx_pool_cleanup_add(r.pool, std::mem::size_of::<PooledWait>());
        if c.is_null() {
            return Err(Failure::NoMemory);
        }
        let s = (*c).data.cast::<PooledWait>();
        let w = s.cast::<Wait>();
        ptr::addr_of_mut!((*w).r).write(ptr::from_mut(r));
        ptr::addr_of_mut!((*w).base).write(waits::NO_TICKET);
        ptr::addr_of_mut!((*w).verdicts).write(awaiting.verdicts);
        ptr::addr_of_mut!((*w).waiting).write(awaiting.waiting);
        ptr::addr_of_mut!((*w).sub).write(sub);
        ptr::addr_of_mut!((*w).listed).write(false);
        ptr::addr_of_mut!((*w).one_limit).write(awaiting.one_limit);
        ptr::addr_of_mut!((*w).decided).write(None);
        ptr::addr_of_mut!((*s).evaluated).write(evaluated);
        (*c).handler = Some(waits::forget);
        w
    };
    set_ctx(r, w);
    if sub {
        // SAFETY: the wait lives in the request's pool (its cleanup deletes
        // the event's timer and posting); the connection's log outlives it.
        // An all-zero event is nginx's idle event (as `ngx_pcalloc` gives).
        unsafe {
            let ev = (*w).ev.as_mut_ptr();
            ev.write_bytes(0, 1);
            (*ev).handler = Some(wake_sub);
            (*ev).data = w.cast::<c_void>();
            (*ev).log = (*r.connection).log;
            ngx_add_timer(ev, timeout_ms.max(1) as _);
        }
        r.write_event_handler = Some(ngx_http_request_empty_handler);
        return Ok(w);
    }
    crate::http::delay::park(r, wake, timeout_ms)?;
    Ok(w)
}

/// A waiting subrequest's own event: answered (posted by `resolve`) or
/// timed out. It runs the subrequest's phases again as nginx runs
/// subrequests: posted to its main request, then the posted requests of
/// the connection run.
unsafe extern "C" fn wake_sub(ev: *mut ngx_event_t) {
    // SAFETY: our event, whose data is the wait in the subrequest's pool.
    unsafe {
        let w = (*ev).data.cast::<Wait>();
        let r = (*w).r;
        if (*ev).timedout() != 0 {
            (*ev).set_timedout(0);
            waits::unregister(w);
        }
        (*r).write_event_handler = Some(ngx_http_core_run_phases);
        let c = (*r).connection;
        if ngx_http_post_request(r, ptr::null_mut()) != NGX_OK as ngx_int_t {
            ngx_http_finalize_request(r, NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t);
        }
        ngx_http_run_posted_requests(c);
    }
}

/// The write event handler of a waiting request: answered (posted) or
/// timed out (the timer), it runs the phases again; a write event while it
/// still waits is only re-armed.
unsafe extern "C" fn wake(r: *mut ngx_http_request_t) {
    // SAFETY: nginx passes the request whose event fired.
    if !unsafe { crate::http::delay::unpark(r) } {
        return;
    }
    // SAFETY: the request is alive (its event fired).
    let r = unsafe { &mut *r };
    let w = ctx(r);
    if !w.is_null() {
        waits::unregister(w);
        if let Some(rc) = answer_evaluated(r, w) {
            // a request the rates let through takes its slots
            let rc = crate::http::conn::after_rates(r, rc);
            crate::http::delay::go_on(r, rc);
            return;
        }
    }
    // SAFETY: as above.
    unsafe { ngx_http_core_run_phases(r) };
}

/// A woken request of one limit that Redis decided, answered with the
/// decision made as the answer was applied and the limit the handler
/// evaluated (`None`: its handler runs again, and decides).
fn answer_evaluated(r: &mut ngx_http_request_t, w: *mut Wait) -> Option<ngx_int_t> {
    // SAFETY: every wait is a `PooledWait`'s (`suspend`), alive in the
    // request's pool.
    let (d, k) = unsafe {
        let s = &*w.cast::<PooledWait>();
        (s.wait.decided?, s.evaluated?)
    };
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let lcf = Module::location_conf(req)?;
    let mcf = Module::main_conf(req)?;
    let l = lcf.limits.as_deref()?.get(k.line as usize)?;
    // SAFETY: the key's bytes are in the request's memory (`Evaluated`).
    let key = unsafe { std::slice::from_raw_parts(k.key, k.key_len) };
    let mut asks = [ask(mcf, l, k.line, key, k.rate, k.cost)];
    asks[0].strict = if d.allowed { Strict::Allowed } else { Strict::Rejected };
    set_ctx(r, ptr::null_mut());
    engine::trace_answered(debug_log(r), mcf, &asks[0], &d);
    Some(
        finish(r, mcf, lcf, now_ms(), &asks, &d)
            .unwrap_or(NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t),
    )
}
