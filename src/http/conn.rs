//! Concurrency limits (`redis_ratelimit_conn`), as `limit_conn` keeps
//! them: once a request has passed its rate limits in the preaccess phase
//! it takes a slot of each zone's key, and gives them back when its main
//! request's pool goes (the response sent, the client gone, an error, a
//! timeout, an HTTP/2 stream reset: every ending frees the pool once). The
//! slots are counted in the zone's shared memory, so a node's workers
//! share them; a reload keeps them (the old workers' requests give theirs
//! back as they end).
//!
//! On a zone with `redis=` the limit is the fleet's: a slot the node's
//! memory lets through is also taken of this worker's lease of the key in
//! Redis (`worker::holdings`, `conn_fleet`), without a round trip; when
//! the lease cannot be trusted (Redis down, not renewed), `on_error`
//! decides (`local`: the node's own count against the number, `share`:
//! against its part of it).
//!
//! A request takes its slots once: an internal redirect (or an
//! `error_page`) runs the phase again and finds its slots taken (they hang
//! off the main request's pool, as a cleanup entry), and a subrequest
//! counts with its main request. A request that a limit refuses takes no
//! slot of any (the ones it took are given back at once); its rate limits
//! counted it already, as `limit_req` has by the time `limit_conn` runs.

use std::ffi::c_void;
use std::fmt::Write;
use std::ptr;

use smallvec::SmallVec;

use nginx_sys::{
    ngx_http_request_t, ngx_int_t, ngx_palloc, ngx_pool_cleanup_t, ngx_uint_t, NGX_AGAIN,
    NGX_DECLINED, NGX_HTTP_INTERNAL_SERVER_ERROR,
};
use ngx::http::{HttpModuleLocationConf, HttpModuleMainConf, Request};
use ngx::ngx_log_error;
use ratelimit_core::conn::{self, CONN_PERIOD};
use ratelimit_core::conn_fleet::Take;
use ratelimit_core::key::EntryId;
use ratelimit_core::params::OnError;
use ratelimit_core::stats::Stats;
use ratelimit_core::text;

use crate::conf::module::Module;
use crate::conf::{LocConf, MainConf, HEADERS_ON};
use crate::engine;
use crate::http::{request_log, Failure};
use crate::shm::Shared;
use crate::worker::channel::channel;
use crate::worker::holdings;
use crate::worker::time::now_ms;

/// The most concurrency limits a request takes slots of.
pub const MAX_CONNS: usize = 8;

/// What the concurrency limits said of a request (`$redis_ratelimit_conn_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConnOutcome {
    Passed,
    Rejected,
    RejectedDryRun,
}

impl ConnOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            ConnOutcome::Passed => "PASSED",
            ConnOutcome::Rejected => "REJECTED",
            ConnOutcome::RejectedDryRun => "REJECTED_DRY_RUN",
        }
    }
}

/// One slot a request holds: the zone's shared memory (it lives as long as
/// the configuration, which outlives the request) and the key's entry;
/// on a zone with Redis, the zone's index (the slot is also this worker's
/// of the key's lease).
#[derive(Clone, Copy)]
struct Slot {
    shared: *const Shared,
    id: EntryId,
    fleet: Option<usize>,
}

/// A request's slots, with the cleanup entry that gives them back, in the
/// main request's pool.
#[repr(C)]
pub struct Held {
    cleanup: ngx_pool_cleanup_t,
    pub outcome: ConnOutcome,
    n: usize,
    slots: [Slot; MAX_CONNS],
    /// The key (zone, entry) whose lease it waits for (`holdings::take`'s
    /// `Take::Wait`), and when it stops waiting (ms, set by its first
    /// wait; 0: none yet): as long as the zone's `timeout=` in all, then
    /// `on_error` decides.
    waiting: Option<(usize, EntryId)>,
    deadline_ms: u64,
    /// The request that waits (the main request).
    r: *mut ngx_http_request_t,
}

