//! Concurrency limits across the fleet, this worker's part: the keys of
//! Redis zones it holds slots of, each with its lease in Redis
//! (`conn_fleet::Holding`: the worker is one holder), asked for and
//! renewed down the zone's strict link (`link::send_conn`). A timer
//! renews every lease a third of the way through it and forgets keys
//! that are idle; a lease given back or never renewed (the worker gone)
//! ends in Redis by itself.
//!
//! The worker's thread only: requests take and give slots, the link's
//! answers (or the thread's) are applied here, on the event loop.

use std::cell::RefCell;
use std::ptr;

use nginx_sys::{ngx_add_timer, ngx_cycle, ngx_event_t, ngx_exiting, ngx_http_request_t};
use ratelimit_core::batch::{ItemId, ItemMap};
use ratelimit_core::conn_fleet::Take;
use ratelimit_core::key::EntryId;

use crate::worker::link;
use crate::worker::time::now_ms;

pub mod state;

use state::{Held, HOLDINGS};

/// How often the timer looks for leases to renew and keys to forget.
const TICK_MS: u64 = 250;

thread_local! {
    /// The renewal timer (never freed: nginx's timer tree may point at it).
    static TICK: RefCell<*mut ngx_event_t> = const { RefCell::new(ptr::null_mut()) };
}

/// A concurrency limit's key, as a request takes its slot.
pub struct Slot<'a> {
    pub zone: usize,
    pub name: &'a [u8],
    pub entry: EntryId,
    pub key: &'a [u8],
    pub max: u32,
    pub lease_ms: u32,
    pub strict: bool,
}

impl Slot<'_> {
    fn item(&self) -> ItemId {
        ItemId { zone: self.zone as u32, entry: self.entry, window: 0 }
    }
}

/// The slot's key in the map (new if it has none), with its line's
/// number, lease and `strict`.
fn held_for<'m>(m: &'m mut ItemMap<Held>, s: &Slot<'_>) -> &'m mut Held {
    let held = state::held(m, s.item(), s.name, s.key);
    held.max = s.max;
    held.lease_ms = s.lease_ms;
    held.h.strict = s.strict;
    held
}

/// Takes a slot of the key for a request, within this worker's lease;
/// asks Redis for more ahead of need. A request with no lease to take of
/// (`Take::Wait`) waits for the answer to the ask if `waiter` is given
/// (its write event is posted then: `state::answered`).
pub fn take(s: &Slot<'_>, waiter: Option<*mut ngx_http_request_t>) -> Take {
    let taken = HOLDINGS.with(|m| {
        let mut m = m.borrow_mut();
        let held = held_for(&mut m, s);
        let t = held.h.take(s.max, u64::from(s.lease_ms), now_ms());
        let ask = match t {
            Take::Taken => held.h.ask_after_take(s.max),
            Take::Wait => {
                held.waiters.extend(waiter);
                held.h.waiting = held.waiters.len() as u32;
                !held.h.asked
            }
            Take::Full | Take::Unsure => false,
        };
        if ask {
            send(s.item(), held);
        }
        t
    });
    tick_soon();
    taken
}

/// The key's slots in use across the fleet, as this worker last learnt
/// them (the other leases at its last answer, and its own in use).
pub fn in_use(zone: usize, entry: EntryId) -> Option<u32> {
    let item = ItemId { zone: zone as u32, entry, window: 0 };
    HOLDINGS.with(|m| m.borrow().get(&item).map(|held| held.h.others.saturating_add(held.h.mine)))
}

/// A waiting request is gone (it ended, or its wait did).
pub fn unwait(zone: usize, entry: EntryId, r: *mut ngx_http_request_t) {
    let item = ItemId { zone: zone as u32, entry, window: 0 };
    HOLDINGS.with(|m| {
        if let Some(held) = m.borrow_mut().get_mut(&item) {
            held.waiters.retain(|&w| !std::ptr::eq(w, r));
            held.h.waiting = held.waiters.len() as u32;
        }
    });
}

/// A slot taken by `on_error`'s decision (Redis down, or the lease not
/// renewed): counted as this worker's, so that its lease covers it when
/// Redis answers again.
pub fn take_unsure(s: &Slot<'_>) {
    HOLDINGS.with(|m| {
        held_for(&mut m.borrow_mut(), s).h.take_unsure();
    });
    tick_soon();
}

/// A request gave its slot back. A worker that is exiting (a reload, a
/// quit) keeps no spare: it gives back at once the slots it does not use, so
/// that the new workers do not wait for its leases to end.
pub fn give(zone: usize, entry: EntryId) {
    let item = ItemId { zone: zone as u32, entry, window: 0 };
    // SAFETY: nginx's flag, read on the worker's thread that sets it.
    let exiting = unsafe { ngx_exiting } != 0;
    HOLDINGS.with(|m| {
        if let Some(held) = m.borrow_mut().get_mut(&item) {
            held.h.give();
            held.h.strict |= exiting;
            let release = exiting && !held.h.asked && held.h.granted > held.h.mine;
            if release || held.h.ask_after_give(held.max) {
                send(item, held);
            }
        }
    });
}

/// Asks Redis for the key's lease.
fn send(item: ItemId, held: &mut Held) {
    let Some(ch) = crate::worker::channel::channel() else {
        return;
    };
    held.h.asked = true;
    let (uses, wants) = (held.h.mine, held.h.want(held.max));
    // (through the thread these are what Redis gets; down the link they
    // are brought up to date when the call is written)
    held.h.sent(uses, wants);
    let c = link::Conn {
        id: item,
        namespace: &held.namespace,
        key: &held.key,
        max: held.max,
        lease_ms: held.lease_ms,
        uses,
        wants,
    };
    link::send_conn(ch, &c);
}

/// The renewal timer runs while this worker holds keys.
fn tick_soon() {
    TICK.with(|t| {
        let mut t = t.borrow_mut();
        if t.is_null() {
            // SAFETY: an all-zero event is nginx's idle event (as
            // `ngx_pcalloc` gives); it lives for the worker's life.
            let ev: Box<ngx_event_t> = Box::new(unsafe { std::mem::zeroed() });
            *t = Box::into_raw(ev);
        }
        // SAFETY: our event, on the worker's thread; `ngx_cycle` is the
        // running cycle, whose log outlives the worker's events.
        unsafe {
            let ev = *t;
            if (*ev).timer_set() == 0 {
                (*ev).handler = Some(on_tick);
                (*ev).log = (*ngx_cycle).log;
                // a graceful exit does not wait for it
                (*ev).set_cancelable(1);
                ngx_add_timer(ev, TICK_MS as _);
            }
        }
    });
}

/// Renews the leases a third through, forgets idle keys; runs again while
/// any key is held.
unsafe extern "C" fn on_tick(_ev: *mut ngx_event_t) {
    let now = now_ms();
    let mcf = crate::worker::reply::main_conf();
    let more = HOLDINGS.with(|m| {
        let mut m = m.borrow_mut();
        m.retain(|&item, held| {
            let lease = u64::from(held.lease_ms);
            if held.h.idle(lease, now) && held.waiters.is_empty() {
                if let Some(mcf) = mcf {
                    state::unreport(mcf, item, held);
                }
                return false;
            }
            if held.h.renewal_due(lease, now) {
                send(item, held);
            }
            true
        });
        !m.is_empty()
    });
    if more {
        tick_soon();
    }
}
