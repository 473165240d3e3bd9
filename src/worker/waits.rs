//! Strict requests that wait, by ticket: a list of this worker's waiting
//! requests (the worker's thread only), and how Redis's answers wake them.
//! `strict.rs` suspends a request and registers its wait here; an answer
//! (from the thread, or from the worker's own link) resolves tickets; the
//! wait's pool cleanup takes it out, so a late answer finds no one.

use std::cell::RefCell;
use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::ptr;

use nginx_sys::{
    ngx_del_timer, ngx_delete_posted_event, ngx_event_t, ngx_http_request_t, ngx_post_event,
    ngx_posted_events,
};
use ratelimit_core::bucket::Bucket;
use ratelimit_core::decide::Decision;
use ratelimit_core::rate::Rate;
use ratelimit_core::table::Entry;
use ratelimit_core::tickets::Tickets;

use crate::conf::{MainConf, MAX_STRICT};

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
    /// Its tickets are `base.for_limit(i)` for its strict limits `i`.
    pub(crate) base: Ticket,
    pub(crate) verdicts: [Verdict; MAX_STRICT],
    pub(crate) waiting: u8,
    /// A subrequest's own event (its timer, and what wakes it): a
    /// subrequest shares its connection's write event with the main
    /// request and its other subrequests, so it is woken as nginx wakes
    /// subrequests, as a posted request (`strict.rs`). Uninitialised for a
    /// main request (`sub` false), which waits on its connection's write
    /// event as `limit_req` does.
    pub(crate) ev: MaybeUninit<ngx_event_t>,
    pub(crate) sub: bool,
    /// Listed (from `register` until an answer, a timeout or its cleanup
    /// takes it out): only then is there anything to remove.
    pub(crate) listed: bool,
    /// A request whose one limit Redis decides: its decision is made as
    /// Redis's answer is applied (`decided`), on the entry the answer was
    /// applied to.
    pub(crate) one_limit: Option<OneLimit>,
    pub(crate) decided: Option<Decision>,
}

/// What makes the decision of a request of one limit with Redis's
/// verdict: the request's cost, and the engine's function (from the
/// layer above: `engine::answered`).
#[derive(Clone, Copy)]
pub(crate) struct OneLimit {
    pub(crate) cost: u32,
    pub(crate) bucket: Option<Bucket>,
    pub(crate) decide: Answered,
}

/// A request's one limit as Redis answered it: its zone, rate and cost,
/// and whether Redis allowed it.
#[derive(Clone, Copy)]
pub(crate) struct LimitVerdict {
    pub(crate) zone: usize,
    pub(crate) rate: Rate,
    pub(crate) cost: u32,
    pub(crate) bucket: Option<Bucket>,
    pub(crate) allowed: bool,
}

/// `engine::answered`: (configuration, the key's entry with Redis's
/// counts, the verdict, now) to the request's decision.
pub(crate) type Answered = fn(&MainConf, &mut Entry, LimitVerdict, u64) -> Decision;

thread_local! {
    /// This worker's waiting requests (its thread only).
    static WAITS: RefCell<Tickets<*mut Wait>> = const { RefCell::new(Tickets::new(LIMIT_BITS)) };
}

/// The pool cleanup of a wait: the request ended (answered, or its client
/// went away): a late answer must not find it.
pub(crate) unsafe extern "C" fn forget(data: *mut c_void) {
    let w = data.cast::<Wait>();
    unregister(w);
    // SAFETY: the wait's own event, if it is a subrequest's (initialised
    // then): neither its timer nor its posting may outlive the pool it
    // lives in.
    unsafe {
        if (*w).sub {
            let ev = (*w).ev.as_mut_ptr();
            if (*ev).timer_set() != 0 {
                ngx_del_timer(ev);
            }
            if (*ev).posted() != 0 {
                ngx_delete_posted_event(ev);
            }
        }
    }
}