/// The cleanup entry's handler: the request ended, its slots go back.
unsafe extern "C" fn give_back(data: *mut c_void) {
    // SAFETY: `data` is the `Held` this handler was registered with, in a
    // pool being destroyed; nothing else reads it any more.
    let held = unsafe { &mut *data.cast::<Held>() };
    release(held);
    if let Some((zone, entry)) = held.waiting.take() {
        holdings::unwait(zone, entry, held.r);
    }
}

/// Gives every slot of `held` back.
fn release(held: &mut Held) {
    for s in &held.slots[..std::mem::take(&mut held.n)] {
        // SAFETY: the zone's shared memory outlives every request of its
        // configuration (`Slot`).
        let shared = unsafe { &*s.shared };
        let mut locked = shared.lock();
        if let Some(i) = locked.table.find(s.id) {
            conn::give(locked.table.entry_mut(i));
        }
        drop(locked);
        Stats::unbump(&shared.stats().conn_in_flight);
        if let Some(zone) = s.fleet {
            holdings::give(zone, s.id);
        }
    }
}

/// The slots the request (its main request) holds, if it has taken them.
pub fn held(r: &ngx_http_request_t) -> Option<&Held> {
    // SAFETY: `r.main` and its pool are valid for the request's lifetime;
    // the cleanup list is only appended to, on this thread.
    unsafe {
        let mut c = (*(*r.main).pool).cleanup;
        while !c.is_null() {
            if (*c).handler.map(|h| h as *const () as usize)
                == Some(give_back as *const () as usize)
            {
                return (*c).data.cast::<Held>().as_ref();
            }
            c = (*c).next;
        }
    }
    None
}

/// After the rate limits: a request they let through (`rc`
/// `NGX_DECLINED`) takes its slots, or is refused, or waits (`NGX_AGAIN`)
/// for a lease of the fleet's slots. Other answers go on as they are.
pub fn after_rates(r: &mut ngx_http_request_t, rc: ngx_int_t) -> ngx_int_t {
    if rc != NGX_DECLINED as ngx_int_t {
        return rc;
    }
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let (Some(lcf), Some(mcf)) = (Module::location_conf(req), Module::main_conf(req)) else {
        return rc;
    };
    match lcf.conns.as_deref() {
        Some(c) if !c.is_empty() && held(r).is_none() => {
            match hold(r).and_then(|held| take(r, mcf, lcf, held)) {
                Ok(rc) => rc,
                Err(why) => crate::http::failed(r, why),
            }
        }
        _ => rc,
    }
}

/// What the fleet says of a slot the node's memory let through.
enum Fleet {
    Taken,
    Refused,
    Wait,
}

