//! Concurrency limits (`redis_ratelimit_conn`), as `limit_conn` keeps
//! them: once a request has passed its rate limits in the preaccess phase
//! it takes a slot of each zone's key, and gives them back when its main
//! request's pool goes (the response sent, the client gone, an error, a
//! timeout, an HTTP/2 stream reset: every ending frees the pool once). The
//! slots are counted in the zone's shared memory, so a node's workers
//! share them; a reload keeps them (the old workers' requests give theirs
//! back as they end).
//!
//! A request takes its slots once: an internal redirect (or an
//! `error_page`) runs the phase again and finds its slots taken (they hang
//! off the main request's pool, as a cleanup entry), and a subrequest
//! counts with its main request. A request that a limit refuses takes no
//! slot of any (the ones it took are given back at once); its rate limits
//! counted it already, as `limit_req` has by the time `limit_conn` runs.

use std::ffi::c_void;
use std::ptr;

use nginx_sys::{
    ngx_http_request_t, ngx_int_t, ngx_palloc, ngx_pool_cleanup_t, ngx_uint_t, NGX_DECLINED,
};
use ngx::http::{HttpModuleLocationConf, HttpModuleMainConf, Request};
use ngx::ngx_log_error;
use ratelimit_core::conn::{self, CONN_PERIOD};
use ratelimit_core::key::EntryId;
use ratelimit_core::stats::Stats;

use crate::conf::module::Module;
use crate::conf::{LocConf, MainConf};
use crate::http::{request_log, Failure};
use crate::shm::Shared;
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
/// the configuration, which outlives the request) and the key's entry.
#[derive(Clone, Copy)]
struct Slot {
    shared: *const Shared,
    id: EntryId,
}

/// A request's slots, with the cleanup entry that gives them back, in the
/// main request's pool.
#[repr(C)]
pub struct Held {
    cleanup: ngx_pool_cleanup_t,
    pub outcome: ConnOutcome,
    n: usize,
    slots: [Slot; MAX_CONNS],
}

/// The cleanup entry's handler: the request ended, its slots go back.
unsafe extern "C" fn give_back(data: *mut c_void) {
    // SAFETY: `data` is the `Held` this handler was registered with, in a
    // pool being destroyed; nothing else reads it any more.
    let held = unsafe { &mut *data.cast::<Held>() };
    release(held);
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
/// `NGX_DECLINED`) takes its slots, or is refused. Other answers go on as
/// they are.
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
        Some(c) if !c.is_empty() && held(r).is_none() => match take(r, mcf, lcf) {
            Ok(rc) => rc,
            Err(why) => crate::http::failed(r, why),
        },
        _ => rc,
    }
}

/// Takes a slot of each limit's key, or none when one is full.
fn take(r: &mut ngx_http_request_t, mcf: &MainConf, lcf: &LocConf) -> Result<ngx_int_t, Failure> {
    let held = hold(r)?;
    let now = now_ms();
    for c in lcf.conns.as_deref().unwrap_or_default().iter().take(MAX_CONNS) {
        let key = crate::http::values::key(r, mcf, c.zone)?;
        if key.is_empty() {
            continue;
        }
        let zone = mcf.zones.get(c.zone).ok_or(Failure::NoZone)?;
        let shared = zone.shared.as_ref().ok_or(Failure::NoZone)?;
        let id = shared.ids.id_in(shared.name, CONN_PERIOD, key);
        let taken = {
            let mut locked = shared.lock();
            let (i, _) = locked.table.get_or_insert(id, now);
            conn::take(locked.table.entry_mut(i), c.max)
        };
        if taken {
            Stats::bump(&shared.stats().conn_in_flight);
            held.slots[held.n] = Slot { shared, id };
            held.n += 1;
            continue;
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
        // SAFETY: the request is valid; `Request` is a transparent wrapper.
        let req = unsafe { Request::from_ngx_http_request(r) };
        // a slot frees when a request ends: a second is a hint, not a promise
        req.add_header_out("Retry-After", "1").ok_or(Failure::NoMemory)?;
        return crate::http::problem::reject(r, lcf, || vec![zone.name.clone()]);
    }
    Ok(NGX_DECLINED as ngx_int_t)
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
                slots: [Slot { shared: ptr::null(), id: EntryId([0, 0]) }; MAX_CONNS],
            },
        );
        (*pool).cleanup = ptr::addr_of_mut!((*held).cleanup);
        Ok(&mut *held)
    }
}