/// Redis's answer for some tickets (`allowed(i)` for the `i`-th: `None`,
/// no decision); a request with all its verdicts is woken.
/// `decide(one_limit, allowed)` makes the decision of a request of one limit
/// (`Wait::one_limit`) that Redis decided. Worker thread only.
pub fn resolve(
    tickets: impl Iterator<Item = Ticket>,
    allowed: impl Fn(usize) -> Option<bool>,
    mut decide: impl FnMut(&OneLimit, bool) -> Option<Decision>,
) {
    WAITS.with(|m| {
        let mut m = m.borrow_mut();
        for (i, t) in tickets.enumerate() {
            let Some(w) = m.get(t) else {
                continue; // gone (closed, timed out)
            };
            // SAFETY: a listed wait is alive (its cleanup takes it out).
            let wait = unsafe { &mut *w };
            let k = (t.0 & LIMIT_MASK) as usize;
            if wait.verdicts[k] != Verdict::Waiting {
                continue;
            }
            // no flag: no answer, or the script ran after the deadline
            wait.verdicts[k] = match allowed(i) {
                Some(true) => Verdict::Allowed,
                Some(false) => Verdict::Rejected,
                None => Verdict::Failed,
            };
            wait.waiting = wait.waiting.saturating_sub(1);
            if wait.waiting == 0 {
                m.remove(wait.base);
                wait.listed = false;
                if let (Some(one_limit), Verdict::Allowed | Verdict::Rejected) =
                    (&wait.one_limit, wait.verdicts[k])
                {
                    wait.decided = decide(one_limit, wait.verdicts[k] == Verdict::Allowed);
                }
                wake(wait);
            }
        }
    });
}

/// Posts the event that runs a request's phases again (nothing here
/// touches the waits).
fn wake(wait: &mut Wait) {
    if wait.sub {
        // SAFETY: the wait (and its event, initialised for a subrequest)
        // is alive until its pool's cleanup; posted, it runs in this event
        // loop's turn.
        unsafe {
            let ev = wait.ev.as_mut_ptr();
            if (*ev).timer_set() != 0 {
                ngx_del_timer(ev);
            }
            ngx_post_event(ev, ptr::addr_of_mut!(ngx_posted_events));
        }
        return;
    }
    // SAFETY: the request is alive while its wait is; its write event is
    // posted to run `wake` in this event loop's turn.
    unsafe {
        let wev = (*(*wait.r).connection).write;
        (*wev).set_delayed(0);
        if (*wev).timer_set() != 0 {
            ngx_del_timer(wev);
        }
        ngx_post_event(wev, ptr::addr_of_mut!(ngx_posted_events));
    }
}

/// The ticket of a call no request waits for (a count after the
/// response): never a wait's.
pub use ratelimit_core::tickets::{Ticket, NO_TICKET};

/// A ticket's low bits say which of its request's strict limits it is for.
const LIMIT_BITS: u32 = MAX_STRICT.trailing_zeros();
const LIMIT_MASK: u64 = MAX_STRICT as u64 - 1;
const _: () = assert!(MAX_STRICT.is_power_of_two());

/// Lists a wait (in its request's pool): its tickets are `base.for_limit(i)`.
/// Returns the base.
pub(crate) fn register(wait: *mut Wait) -> Ticket {
    let base = WAITS.with(|m| m.borrow_mut().insert(wait));
    // SAFETY: a wait just written in its request's pool (`suspend`).
    let w = unsafe { &mut *wait };
    w.base = base;
    w.listed = true;
    base
}

/// Takes a wait out of the list, if it is still there.
pub(crate) fn unregister(wait: *mut Wait) {
    // SAFETY: a wait in its request's pool, alive until its cleanup
    // (which calls this) has run.
    let w = unsafe { &mut *wait };
    if w.listed {
        WAITS.with(|m| m.borrow_mut().remove(w.base));
        w.listed = false;
    }
}
