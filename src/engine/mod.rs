//! The one decision path: every limit of one request, whoever asks (the
//! preaccess handler for `redis_ratelimit` lines, the log phase for
//! `count_if=`, the Lua ABI). In: the limits with their keys, and now.
//! Out: allowed or not, the requests left under the tightest limit, when a
//! rejected request may pass again.
//!
//! The decision itself is pure (`ratelimit_core::decide`); here are its
//! surroundings, the same for every caller: hash each key outside any
//! lock; take the zones' locks (in shared-memory order, the same in every
//! process) and find each key's entry; read each zone's state (its
//! backend up or down, how stale a view may get, `hold=`); decide; release
//! the locks; log each limit's outcome at debug level; queue the
//! increments for the zones' Redis threads.

use nginx_sys::ngx_log_t;
use ngx::log::DebugMask;
use ngx::ngx_log_debug;
use ratelimit_core::batch::ItemId;
use ratelimit_core::bucket::{self, Bucket};
use ratelimit_core::decide::{self, CheckedAll, Entries, Limit, Push, Pushes, INLINE};
pub use ratelimit_core::decide::{Checked, Decision, Mode, Strict, Take};
use ratelimit_core::key::EntryId;
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Stats;
use ratelimit_core::table::Entry;
use smallvec::SmallVec;

use crate::backend::{Channel, Increment};
use crate::conf::MainConf;
use crate::shm::{Locked, Shared};
use crate::worker::waits::LimitVerdict;

pub mod controls;
mod later;
mod mode;
mod reset;
pub mod top;

pub use later::{in_redis, owe};
pub use reset::reset;

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
    /// limit_req's bucket instead of the sliding window.
    pub bucket: Option<Bucket>,
}

/// `Ask::line` of a limit that no configuration line asks for (Lua).
pub const NO_LINE: u32 = u32::MAX;

/// A zone's shared memory is not there (not mapped in this process).
#[derive(Debug)]
pub struct NoZone;

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
    if let [one @ Ask { strict: Strict::Background, .. }] = asks {
        // the common case, without the bookkeeping for several zones and
        // shared entries
        return Ok(decide_one(mcf, one, now, take, log)?.0);
    }
    Ok(decide_with_ids(mcf, asks, now, take, log)?.0)
}

/// Each ask's entry id (what Redis's answers name it by), in order.
pub type Ids = SmallVec<[EntryId; INLINE]>;

