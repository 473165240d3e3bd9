//! The one decision path: every limit of one request, whoever asks (the
//! preaccess handler for `redis_ratelimit` lines, the Lua ABI). In: the
//! limits with their keys, and now. Out: allowed or not, the requests left
//! under the tightest limit, when a rejected request may pass again.
//!
//! Steps, the same for every caller: hash each key outside any lock; take
//! the zones' locks (in shared-memory order, the same in every process);
//! check every limit against its entry (breaker, counts, `on_error`); count
//! the request only if every limit passes (or always, for Lua's
//! `measure`), once per entry however many limits share it; release the
//! locks; queue the increments for the zone's Redis thread (at once for a
//! key near its limit, later for one far from it: `ratelimit_core::sync`).

use nginx_sys::ngx_log_t;
use ngx::log::DebugMask;
use ngx::ngx_log_debug;
use ratelimit_core::batch::ItemId;
use ratelimit_core::counter::{self, Fresh};
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Stats;
use ratelimit_core::sync::{self, Send};
use ratelimit_core::table::Entry;
use ratelimit_core::window::Estimate;
use smallvec::SmallVec;

use crate::backend::{Channel, Increment};
use crate::nginx::conf::MainConf;
use crate::nginx::zone::{Locked, Shared};

mod mode;
pub use mode::Mode;
use mode::DENY_RETRY_MS;

/// One limit to decide: a zone, the key's namespace (the zone's name, or a
/// Lua caller's) and bytes, and the rate.
#[derive(Clone, Copy)]
pub struct Ask<'a> {
    pub zone: usize,
    pub namespace: &'a [u8],
    /// The namespace is the zone's own name, which the zone hashed once
    /// (`Shared::name`): the request hashes only its key.
    pub zone_named: bool,
    pub key: &'a [u8],
    pub rate: Rate,
    /// What the request weighs (1 usually; 0 checks without counting).
    pub cost: u32,
    /// Whether Redis decides this limit (`strict`), and what it said.
    pub strict: Strict,
    /// Which `redis_ratelimit` line of the location asks (`NO_LINE`: a Lua
    /// caller): the log phase counts a `count_if=` line's key and rate as
    /// the preaccess phase checked them.
    pub line: u32,
}

/// `Ask::line` of a limit that no configuration line asks for (Lua).
pub const NO_LINE: u32 = u32::MAX;

/// A limit's part in strict mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strict {
    /// A background limit.
    No,
    /// A strict limit checked before its wait: rejected here only when
    /// Redis's own counts (or the breaker) put the key at its limit. This
    /// node's unconfirmed increments are left out: a strict answer's count
    /// may hold them already (sent by the thread, their reply not applied
    /// yet), and counted twice they would refuse a small limit's last
    /// requests that Redis would allow.
    Before,
    /// A limit Redis decides, counted after the response (`count_if=`):
    /// counted here in flight, not queued for the thread; the caller sends
    /// the count down the zone's strict link, ahead of the next check of
    /// the key from this worker.
    Later,
    /// Redis allowed the request and counted it.
    Allowed,
    /// Redis rejected it (not counted).
    Rejected,
    /// No answer in time (timeout, error reply, backend down): decided as
    /// the zone's `on_error` says, from this node's counts for `local`.
    Failed,
}

impl Strict {
    /// Redis decided, and counted what it allowed.
    fn decided(self) -> bool {
        matches!(self, Strict::Allowed | Strict::Rejected)
    }
}

/// Whether an allowed request only is counted, or every one (Lua's
/// `measure`), or none (the check before a strict request's wait).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    IfAllowed,
    Always,
    Never,
}

impl Take {
    fn counts(self, allowed: bool) -> bool {
        match self {
            Take::IfAllowed => allowed,
            Take::Always => true,
            Take::Never => false,
        }
    }
}

/// What one limit said.
#[derive(Clone, Copy, Debug)]
pub struct Said {
    pub check: counter::Check,
    /// The estimate after this request was counted (or not).
    pub after: Estimate,
}

/// The decision for a request.
pub struct Decision {
    pub allowed: bool,
    /// The tightest limit's L when allowed, 0 when rejected: with the
    /// estimate after the request (`said.after`) it tells how many requests
    /// are left, which is worked out only if asked (`remaining`).
    pub limit: u32,
    /// When rejected: the earliest time (ms) every rejecting limit allows a
    /// request again.
    pub retry_at_ms: u64,
    /// The limit the answer speaks of: the first that rejected, else the
    /// one with the fewest requests left.
    pub tightest: usize,
    /// What that limit said.
    pub said: Said,
}

