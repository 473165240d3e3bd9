//! Redis's answers applied on the worker's own thread: counts to a key's
//! entry (a flush's reply or a strict decision, a breaker it closed),
//! strict requests woken, log lines through the zone's log gate. Used for
//! what the Redis thread hands back (`worker.rs`) and for what a strict
//! link reads (`link.rs`).

use ratelimit_core::tickets::Ticket;
use std::cell::RefCell;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use nginx_sys::{ngx_log_t, ngx_uint_t, NGX_LOG_ERR, NGX_LOG_INFO};
use ngx::log::DebugMask;
use ngx::{ngx_log_debug, ngx_log_error};
use ratelimit_core::batch::ItemId;
use ratelimit_core::bucket;
use ratelimit_core::conn_fleet;
use ratelimit_core::counter;
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Stats;
use ratelimit_core::strict::{Kind, Verdicts};
use ratelimit_core::table::Entry;
use ratelimit_core::text;

use crate::backend::{Level, StrictGroup};
use crate::conf::MainConf;
use crate::worker::time::now_ms;
use crate::worker::waits::{self, LimitVerdict};

static MAIN_CONF: AtomicPtr<MainConf> = AtomicPtr::new(ptr::null_mut());

/// Records this worker's main configuration (its thread started).
pub(super) fn set_main_conf(mcf: &mut MainConf) {
    MAIN_CONF.store(ptr::from_mut(mcf), Ordering::Release);
}

/// What Redis decided for a group of strict requests: their key's entry,
/// the limit's rate, and what was decided: the key's window, its bucket
/// (`burst=`: the answer is the bucket's level) or its slots (a conn
/// group: the answer is the holder's lease, `worker::holdings`).
#[derive(Clone, Copy)]
pub(crate) struct Decided {
    pub(crate) id: ItemId,
    pub(crate) rate: Rate,
    pub(crate) kind: Kind,
}

impl Decided {
    /// What a group's answer is applied as.
    pub(crate) fn of(g: &StrictGroup) -> Decided {
        let rate = Rate { limit: g.limit, period: g.period };
        Decided { id: g.id, rate, kind: g.kind }
    }
}

/// Redis's decision for strict requests of one key (`None`: none): its
/// counts applied to the entry as for a flush, the requests woken. What
/// the script checked and allowed it counted (never in flight here); its
/// counts after the response (`counted`, in flight here) are confirmed,
/// or without an answer stay counted on this node alone.
pub(super) fn strict_answered(
    mcf: &MainConf,
    log: *mut ngx_log_t,
    of: Decided,
    tickets: impl Iterator<Item = Ticket> + Clone,
    counted: u32,
    answer: Option<&impl Verdicts>,
) {
    let Decided { id, rate, kind } = of;
    if kind == Kind::Conn {
        let reply = answer.map(|a| conn_fleet::Reply::of(a.cur(), a.prev()));
        crate::worker::holdings::state::answered(mcf, id, reply);
        return;
    }
    let bucket = matches!(kind, Kind::Bucket(_));
    let Some(a) = answer else {
        if counted > 0 && bucket {
            // what the node owed did not reach Redis: owed again
            let milli = u64::from(counted);
            with_entry(mcf, id, |e| bucket::fleet::unanswered(e, milli, rate, now_ms()));
        } else if counted > 0 {
            with_entry(mcf, id, |e| counter::keep_local(e, id.window, counted));
        }
        waits::resolve(tickets, |_| None, |_, _| None);
        return;
    };
    let c = counter::Confirmation {
        window: id.window,
        sent: counted,
        carried: 0,
        cur: a.cur(),
        prev: Some(a.prev()),
    };
    let now = now_ms();
    let mut resolved = false;
    let mut then = |e: &mut Entry| {
        // the requests of one limit decided on the entry as it is now,
        // under the same lock
        waits::resolve(
            tickets.clone(),
            |i| a.allowed(i),
            |one_limit, allowed| {
                let verdict = LimitVerdict {
                    zone: id.zone as usize,
                    rate,
                    cost: one_limit.cost,
                    bucket: one_limit.bucket,
                    allowed,
                };
                Some((one_limit.decide)(mcf, e, verdict, now))
            },
        );
        resolved = true;
    };
    if bucket {
        // the fleet's level of the key's bucket, as Redis left it, and
        // what this node owes it since
        with_entry(mcf, id, |e| {
            bucket::fleet::answered(e, a.cur(), rate, now);
            then(e);
        });
    } else {
        confirmed(mcf, log, id, rate, &c, now, then);
    }
    if !resolved {
        // the entry is gone: the woken requests decide as they would
        waits::resolve(tickets, |i| a.allowed(i), |_, _| None);
    }
}

/// The longest message a zone writes to the error log (nginx's own line
/// is 2048 bytes).
const MAX_LINE: usize = 1536;

