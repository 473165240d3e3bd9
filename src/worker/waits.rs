//! Strict requests that wait, by ticket: a map of this worker's waiting
//! requests (the worker's thread only), and how Redis's answers wake them.
//! `strict.rs` suspends a request and registers its wait here; an answer
//! (from the thread, or from the worker's own link) resolves tickets; the
//! wait's pool cleanup takes it out, so a late answer finds no one.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::ffi::c_void;
use std::hash::BuildHasherDefault;
use std::ptr;

use nginx_sys::{
    ngx_del_timer, ngx_delete_posted_event, ngx_event_t, ngx_http_request_t, ngx_post_event,
    ngx_posted_events,
};
use ratelimit_core::batch::ItemHasher;

use crate::conf::MAX_STRICT;

/// What Redis said for one strict limit of a waiting request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Not sent (backend down, no thread): `on_error` decides, no wait.
    NotAsked,
    Waiting,
    Allowed,
    Rejected,
    /// No decision: the exchange failed or Redis refused the call.
    Failed,
}

/// A suspended request, in its pool.
pub(crate) struct Wait {
    pub(crate) r: *mut ngx_http_request_t,
    /// Its tickets are `base | i` for its strict limits `i`.
    pub(crate) base: u64,
    pub(crate) verdicts: [Verdict; MAX_STRICT],
    pub(crate) waiting: u8,
    /// A subrequest's own event (its timer, and what wakes it): a
    /// subrequest shares its connection's write event with the main
    /// request and its other subrequests, so it is woken as nginx wakes
    /// subrequests, as a posted request (`strict.rs`). Unused (all zero)
    /// for a main request, which waits on its connection's write event as
    /// `limit_req` does.
    pub(crate) ev: ngx_event_t,
    pub(crate) sub: bool,
    /// In the map (from `register` until an answer, a timeout or its
    /// cleanup takes it out): only then is there anything to remove.
    pub(crate) listed: bool,
}

thread_local! {
    /// Waiting requests by ticket base (this worker's thread only).
    /// Tickets are sequential: one multiply per key (`ItemHasher`).
    static WAITS: RefCell<HashMap<u64, *mut Wait, BuildHasherDefault<ItemHasher>>> =
        RefCell::new(HashMap::default());
    static NEXT: Cell<u64> = const { Cell::new(1) };
}

/// The pool cleanup of a wait: the request ended (answered, or its client
/// went away): a late answer must not find it.
pub(crate) unsafe extern "C" fn forget(data: *mut c_void) {
    let w = data.cast::<Wait>();
    unregister(w);
    // SAFETY: the wait's own event, if it is a subrequest's: neither its
    // timer nor its posting may outlive the pool it lives in.
    unsafe {
        if (*w).sub {
            let ev = ptr::addr_of_mut!((*w).ev);
            if (*ev).timer_set() != 0 {
                ngx_del_timer(ev);
            }
            if (*ev).posted() != 0 {
                ngx_delete_posted_event(ev);
            }
        }
    }
}

/// Redis's answer for some tickets (`None`: no answer); a request with all
/// its verdicts is woken. Worker thread only.
pub fn resolve(tickets: &[u64], allowed: Option<&[Option<bool>]>) {
    for (i, &t) in tickets.iter().enumerate() {
        let Some(w) = WAITS.with(|m| m.borrow().get(&(t & !LIMIT_MASK)).copied()) else {
            continue; // gone (closed, timed out)
        };
        // SAFETY: a wait in the map is alive (its cleanup removes it).
        let wait = unsafe { &mut *w };
        let k = (t & LIMIT_MASK) as usize;
        if wait.verdicts[k] != Verdict::Waiting {
            continue;
        }
        // no flag: no answer, or the script ran after the deadline
        wait.verdicts[k] = match allowed.and_then(|a| a.get(i)).copied().flatten() {
            Some(true) => Verdict::Allowed,
            Some(false) => Verdict::Rejected,
            None => Verdict::Failed,
        };
        wait.waiting = wait.waiting.saturating_sub(1);
        if wait.waiting == 0 {
            WAITS.with(|m| m.borrow_mut().remove(&wait.base));
            wait.listed = false;
            if wait.sub {
                // SAFETY: the wait (and its event) is alive while it is in
                // the map; posted, it runs in this event loop's turn.
                unsafe {
                    let ev = ptr::addr_of_mut!(wait.ev);
                    if (*ev).timer_set() != 0 {
                        ngx_del_timer(ev);
                    }
                    ngx_post_event(ev, ptr::addr_of_mut!(ngx_posted_events));
                }
                continue;
            }
            // SAFETY: the request is alive while its wait is; its write
            // event is posted to run `wake` in this event loop's turn.
            unsafe {
                let wev = (*(*wait.r).connection).write;
                (*wev).set_delayed(0);
                if (*wev).timer_set() != 0 {
                    ngx_del_timer(wev);
                }
                ngx_post_event(wev, ptr::addr_of_mut!(ngx_posted_events));
            }
        }
    }
}

/// The ticket of a call no request waits for (a count after the
/// response): never a wait's (`next_base` starts at 1).
pub const NO_TICKET: u64 = 0;

/// A ticket's low bits say which of its request's strict limits it is for.
const LIMIT_BITS: u32 = MAX_STRICT.trailing_zeros();
const LIMIT_MASK: u64 = MAX_STRICT as u64 - 1;
const _: () = assert!(MAX_STRICT.is_power_of_two());

/// A fresh ticket base for a request's strict limits (`base | i`).
pub fn next_base() -> u64 {
    NEXT.with(|n| {
        let v = n.get();
        n.set(v + 1);
        v << LIMIT_BITS
    })
}

/// Lists a wait (in its request's pool) under its tickets' base.
pub(crate) fn register(wait: *mut Wait) {
    // SAFETY: a wait just written in its request's pool (`suspend`).
    let w = unsafe { &mut *wait };
    WAITS.with(|m| m.borrow_mut().insert(w.base, wait));
    w.listed = true;
}

/// Takes a wait out of the map, if it is still there.
pub(crate) fn unregister(wait: *mut Wait) {
    // SAFETY: a wait in its request's pool, alive until its cleanup
    // (which calls this) has run.
    let w = unsafe { &mut *wait };
    if w.listed {
        WAITS.with(|m| m.borrow_mut().remove(&w.base));
        w.listed = false;
    }
}