/// `decide`, with each ask's entry id, found as it decided (a strict
/// request's check before its wait: its script calls name the entries).
/// Out of line: the common case of `decide` (one limit the node decides)
/// stays small enough to be inlined.
#[inline(never)]
pub fn decide_with_ids(
    mcf: &MainConf,
    asks: &[Ask<'_>],
    now: u64,
    take: Take,
    log: *mut ngx_log_t,
) -> Result<(Decision, Ids), NoZone> {
    match asks {
        // one limit Redis decides (checked before its wait, and again
        // with the verdict), or a count of one that is not waited for
        [one] => {
            let (d, id) = decide_one(mcf, one, now, take, log)?;
            match d.checked.bucket {
                // a fleet's bucket decided here: what the node owes Redis
                Some(b) if b.owed > 0 => later::owe(one, id, b.owed),
                Some(_) => {}
                None if one.strict == Strict::CountOnly && take.counts(d.allowed) => {
                    later::send(asks, &[id], now)
                }
                None => {}
            }
            let mut ids = Ids::new();
            ids.push(id);
            Ok((d, ids))
        }
        _ => {
            let (d, ids) = decide_many(mcf, asks, now, take, log)?;
            if take.counts(d.allowed) && asks.iter().any(|a| a.strict == Strict::CountOnly) {
                later::send(asks, &ids, now);
            }
            Ok((d, ids))
        }
    }
}

/// What this node owes Redis of a fleet's bucket (`a`, of entry `id`),
/// taken to be sent ahead of a request that asks Redis
/// (`bucket::fleet::take`; 0: nothing).
pub fn take_owed(mcf: &MainConf, a: &Ask<'_>, id: EntryId, now: u64) -> u64 {
    let Some(shared) = mcf.zones.get(a.zone).and_then(|z| z.shared.as_ref()) else {
        return 0;
    };
    let mut locked = shared.lock();
    match locked.table.find(id) {
        Some(i) => bucket::fleet::take(locked.table.entry_mut(i), a.rate, now),
        None => 0,
    }
}

/// What this node knows of one limit, counting nothing (a strict
/// request's check before its wait, as `decide_with_ids` with
/// `Take::Never` makes it), and its entry's id.
#[inline(never)]
pub fn check_one(
    mcf: &MainConf,
    a: &Ask<'_>,
    now: u64,
    log: *mut ngx_log_t,
) -> Result<(Decision, EntryId), NoZone> {
    decide_one(mcf, a, now, Take::Never, log)
}

/// `decide` for one limit: one lock, one entry (and its id).
#[inline(always)]
fn decide_one(
    mcf: &MainConf,
    a: &Ask<'_>,
    now: u64,
    take: Take,
    log: *mut ngx_log_t,
) -> Result<(Decision, EntryId), NoZone> {
    let channel = crate::worker::channel::channel();
    let (shared, id) = identify(mcf, a)?;
    let l = limit(mcf, a, 0, channel);
    let mut locked = shared.lock();
    let (entry, created) = locked.table.get_or_insert(id, now);
    let (d, push) = decide::one(locked.table.entry_mut(entry), &l, now, take, channel.is_some());
    let full = if created {
        let t = &mut locked.table;
        t.claim_pressure_note(now / 1000, PRESSURE_EVERY_S).map(|n| (n, t.capacity()))
    } else {
        None
    };
    drop(locked);
    if let Some((n, capacity)) = full {
        say_full(mcf, a.zone, n, capacity, log);
    }
    trace(log, mcf, a, id, l.mode, &d.checked);
    if let (Some(ch), Some(p)) = (channel, push) {
        queue(mcf, ch, a, id, &p);
    }
    Ok((d, id))
}

/// How often a zone says it is full (evicts keys that still count).
const PRESSURE_EVERY_S: u64 = 60;

/// A full zone evicted `n` keys that still held counts since it last said
/// so: each such key that comes back starts afresh on this node (until
/// Redis answers for it, in a zone with Redis).
#[cold]
fn say_full(mcf: &MainConf, zone: usize, n: u64, capacity: usize, log: *mut ngx_log_t) {
    let z = &mcf.zones[zone];
    // the callers' log is there for debug lines only (null without them)
    let log = if log.is_null() {
        // SAFETY: `ngx_cycle` is the running cycle, set before any request
        // or Lua call is decided, on this (the worker's) thread.
        unsafe { (*nginx_sys::ngx_cycle).log }
    } else {
        log
    };
    ngx::ngx_log_error!(
        nginx_sys::NGX_LOG_WARN,
        log,
        "redis_ratelimit: zone \"{}\" is full: {} keys that still counted were evicted; such a key starts afresh on this node when it comes back{}; the zone holds {} keys, make it larger",
        z.name,
        n,
        if z.params.as_ref().is_some_and(|p| p.backend.is_some()) { " (until Redis answers for it)" } else { "" },
        capacity
    );
}

/// Where an ask's entry is: which lock, which entry of that zone's table.
#[derive(Clone, Copy, PartialEq, Eq)]
struct EntryAt {
    guard: usize,
    entry: u32,
}

/// The entries of a request over the locked zones (`decide::Entries`).
struct LockedEntries<'g, 'a> {
    guards: &'g mut [Locked<'a>],
    places: &'g [EntryAt],
}

impl Entries for LockedEntries<'_, '_> {
    #[inline]
    fn entry(&mut self, i: usize) -> &mut Entry {
        let p = self.places[i];
        self.guards[p.guard].table.entry_mut(p.entry)
    }
}