/// A line for the error log, at most one a second per zone over all
/// workers (`claim_log`), as one line. An outage's end (`Recovery`) is not
/// held back by that gate, but is written only by a worker that wrote an
/// error line of the zone since its last one: each recovery line answers a
/// failure an operator saw, and there are never more of them than of
/// those.
pub(super) fn zone_log(
    mcf: &MainConf,
    log: *mut ngx_log_t,
    zone: u32,
    level: Level,
    message: &str,
) {
    let Some(shared) = mcf.zones.get(zone as usize).and_then(|z| z.shared.as_ref()) else {
        return;
    };
    let (lvl, claimed) = match level {
        Level::Error => (NGX_LOG_ERR, shared.lock().table.claim_log(true, now_ms() / 1000)),
        Level::Info => (NGX_LOG_INFO, shared.lock().table.claim_log(false, now_ms() / 1000)),
        Level::Recovery => (NGX_LOG_ERR, failure_shown(zone, false)),
        Level::Loss => (NGX_LOG_ERR, true),
        Level::Handover => (NGX_LOG_INFO, true),
    };
    if claimed {
        if level == Level::Error {
            failure_shown(zone, true);
        }
        // one line, whatever a library or a server put in it
        ngx_log_error!(lvl as ngx_uint_t, log, "{}", text::one_line(message, MAX_LINE));
    }
}

thread_local! {
    /// Per zone index: this worker wrote an error line of the zone since
    /// its last recovery line (the worker's thread only).
    static FAILURE_SHOWN: RefCell<Vec<bool>> = const { RefCell::new(Vec::new()) };
}

/// Sets whether this worker has an error line of `zone` unanswered, and
/// says whether it had one.
fn failure_shown(zone: u32, shown: bool) -> bool {
    FAILURE_SHOWN.with(|f| {
        let mut f = f.borrow_mut();
        let i = zone as usize;
        if f.len() <= i {
            f.resize(i + 1, false);
        }
        std::mem::replace(&mut f[i], shown)
    })
}

/// A zone's figures in shared memory, if it is mapped here.
pub(super) fn zone_stats(mcf: &MainConf, zone: usize) -> Option<&Stats> {
    mcf.zones.get(zone).and_then(|z| z.shared.as_ref()).map(|s| s.stats())
}

/// This worker's main configuration, once its thread started.
pub(super) fn main_conf() -> Option<&'static MainConf> {
    let mcf = MAIN_CONF.load(Ordering::Acquire);
    // SAFETY: the main configuration lives as long as this worker's cycle.
    (!mcf.is_null()).then(|| unsafe { &*mcf })
}

/// Applies Redis's counts for an item (a flush's reply or a strict
/// decision) to its entry, counting a breaker that the reply closed; then
/// `then` on the entry, under the same lock (not run when the entry is
/// gone).
#[inline(always)]
pub(super) fn confirmed(
    mcf: &MainConf,
    log: *mut ngx_log_t,
    id: ItemId,
    rate: Rate,
    confirmation: &counter::Confirmation,
    now: u64,
    then: impl FnOnce(&mut Entry),
) {
    with_entry(mcf, id, |e| {
        let armed = e.blocked_until_ms;
        counter::confirm(e, confirmation, rate, now);
        if armed <= now && e.blocked_until_ms > now && counter::opened(e) {
            if let Some(s) = mcf.zones.get(id.zone as usize).and_then(|z| z.shared.as_ref()) {
                Stats::bump(&s.stats().breaker_trips);
            }
        }
        ngx_log_debug!(
            mask: DebugMask::Http,
            log,
            "redis_ratelimit: reply applied: zone {} key #{:016x} window {}: {} sent, count {}, previous {}",
            id.zone,
            id.entry.0[0],
            confirmation.window,
            confirmation.sent,
            confirmation.cur,
            confirmation.prev.map_or(-1, |p| p as i64)
        );
        if e.blocked_until_ms > now && e.blocked_until_ms != armed {
            ngx_log_debug!(
                mask: DebugMask::Http,
                log,
                "redis_ratelimit: breaker armed: zone {} key #{:016x} limited for {} ms",
                id.zone,
                id.entry.0[0],
                e.blocked_until_ms - now
            );
        }
        then(e);
    });
}

/// Runs `f` on the zone entry an item was for, if it is still there.
/// A process that held a Redis thread's slot of `zone` is gone without
/// giving it back (killed, or its thread never stopped): what it held for
/// Redis will never be sent, and which of the zone's requests in flight
/// were its own is not known. All of them become this node's final local
/// counts (`counter::orphan`), so that no key waits for an answer that
/// will not come; they are counted as dropped, and a line says so.
pub(super) fn orphaned(mcf: &MainConf, log: *mut ngx_log_t, zone: u32, pid: u64) {
    let Some(z) = mcf.zones.get(zone as usize) else {
        return;
    };
    let Some(shared) = z.shared.as_ref() else {
        return;
    };
    let mut n = 0u64;
    {
        let mut locked = shared.lock();
        for e in locked.table.entries_mut() {
            n += u64::from(counter::orphan(e));
        }
    }
    if n == 0 {
        return;
    }
    shared.stats().dropped.fetch_add(n, Ordering::Relaxed);
    ngx_log_error!(
        NGX_LOG_ERR,
        log,
        "redis_ratelimit: zone \"{}\": worker process {} exited without sending its counts to Redis; the {} requests in flight are counted on this node only",
        z.name,
        pid,
        n
    );
}

pub(super) fn with_entry(mcf: &MainConf, id: ItemId, f: impl FnOnce(&mut Entry)) {
    let Some(shared) = mcf.zones.get(id.zone as usize).and_then(|z| z.shared.as_ref()) else {
        return;
    };
    let mut locked = shared.lock();
    if let Some(i) = locked.table.find(id.entry) {
        f(locked.table.entry_mut(i));
    }
}