/// Takes a slot of each limit's key, or none when one is full; or waits
/// for a lease of one (holding none meanwhile).
fn take(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    held: &mut Held,
) -> Result<ngx_int_t, Failure> {
    let now = now_ms();
    let mut policies: SmallVec<[(&str, u32, u32); 2]> = SmallVec::new();
    for c in lcf.conns.as_deref().unwrap_or_default().iter().take(MAX_CONNS) {
        let key = crate::http::values::key(r, mcf, c.zone)?;
        if key.is_empty() {
            continue;
        }
        let zone = mcf.zones.get(c.zone).ok_or(Failure::NoZone)?;
        let shared = zone.shared.as_ref().ok_or(Failure::NoZone)?;
        let id = shared.ids.id_in(shared.name, CONN_PERIOD, key);
        let node = {
            let mut locked = shared.lock();
            let (i, _) = locked.table.get_or_insert(id, now);
            let e = locked.table.entry_mut(i);
            conn::take(e, c.max).then(|| conn::in_flight(e))
        };
        let redis = zone.params.as_ref().filter(|p| p.backend.is_some());
        let fleet = match (node, redis) {
            (None, _) => Fleet::Refused,
            (Some(_), None) => Fleet::Taken,
            (Some(node), Some(p)) => {
                let slot = holdings::Slot {
                    zone: c.zone,
                    name: zone.name.as_bytes(),
                    entry: id,
                    key,
                    max: c.max,
                    lease_ms: c.lease_ms,
                    strict: c.strict,
                };
                let may_wait = held.deadline_ms == 0 || now < held.deadline_ms;
                let f = fleet_take(r, mcf, &slot, p.on_error, node, may_wait);
                if !matches!(f, Fleet::Taken) {
                    let mut locked = shared.lock();
                    if let Some(i) = locked.table.find(id) {
                        conn::give(locked.table.entry_mut(i));
                    }
                }
                f
            }
        };
        match fleet {
            Fleet::Taken => {
                Stats::bump(&shared.stats().conn_in_flight);
                let fleet = redis.map(|_| c.zone);
                held.slots[held.n] = Slot { shared, id, fleet };
                held.n += 1;
                if lcf.headers == HEADERS_ON {
                    // what is left of the number, as this node sees it
                    let used = match fleet {
                        Some(z) => holdings::in_use(z, id).unwrap_or_default(),
                        None => node.unwrap_or_default(),
                    };
                    policies.push((zone.name.as_str(), c.max, c.max.saturating_sub(used)));
                }
                continue;
            }
            Fleet::Wait => {
                // its slots are taken again when it wakes
                release(held);
                held.waiting = Some((c.zone, id));
                if held.deadline_ms == 0 {
                    held.deadline_ms = now + redis.map_or(1000, |p| p.timeout_ms).max(1);
                }
                held.r = r;
                crate::http::delay::park(r, resume, held.deadline_ms.saturating_sub(now))?;
                return Ok(NGX_AGAIN as ngx_int_t);
            }
            Fleet::Refused => {}
        }
        release(held);
        let dry_run = lcf.dry_run == 1;
        ngx_log_error!(
            lcf.log_level as ngx_uint_t,
            request_log(r),
            "limiting connections{} by zone \"{}\"",
            if dry_run { ", dry run," } else { "" },
            zone.name
        );
        let st = shared.stats();
        Stats::bump(if dry_run { &st.conn_rejected_dry_run } else { &st.conn_rejected });
        if dry_run {
            held.outcome = ConnOutcome::RejectedDryRun;
            return Ok(NGX_DECLINED as ngx_int_t);
        }
        held.outcome = ConnOutcome::Rejected;
        policies.push((zone.name.as_str(), c.max, 0));
        conn_headers(r, lcf, &policies)?;
        // SAFETY: the request is valid; `Request` is a transparent wrapper.
        let req = unsafe { Request::from_ngx_http_request(r) };
        // a slot frees when a request ends: a second is a hint, not a promise
        req.add_header_out("Retry-After", "1").ok_or(Failure::NoMemory)?;
        return crate::http::problem::reject(r, lcf, || vec![zone.name.clone()]);
    }
    conn_headers(r, lcf, &policies)?;
    Ok(NGX_DECLINED as ngx_int_t)
}

/// With `redis_ratelimit_headers on`, a concurrency limit's policy and
/// what is left of it (draft-ietf-httpapi-ratelimit-headers-11's
/// `qu="concurrent-requests"`), one member per limit (zone, number,
/// remaining), named `"<zone>-conn"` (apart from the zone's rate limits),
/// in header lines of their own beside the rate limits'.
fn conn_headers(
    r: &mut ngx_http_request_t,
    lcf: &LocConf,
    policies: &[(&str, u32, u32)],
) -> Result<(), Failure> {
    if lcf.headers != HEADERS_ON || policies.is_empty() {
        return Ok(());
    }
    let (mut policy, mut state) = (String::new(), String::new());
    for (i, (zone, max, left)) in policies.iter().enumerate() {
        if i > 0 {
            policy.push_str(", ");
            state.push_str(", ");
        }
        let name = text::sf_string(&format!("{zone}-conn"));
        let _ = write!(policy, "{name};q={max};qu=\"concurrent-requests\"");
        let _ = write!(state, "{name};r={left}");
    }
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    req.add_header_out("RateLimit-Policy", &policy).ok_or(Failure::NoMemory)?;
    req.add_header_out("RateLimit", &state).ok_or(Failure::NoMemory)?;
    Ok(())
}