impl Decision {
    /// Requests left under the tightest limit, after this one (0 when
    /// rejected).
    pub fn remaining(&self) -> u32 {
        self.said.after.remaining(self.limit)
    }
}

/// A zone's shared memory is not there (not mapped in this process).
#[derive(Debug)]
pub struct NoZone;

/// One entry being decided.
struct Slot {
    /// Position of the zone's lock in `guards`.
    guard: usize,
    entry: u32,
    id: [u64; 2],
    mode: Mode,
}

/// Decides `asks` (at least one) at `now`, counts as `take` says, and
/// queues the increments. `log` (the request's, or the cycle's for Lua)
/// gets one debug line per limit in nginx built `--with-debug`.
#[inline]
pub fn decide(
    mcf: &MainConf,
    asks: &[Ask<'_>],
    now: u64,
    take: Take,
    log: *mut ngx_log_t,
) -> Result<Decision, NoZone> {
    if let [one @ Ask { strict: Strict::No, .. }] = asks {
        // the common case, without the bookkeeping for several zones and
        // shared entries
        return decide_one(mcf, one, now, take, log);
    }
    decide_many(mcf, asks, now, take, log)
}

/// `decide` for several limits, or a strict one.
#[inline(never)]
fn decide_many(
    mcf: &MainConf,
    asks: &[Ask<'_>],
    now: u64,
    take: Take,
    log: *mut ngx_log_t,
) -> Result<Decision, NoZone> {
    let channel = crate::nginx::channel::channel();
    let mut zones: SmallVec<[usize; 4]> = SmallVec::new();
    let mut ids: SmallVec<[[u64; 2]; 4]> = SmallVec::new();
    for a in asks {
        let (_, id) = identify(mcf, a)?;
        ids.push(id);
        if !zones.contains(&a.zone) {
            zones.push(a.zone);
        }
    }
    // one order for every process, old or new after a reload that
    // reordered the declarations: two workers never wait on each other
    zones.sort_unstable_by_key(|&z| mcf.zones[z].shared.as_ref().map_or(0, |s| s.order()));
    let mut guards: SmallVec<[Locked<'_>; 4]> = SmallVec::new();
    for &z in &zones {
        guards.push(mcf.zones[z].shared.as_ref().ok_or(NoZone)?.lock());
    }

    // check every limit
    let mut slots: SmallVec<[Slot; 4]> = SmallVec::new();
    let mut said: SmallVec<[Said; 4]> = SmallVec::new();
    for (a, &id) in asks.iter().zip(&ids) {
        let guard = zones.iter().position(|&z| z == a.zone).unwrap_or(0);
        let mode = match a.strict {
            Strict::Failed => Mode::failed(&mcf.zones[a.zone], channel),
            _ => Mode::of(&mcf.zones[a.zone], a.zone, channel),
        };
        let (entry, _) = guards[guard].table.get_or_insert(id);
        let e = guards[guard].table.entry_mut(entry);
        let mut s = if a.strict == Strict::Before {
            let mut check = counter::check_known(e, a.rate, now, a.cost);
            mode.apply(&mut check, now);
            Said { check, after: check.estimate }
        } else {
            check(e, a.rate, a.cost, mode, now, stale_ms(channel, a.zone))
        };
        verdict(a.strict, &mut s.check, now);
        slots.push(Slot { guard, entry, id, mode });
        said.push(s);
    }
    let allowed = said.iter().all(|s| s.check.allowed);

    // count, once per entry, and what to send: (ask, tightest limit)
    let mut sends: SmallVec<[(usize, u32, u32); 4]> = SmallVec::new();
    if take.counts(allowed) {
        for (i, (a, s)) in asks.iter().zip(&slots).enumerate() {
            let first = slots[..i].iter().position(|o| o.guard == s.guard && o.entry == s.entry);
            // Redis counted it already (strict), for every limit of the entry
            let counted = asks
                .iter()
                .zip(&slots)
                .any(|(o, os)| os.guard == s.guard && os.entry == s.entry && o.strict.decided());
            match first {
                None if counted => {}
                None => {
                    // limits sharing the entry (tiers of one period) count
                    // the request once, at its heaviest (a `count_if=`
                    // limit's 0 in preaccess does not hide another's cost)
                    let cost = asks
                        .iter()
                        .zip(&slots)
                        .filter(|(_, o)| o.guard == s.guard && o.entry == s.entry)
                        .map(|(o, _)| o.cost)
                        .max()
                        .unwrap_or(a.cost);
                    if count(guards[s.guard].table.entry_mut(s.entry), s.mode, cost)
                        && a.strict != Strict::Later
                    {
                        sends.push((i, a.rate.limit, cost));
                    }
                }
                Some(f) => {
                    if let Some(send) = sends.iter_mut().find(|(j, _, _)| *j == f) {
                        send.1 = send.1.min(a.rate.limit);
                    }
                }
            }
        }
    }
    let mut unsent: SmallVec<[(u32, u16, Fresh); 4]> = SmallVec::new();
    for ((a, s), out) in asks.iter().zip(&slots).zip(said.iter_mut()) {
        let e = guards[s.guard].table.entry(s.entry);
        out.after = counter::estimate(e, a.rate, now);
        unsent.push((e.inflight, e.share, counter::fresh(e)));
    }
    // when each increment goes, each as the limits of its entry say
    // (`sync`): a key near any of them goes at once, and then waits for
    // Redis's answer
    let mut due: SmallVec<[Send; 4]> = SmallVec::new();
    if channel.is_some() {
        for &(i, _, _) in &sends {
            let s = &slots[i];
            let send = asks
                .iter()
                .zip(&slots)
                .zip(&said)
                .filter(|((_, o), _)| o.guard == s.guard && o.entry == s.entry)
                .map(|((o, _), x)| {
                    let (u, share, _) = unsent[i];
                    sync::when(o.rate, x.after, u, share, now, hold_ms(mcf, o.zone))
                })
                .fold(Send::LATEST, Send::min);
            counter::wait(guards[s.guard].table.entry_mut(s.entry), send.prompt(), now);
            due.push(send);
        }
    }
    drop(guards);
    for ((a, s), x) in asks.iter().zip(&slots).zip(&said) {
        trace(log, mcf, a, s.id, s.mode, x);
    }

    // the answer
    let mut remaining = u32::MAX;
    let mut retry_at_ms = now;
    let mut tightest = 0;
    if allowed {
        for (i, (a, s)) in asks.iter().zip(&said).enumerate() {
            let left = s.after.remaining(a.rate.limit);
            if left < remaining {
                remaining = left;
                tightest = i;
            }
        }
    } else {
        tightest = said.iter().position(|s| !s.check.allowed).unwrap_or(0);
        for s in said.iter().filter(|s| !s.check.allowed) {
            retry_at_ms = retry_at_ms.max(s.check.retry_at_ms);
        }
    }

    // queue the increments
    if let Some(ch) = channel {
        for (&(i, limit, n), &send) in sends.iter().zip(&due) {
            let fresh = unsent[i].2;
            queue(mcf, ch, &asks[i], slots[i].id, said[i].check.window, limit, n, send, fresh);
        }
    }
    let limit = if allowed { asks[tightest].rate.limit } else { 0 };
    Ok(Decision { allowed, limit, retry_at_ms, tightest, said: said[tightest] })
}

/// `decide` for one limit: the same steps, on one entry.
#[inline(always)]
fn decide_one(
    mcf: &MainConf,
    a: &Ask<'_>,
    now: u64,
    take: Take,
    log: *mut ngx_log_t,
) -> Result<Decision, NoZone> {
    let channel = crate::nginx::channel::channel();
    let (shared, id) = identify(mcf, a)?;
    let mode = Mode::of(&mcf.zones[a.zone], a.zone, channel);
    let mut locked = shared.lock();
    let (entry, _) = locked.table.get_or_insert(id);
    let e = locked.table.entry_mut(entry);
    let mut said = check(e, a.rate, a.cost, mode, now, stale_ms(channel, a.zone));
    let allowed = said.check.allowed;
    let counted = take.counts(allowed) && counts(mode);
    let send = counted && count(e, mode, a.cost);
    if counted {
        // the entry's estimate with this request in it (what
        // `counter::estimate` gives now, without a second pass)
        said.after = said.check.estimate.plus(a.cost);
    }
    let when = (send && channel.is_some()).then(|| {
        let w = sync::when(a.rate, said.after, e.inflight, e.share, now, hold_ms(mcf, a.zone));
        counter::wait(e, w.prompt(), now);
        w
    });
    let fresh = counter::fresh(e);
    drop(locked);
    trace(log, mcf, a, id, mode, &said);
    if let (Some(ch), Some(when)) = (channel, when) {
        queue(mcf, ch, a, id, said.check.window, a.rate.limit, a.cost, when, fresh);
    }
    Ok(Decision {
        allowed,
        limit: if allowed { a.rate.limit } else { 0 },
        retry_at_ms: if allowed { now } else { said.check.retry_at_ms },
        tightest: 0,
        said,
    })
}

/// One limit's decision, as a debug line (compiled out unless nginx was
/// built `--with-debug`; written only with `error_log ... debug` or
/// `debug_connection`).
#[inline(always)]
fn trace(log: *mut ngx_log_t, mcf: &MainConf, a: &Ask<'_>, id: [u64; 2], mode: Mode, s: &Said) {
    if !ngx::log::DEBUG || log.is_null() {
        return;
    }
    ngx_log_debug!(
        mask: DebugMask::Http,
        log,
        "redis_ratelimit: zone \"{}\" key #{:016x} {}: estimate {:.2}, {:.2} after, mode {}: {}",
        mcf.zones[a.zone].name,
        id[0],
        a.rate,
        s.check.estimate.value(),
        s.after.value(),
        mode.as_str(),
        if s.check.allowed { "pass" } else { "limited" }
    );
}

/// The zone's shared memory and the key's entry id (hashed outside any
/// lock).
#[inline(always)]
fn identify<'m>(mcf: &'m MainConf, a: &Ask<'_>) -> Result<(&'m Shared, [u64; 2]), NoZone> {
    let shared = mcf.zones.get(a.zone).and_then(|z| z.shared.as_ref()).ok_or(NoZone)?;
    Ok((shared, entry_id(shared, a)))
}

/// The id of `a`'s entry in the zone's table.
#[inline]
pub fn entry_id(shared: &Shared, a: &Ask<'_>) -> [u64; 2] {
    let ns = if a.zone_named { shared.name } else { shared.ids.namespace(a.namespace) };
    shared.ids.id_in(ns, a.rate.period, a.key)
}

/// How long a key's increments may wait for the zone's Redis before the
/// node's view of it counts as stale (`counter::cap_to_share`); forever
/// while the backend is known down (`on_error` decides then).
#[inline(always)]
fn stale_ms(channel: Option<&std::sync::Arc<Channel>>, zone: usize) -> u64 {
    match channel {
        Some(ch) if ch.is_up(zone) => ch.stale_ms(zone),
        Some(_) => u64::MAX,
        None => counter::STALE_MIN_MS,
    }
}

/// Checks one limit against its entry, under the lock.
#[inline(always)]
fn check(e: &mut Entry, rate: Rate, cost: u32, mode: Mode, now: u64, stale_ms: u64) -> Said {
    let mut check = counter::check_cost(e, rate, now, cost);
    if mode == Mode::Remote {
        // near the limit, or waiting too long for Redis, no more than this
        // node's share of the headroom before Redis answers
        counter::cap_to_share(e, rate, now, cost, 1, stale_ms, &mut check);
    }
    mode.apply(&mut check, now);
    Said { check, after: check.estimate }
}

/// What Redis decided for a strict limit replaces the decision from the
/// counts (which have its answer applied: the estimate and the time to
/// retry come from them).
fn verdict(strict: Strict, check: &mut counter::Check, now: u64) {
    match strict {
        Strict::Allowed => check.allowed = true,
        Strict::Rejected => {
            if check.allowed {
                // the counts here moved on since Redis answered
                check.retry_at_ms = now + DENY_RETRY_MS;
            }
            check.allowed = false;
        }
        Strict::No | Strict::Before | Strict::Later | Strict::Failed => {}
    }
}

/// Whether a zone in `mode` counts the requests it lets through (not while
/// its backend's `on_error` lets every one through or rejects it).
#[inline]
fn counts(mode: Mode) -> bool {
    matches!(mode, Mode::Local | Mode::Remote)
}

/// Counts the request in an entry, unless the backend's `on_error` says it
/// is not counted. Returns whether it is to be sent to Redis.
#[inline]
fn count(e: &mut Entry, mode: Mode, cost: u32) -> bool {
    match mode {
        Mode::Allow | Mode::Deny => false,
        Mode::Local | Mode::Remote => {
            counter::count_cost(e, mode == Mode::Remote, cost);
            mode == Mode::Remote && cost > 0
        }
    }
}

/// The zone's `hold=`.
#[inline]
fn hold_ms(mcf: &MainConf, zone: usize) -> u64 {
    mcf.zones[zone].params.as_ref().map_or(0, |p| p.hold_ms)
}

/// Queues one counted request for the zone's Redis thread.
#[allow(clippy::too_many_arguments)]
fn queue(
    mcf: &MainConf,
    ch: &Channel,
    a: &Ask<'_>,
    id: [u64; 2],
    window: u64,
    limit: u32,
    n: u32,
    send: Send,
    fresh: Fresh,
) {
    let item = ItemId { zone: a.zone as u32, entry: id, window };
    let period = a.rate.period;
    let inc = Increment { namespace: a.namespace, key: a.key, period, limit, n, fresh };
    if !ch.push(item, inc, send) {
        if let Some(s) = mcf.zones[a.zone].shared.as_ref() {
            Stats::bump(&s.stats().dropped);
        }
    }
}