/// `decide` for several limits.
#[inline(never)]
fn decide_many(
    mcf: &MainConf,
    asks: &[Ask<'_>],
    now: u64,
    take: Take,
    log: *mut ngx_log_t,
) -> Result<(Decision, Ids), NoZone> {
    let channel = crate::worker::channel::channel();
    let mut zones: SmallVec<[usize; INLINE]> = SmallVec::new();
    let mut ids = Ids::new();
    for a in asks {
        ids.push(identify(mcf, a)?.1);
        if !zones.contains(&a.zone) {
            zones.push(a.zone);
        }
    }
    // one order for every process, old or new after a reload that
    // reordered the declarations: two workers never wait on each other
    zones.sort_unstable_by_key(|&z| mcf.zones[z].shared.as_ref().map_or(0, |s| s.order()));
    let mut guards: SmallVec<[Locked<'_>; INLINE]> = SmallVec::new();
    for &z in &zones {
        guards.push(mcf.zones[z].shared.as_ref().ok_or(NoZone)?.lock());
    }

    // each ask's entry, found once; asks of one entry share its index
    let mut places: SmallVec<[EntryAt; INLINE]> = SmallVec::new();
    let mut limits: SmallVec<[Limit; INLINE]> = SmallVec::new();
    for (a, &id) in asks.iter().zip(&ids) {
        let guard = zones.iter().position(|&z| z == a.zone).unwrap_or(0);
        let (entry, created) = guards[guard].table.get_or_insert(id, now);
        if created {
            let t = &mut guards[guard].table;
            if let Some(n) = t.claim_pressure_note(now / 1000, PRESSURE_EVERY_S) {
                say_full(mcf, a.zone, n, t.capacity(), log);
            }
        }
        let place = EntryAt { guard, entry };
        let index = places.iter().position(|&p| p == place).unwrap_or_else(|| {
            places.push(place);
            places.len() - 1
        });
        limits.push(limit(mcf, a, index, channel));
    }
    let (mut all, mut pushes) = (CheckedAll::new(), Pushes::new());
    let d = decide::many_into(
        &mut LockedEntries { guards: &mut guards, places: &places },
        &limits,
        now,
        take,
        channel.is_some(),
        &mut all,
        &mut pushes,
    );
    drop(guards);
    for ((a, &id), (l, c)) in asks.iter().zip(&ids).zip(limits.iter().zip(&all)) {
        trace(log, mcf, a, id, l.mode, c);
    }
    if let Some(ch) = channel {
        for p in &pushes {
            queue(mcf, ch, &asks[p.limit_index], ids[p.limit_index], p);
        }
    }
    Ok((d, ids))
}

/// The decision for a request whose one limit Redis decided (`v`),
/// made as Redis's answer is applied: `e` is the key's entry, locked by
/// the caller, with the answer's counts in it. It is what
/// `decide(.., Take::IfAllowed, ..)` gives for that limit with Redis's
/// verdict (nothing counted here, nothing queued: Redis counted it), so
/// the woken request answers without deciding again.
pub fn answered(mcf: &MainConf, e: &mut Entry, v: LimitVerdict, now: u64) -> Decision {
    let channel = crate::worker::channel::channel();
    let strict = if v.allowed { Strict::Allowed } else { Strict::Rejected };
    let l = Limit { bucket: v.bucket, ..limit_of(mcf, v.zone, v.rate, v.cost, strict, 0, channel) };
    decide::one(e, &l, now, Take::IfAllowed, channel.is_some()).0
}

/// The debug line of a request decided by `answered`, as `decide` writes
/// it for each limit.
#[inline(always)]
pub fn trace_answered(log: *mut ngx_log_t, mcf: &MainConf, a: &Ask<'_>, d: &Decision) {
    if !ngx::log::DEBUG || log.is_null() {
        return;
    }
    if let Ok((_, id)) = identify(mcf, a) {
        let l = limit(mcf, a, 0, crate::worker::channel::channel());
        trace(log, mcf, a, id, l.mode, &d.checked);
    }
}

/// An ask as the decision sees it: its entry's index, the zone's state.
#[inline(always)]
fn limit(
    mcf: &MainConf,
    a: &Ask<'_>,
    entry: usize,
    channel: Option<&std::sync::Arc<Channel>>,
) -> Limit {
    let l = limit_of(mcf, a.zone, a.rate, a.cost, a.strict, entry, channel);
    match a.bucket {
        // a fleet's bucket: this node's part of it (`bucket::fleet`)
        Some(_) if l.mode == Mode::Remote => {
            Limit { bucket: a.bucket, nodes: fleet_nodes(mcf, a.zone), ..l }
        }
        _ => Limit { bucket: a.bucket, ..l },
    }
}

/// The nodes that count through a zone's Redis, as the zone last learnt
/// (at least its `nodes=`).
pub fn fleet_nodes(mcf: &MainConf, zone: usize) -> u32 {
    let z = &mcf.zones[zone];
    let seen = z.shared.as_ref().map_or(0, |s| Stats::get(&s.stats().fleet_nodes));
    u32::try_from(seen).unwrap_or(u32::MAX).max(z.params.as_ref().map_or(0, |p| p.nodes))
}

/// `limit`, of an ask's parts.
#[inline(always)]
fn limit_of(
    mcf: &MainConf,
    zone: usize,
    rate: Rate,
    cost: u32,
    strict: Strict,
    entry: usize,
    channel: Option<&std::sync::Arc<Channel>>,
) -> Limit {
    let Some(ch) = channel else {
        // no Redis thread in this process: every zone counts here
        let mode = if strict == Strict::Failed {
            mode::failed(&mcf.zones[zone], false)
        } else {
            Mode::Local
        };
        let stale_ms = ratelimit_core::counter::STALE_MIN_MS;
        let (hold_ms, nodes, bucket) = (0, 0, None);
        return Limit { entry, rate, cost, mode, strict, stale_ms, hold_ms, nodes, bucket };
    };
    let up = backend_up(mcf, ch, zone);
    let (index, zone) = (zone, &mcf.zones[zone]);
    let mode = match strict {
        Strict::Failed => mode::failed(zone, true),
        _ => mode::of(zone, Some(up)),
    };
    // how long increments may wait for Redis before a view is stale
    // (`share::cap_to_share`); forever while the backend is known down
    // (`on_error` decides then)
    let stale_ms = if up { ch.stale_ms(index) } else { u64::MAX };
    let hold_ms = zone.params.as_ref().map_or(0, |p| p.hold_ms);
    let nodes = if mode == Mode::Share { fleet_nodes(mcf, index) } else { 0 };
    Limit { entry, rate, cost, mode, strict, stale_ms, hold_ms, nodes, bucket: None }
}

/// Whether a zone's Redis works: as this worker's thread last saw it, and
/// as the node's sender sees it (shared memory: at once, whichever worker
/// asks).
#[inline]
pub fn backend_up(mcf: &MainConf, ch: &Channel, zone: usize) -> bool {
    ch.is_up(zone)
        && mcf.zones[zone].shared.as_ref().is_none_or(|s| Stats::get(&s.stats().down) == 0)
}

/// One limit's decision, as a debug line (compiled out unless nginx was
/// built `--with-debug`; written only with `error_log ... debug` or
/// `debug_connection`).
#[inline(always)]
fn trace(log: *mut ngx_log_t, mcf: &MainConf, a: &Ask<'_>, id: EntryId, mode: Mode, s: &Checked) {
    if !ngx::log::DEBUG || log.is_null() {
        return;
    }
    ngx_log_debug!(
        mask: DebugMask::Http,
        log,
        "redis_ratelimit: zone \"{}\" key #{:016x} {}: estimate {:.2}, {:.2} after, mode {}: {}",
        mcf.zones[a.zone].name,
        id.0[0],
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
fn identify<'m>(mcf: &'m MainConf, a: &Ask<'_>) -> Result<(&'m Shared, EntryId), NoZone> {
    let shared = mcf.zones.get(a.zone).and_then(|z| z.shared.as_ref()).ok_or(NoZone)?;
    Ok((shared, entry_id(shared, a)))
}

/// The id of `a`'s entry in the zone's table.
#[inline]
pub fn entry_id(shared: &Shared, a: &Ask<'_>) -> EntryId {
    let ns = if a.zone_named { shared.name } else { shared.ids.namespace(a.namespace) };
    // a bucket's entry is not its key's window's
    let period = match a.bucket {
        Some(_) => bucket::entry_period(a.rate),
        None => a.rate.period,
    };
    shared.ids.id_in(ns, period, a.key)
}

/// Queues one counted request for the zone's Redis thread.
#[inline]
fn queue(mcf: &MainConf, ch: &Channel, a: &Ask<'_>, id: EntryId, p: &Push) {
    let item = ItemId { zone: a.zone as u32, entry: id, window: p.window };
    let inc = Increment {
        namespace: a.namespace,
        key: a.key,
        period: a.rate.period,
        limit: p.limit,
        n: p.n,
        fresh: p.fresh,
    };
    if !ch.push(item, inc, p.due) {
        // the queue is full: the count stays on this node, waiting for no
        // answer
        if let Some(s) = mcf.zones[a.zone].shared.as_ref() {
            Stats::bump(&s.stats().dropped);
            let mut locked = s.lock();
            if let Some(i) = locked.table.find(id) {
                ratelimit_core::counter::keep_local(locked.table.entry_mut(i), p.window, p.n);
            }
        }
    }
}
