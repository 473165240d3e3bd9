//! What this worker holds of the fleet's concurrency limits: a key's
//! lease and what it uses (`Held`, per key), and what a call for it
//! carries and brings back (`refresh`, `answered`), for the link and the
//! thread's answers, which come on the worker's thread.

use std::cell::RefCell;
use std::ptr;

use nginx_sys::{ngx_del_timer, ngx_http_request_t, ngx_post_event, ngx_posted_events};
use ratelimit_core::batch::{ItemId, ItemMap};
use ratelimit_core::conn_fleet::{Holding, Reply};
use ratelimit_core::stats::Stats;

use crate::backend::StrictGroup;
use crate::conf::MainConf;
use crate::worker::time::now_ms;

/// One key this worker holds (or held lately) slots of.
pub(super) struct Held {
    /// The zone's name (the key's namespace in Redis) and the key.
    pub(super) namespace: Box<[u8]>,
    pub(super) key: Box<[u8]>,
    pub(super) max: u32,
    pub(super) lease_ms: u32,
    pub(super) h: Holding,
    /// Requests waiting for the answer to its ask (`Take::Wait`).
    pub(super) waiters: Vec<*mut ngx_http_request_t>,
    /// Its lease as Redis last granted it, in the node's figure
    /// (`conn_leased`).
    pub(super) reported: u32,
}

/// The key's `Held`, new if it has none.
pub(super) fn held<'m>(
    m: &'m mut ItemMap<Held>,
    item: ItemId,
    namespace: &[u8],
    key: &[u8],
) -> &'m mut Held {
    m.entry(item).or_insert_with(|| Held {
        namespace: namespace.into(),
        key: key.into(),
        max: 1,
        lease_ms: ratelimit_core::conn::LEASE_MS,
        h: Holding::default(),
        waiters: Vec::new(),
        reported: 0,
    })
}

thread_local! {
    /// The keys, by their conn entry (window 0).
    pub(super) static HOLDINGS: RefCell<ItemMap<Held>> = RefCell::new(ItemMap::default());
}

/// A conn group about to be written: what the holder uses and asks to
/// hold now (a key forgotten meanwhile asks for nothing).
pub fn refresh(g: &mut StrictGroup) {
    let (uses, wants) = HOLDINGS.with(|m| {
        m.borrow_mut().get_mut(&g.id).map_or((0, 0), |held| {
            let w = (held.h.mine, held.h.want(held.max));
            held.h.sent(w.0, w.1);
            w
        })
    });
    if let [a, b] = &mut g.requests[..] {
        a.cost = uses;
        b.cost = wants;
    }
}

/// Redis's answer to a conn group of the key (`None`: none); the requests
/// that waited for it are woken (they take their slots again).
pub fn answered(mcf: &MainConf, id: ItemId, reply: Option<Reply>) {
    let (before, waiters) = HOLDINGS.with(|m| {
        let mut m = m.borrow_mut();
        let Some(held) = m.get_mut(&id) else {
            return (None, Vec::new());
        };
        let before = held.reported;
        match reply {
            Some(r) => {
                held.h.answered(r, now_ms());
                held.reported = r.granted;
            }
            None => held.h.unanswered(),
        }
        held.h.waiting = 0;
        (Some(before), std::mem::take(&mut held.waiters))
    });
    if let (Some(r), Some(st)) =
        (reply, mcf.zones.get(id.zone as usize).and_then(|z| z.shared.as_ref()))
    {
        let st = st.stats();
        Stats::add_n(&st.conn_expired, u64::from(r.expired));
        if let Some(before) = before {
            Stats::add_n(&st.conn_leased, u64::from(r.granted));
            Stats::sub_n(&st.conn_leased, u64::from(before));
        }
    }
    for r in waiters {
        wake(r);
    }
}

/// Posts the write event of a request waiting for an answer (parked as
/// `http::delay::park` parks one): its handler takes its slots again.
fn wake(r: *mut ngx_http_request_t) {
    // SAFETY: a waiting request is alive until its pool's cleanup takes it
    // out of the waiters (`unwait`); its write event is posted to run in
    // this event loop's turn.
    unsafe {
        let wev = (*(*r).connection).write;
        (*wev).set_delayed(0);
        if (*wev).timer_set() != 0 {
            ngx_del_timer(wev);
        }
        ngx_post_event(wev, ptr::addr_of_mut!(ngx_posted_events));
    }
}

/// The worker exits: what it leased leaves the node's figure (its leases
/// end in Redis unrenewed, as a dead holder's do).
pub fn leave(mcf: &MainConf) {
    HOLDINGS.with(|m| {
        for (id, held) in m.borrow_mut().drain() {
            unreport(mcf, id, &held);
        }
    });
}

/// A key forgotten: its lease leaves the node's figure.
pub(super) fn unreport(mcf: &MainConf, id: ItemId, held: &Held) {
    if let Some(st) = mcf.zones.get(id.zone as usize).and_then(|z| z.shared.as_ref()) {
        Stats::sub_n(&st.stats().conn_leased, u64::from(held.reported));
    }
}