/// The fleet's part of a slot the node's memory let through (`node` in
/// flight on the node with it): within this worker's lease of the key; a
/// main request with no lease to take of waits for Redis's answer (while
/// it `may_wait`); when the lease cannot be trusted (Redis down, not
/// renewed, or no answer within the wait), `on_error` decides.
fn fleet_take(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    slot: &holdings::Slot<'_>,
    on_error: OnError,
    node: u32,
    may_wait: bool,
) -> Fleet {
    let up = channel().is_some_and(|ch| engine::backend_up(mcf, ch, slot.zone));
    if up {
        let main = ptr::eq(r.main, r);
        let waiter = (main && may_wait).then_some(ptr::from_mut(r));
        match holdings::take(slot, waiter) {
            Take::Taken => return Fleet::Taken,
            Take::Full => return Fleet::Refused,
            Take::Wait if waiter.is_some() => return Fleet::Wait,
            Take::Wait | Take::Unsure => {}
        }
    }
    let ok = match on_error {
        // the node's own count, checked against the number already
        OnError::Local | OnError::Allow => true,
        OnError::Deny => false,
        OnError::Share => {
            let nodes = engine::fleet_nodes(mcf, slot.zone).max(1);
            node <= (slot.max / nodes).max(1)
        }
    };
    if ok {
        holdings::take_unsure(slot);
        Fleet::Taken
    } else {
        Fleet::Refused
    }
}

/// The write event handler of a request waiting for a lease: answered
/// (posted) or timed out, it takes its slots again (or waits again, until
/// its deadline: then `on_error` decides) and goes on to the next phase,
/// or is refused.
unsafe extern "C" fn resume(r: *mut ngx_http_request_t) {
    // SAFETY: nginx passes the request whose event fired.
    if !unsafe { crate::http::delay::unpark(r) } {
        return;
    }
    // SAFETY: the request is alive (its event fired).
    let r = unsafe { &mut *r };
    let rc = resumed(r);
    crate::http::delay::go_on(r, rc);
}

/// A waiting request's slots, taken again.
fn resumed(r: &mut ngx_http_request_t) -> ngx_int_t {
    let held = held(r).map(|h| ptr::from_ref(h).cast_mut());
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let (Some(lcf), Some(mcf), Some(held)) =
        (Module::location_conf(req), Module::main_conf(req), held)
    else {
        return NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t;
    };
    // SAFETY: the `Held` lives in the main request's pool, as long as the
    // request; nothing else holds a reference to it now.
    let held = unsafe { &mut *held };
    if let Some((zone, entry)) = held.waiting.take() {
        holdings::unwait(zone, entry, held.r);
    }
    match take(r, mcf, lcf, held) {
        Ok(rc) => rc,
        Err(why) => crate::http::failed(r, why),
    }
}

/// The request's `Held`, new in its main request's pool, with no slot yet.
fn hold<'a>(r: &ngx_http_request_t) -> Result<&'a mut Held, Failure> {
    // SAFETY: allocates from the main request's pool (aligned for
    // pointers, as nginx's own cleanup entries are) and links the entry
    // into its cleanup list as `ngx_pool_cleanup_add` does; it lives as
    // long as the request, and its handler runs once, when the pool goes.
    unsafe {
        let pool = (*r.main).pool;
        let held = ngx_palloc(pool, std::mem::size_of::<Held>()).cast::<Held>();
        if held.is_null() {
            return Err(Failure::NoMemory);
        }
        ptr::write(
            held,
            Held {
                cleanup: ngx_pool_cleanup_t {
                    handler: Some(give_back),
                    data: held.cast(),
                    next: (*pool).cleanup,
                },
                outcome: ConnOutcome::Passed,
                n: 0,
                waiting: None,
                deadline_ms: 0,
                r: ptr::null_mut(),
                slots: [Slot { shared: ptr::null(), id: EntryId([0, 0]), fleet: None }; MAX_CONNS],
            },
        );
        (*pool).cleanup = ptr::addr_of_mut!((*held).cleanup);
        Ok(&mut *held)
    }
}
