//! The decision for one request, pure: given the entries of its keys
//! (locked by the caller), its limits and now, whether it passes, what it
//! counts, and which increments go to Redis when. The caller (the engine)
//! finds and locks the entries, then queues the increments and logs.
//!
//! Steps: check every limit against its entry (the counts, the breaker,
//! this node's share near the limit, the zone's backend state, Redis's
//! verdict for a strict limit); count the request only if every limit
//! passes (or always, or never, as `Take` says), once per entry however
//! many limits share it, at the heaviest of their costs; say for each
//! counted entry when its increment goes (`sync::when`, at once for a key
//! near any of its limits); answer with the tightest limit.
//!
//! `many_into` is the decision; `one` is the same decision for the most
//! common request, one limit, without the bookkeeping for shared entries
//! (a property test holds it to `many_into`).

use crate::bucket::{self, Bucket};
use crate::counter::{self, Check, Fresh};
use crate::rate::Rate;
use crate::share;
use crate::sync::{self, Due};
use crate::table::Entry;
use crate::window::Estimate;

/// How long a request rejected by `on_error=deny` is told to wait.
pub const DENY_RETRY_MS: u64 = 1000;

/// How a zone counts right now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// In this node's shared memory only (no backend, or no thread).
    Local,
    /// Through the zone's Redis backend (also while it is down with
    /// `on_error=local`: the increments then stay counted locally).
    Remote,
    /// Backend down, `on_error=allow`: pass without counting.
    Allow,
    /// Backend down, `on_error=deny`: reject.
    Deny,
    /// Backend down, `on_error=share`: counted here (sent when it is
    /// back), each key within this node's share of its limit
    /// (`share::cap_to_fleet_share`).
    Share,
}

impl Mode {
    pub fn as_str(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::Remote => "redis",
            Mode::Allow => "allow (redis down)",
            Mode::Deny => "deny (redis down)",
            Mode::Share => "share (redis down)",
        }
    }

    /// What the zone's backend state makes of a decision from the counts.
    #[inline(always)]
    pub fn apply(self, check: &mut Check, now_ms: u64) {
        match self {
            Mode::Allow => check.allowed = true,
            Mode::Deny => {
                check.allowed = false;
                check.retry_at_ms = now_ms + DENY_RETRY_MS;
            }
            Mode::Local | Mode::Remote | Mode::Share => {}
        }
    }

    /// Whether the zone's increments go to Redis (now, or once it is
    /// back).
    #[inline(always)]
    pub fn remote(self) -> bool {
        matches!(self, Mode::Remote | Mode::Share)
    }

    /// Whether a zone in this mode counts the requests it lets through
    /// (not while its backend's `on_error` lets every one through or
    /// rejects it).
    #[inline(always)]
    pub fn counts(self) -> bool {
        matches!(self, Mode::Local | Mode::Remote | Mode::Share)
    }
}

/// A limit's part in strict mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strict {
    /// A background limit: this node decides from its view of the counts.
    Background,
    /// A limit Redis decides, checked before Redis is asked: rejected here only
    /// when Redis's own counts (or the breaker) put the key at its limit.
    /// This node's unconfirmed increments are left out: a strict answer's
    /// count may hold them already (their own answer not applied yet), and
    /// counted twice they would refuse a small limit's last requests that
    /// Redis would allow.
    Asking,
    /// A limit Redis decides, counted without waiting for it (`count_if=`
    /// after the response, a Lua caller): counted here in flight, no
    /// increment pushed; the count goes down the zone's strict link, ahead
    /// of the worker's next check of the key.
    CountOnly,
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
    #[inline(always)]
    fn decided(self) -> bool {
        matches!(self, Strict::Allowed | Strict::Rejected)
    }
}

/// Which requests are counted: those allowed, every one (Lua's
/// `measure`, a `count_if=` count after the response), or none (the
/// check before a strict request's wait).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Take {
    IfAllowed,
    Always,
    Never,
}

impl Take {
    /// Whether a request `allowed` (or not) is counted.
    #[inline(always)]
    pub fn counts(self, allowed: bool) -> bool {
        match self {
            Take::IfAllowed => allowed,
            Take::Always => true,
            Take::Never => false,
        }
    }
}

/// One limit of a request, as the decision sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    /// Its entry, by index in the request's `Entries` (limits of one key
    /// and period share one).
    pub entry: usize,
    pub rate: Rate,
    /// What the request weighs (1 usually; 0 checks without counting).
    pub cost: u32,
    pub mode: Mode,
    pub strict: Strict,
    /// How long the zone's increments may wait for Redis before the
    /// node's view of a key counts as stale (`share::cap_to_share`;
    /// `u64::MAX` while the backend is known down).
    pub stale_ms: u64,
    /// The zone's `hold=` (ms).
    pub hold_ms: u64,
    /// The nodes that counted through the zone's Redis lately (0: not
    /// known): one node's part of a key it has no share of, while Redis
    /// is down with `on_error=share`.
    pub nodes: u32,
    /// limit_req's bucket (`burst=`, `delay=`, `nodelay`) instead of the
    /// sliding window.
    pub bucket: Option<Bucket>,
}

/// What one limit said.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Checked {
    pub check: Check,
    /// The estimate after this request was counted (or not).
    pub after: Estimate,
    /// A bucket's own answer (its excess, the delay), for a bucket.
    pub bucket: Option<bucket::Checked>,
}

/// The decision for a request.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Decision {
    pub allowed: bool,
    /// The tightest limit's L when allowed, 0 when rejected: with the
    /// estimate after the request (`checked.after`) it tells how many
    /// requests are left, which is worked out only if asked (`remaining`).
    pub limit: u32,
    /// When rejected: the earliest time (ms) every rejecting limit allows a
    /// request again.
    pub retry_at_ms: u64,
    /// The limit the answer speaks of: the first that rejected, else the
    /// one with the fewest requests left.
    pub tightest: usize,
    /// What that limit said.
    pub checked: Checked,
    /// How long an allowed request waits first (ms): the longest of its
    /// buckets' delays, as `limit_req` takes it.
    pub delay_ms: u64,
    /// The limit that delays it (its index) and that bucket's excess with
    /// the request (thousandths), for the log line.
    pub delaying: usize,
    pub delay_excess: u64,
    /// Rejected because the key is blocked (an operator's block or a
    /// `block=` line's penalty), not by a count.
    pub blocked: bool,
}

impl Decision {
    /// The rejection of a blocked key until `until`, spoken of by limit
    /// `tightest` of `rate`.
    pub fn blocked(tightest: usize, rate: Rate, until: u64) -> Decision {
        let estimate = Estimate::new(0, 0, 0, rate.period_ms());
        let check = Check {
            allowed: false,
            cur: 0,
            estimate,
            retry_at_ms: until,
            window: 0,
            window_start_ms: 0,
        };
        Decision {
            allowed: false,
            limit: 0,
            retry_at_ms: until,
            tightest,
            checked: Checked { check, after: estimate, bucket: None },
            delay_ms: 0,
            delaying: 0,
            delay_excess: 0,
            blocked: true,
        }
    }

    /// Requests left under the tightest limit, after this one (0 when
    /// rejected).
    pub fn remaining(&self) -> u32 {
        self.checked.after.remaining(self.limit)
    }
}

/// An increment to queue for the zone's Redis thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Push {
    /// The limit whose key and zone it is for (the first of its entry).
    pub limit_index: usize,
    /// The window it was counted in.
    pub window: u64,
    /// The tightest L of the limits sharing the entry.
    pub limit: u32,
    /// What it adds.
    pub n: u32,
    pub due: Due,
    pub fresh: Fresh,
}

/// An entry counted through Redis: its first limit, the tightest L of
/// the limits sharing it, what it added.
#[derive(Clone, Copy)]
struct Counted {
    limit_index: usize,
    limit: u32,
    n: u32,
}

/// The entries of a request's keys, locked by the caller.
pub trait Entries {
    fn entry(&mut self, i: usize) -> &mut Entry;
}

impl Entries for [Entry] {
    fn entry(&mut self, i: usize) -> &mut Entry {
        &mut self[i]
    }
}

/// Up to this many limits of a request are kept without allocating.
pub const INLINE: usize = 4;

/// A request's limits' results, one per limit.
pub type CheckedAll = smallvec::SmallVec<[Checked; INLINE]>;
/// The increments a request queues.
pub type Pushes = smallvec::SmallVec<[Push; INLINE]>;

/// Checks one limit against its entry.
#[inline(always)]
fn check(e: &mut Entry, l: &Limit, now_ms: u64) -> Checked {
    if let Some(b) = l.bucket {
        return check_bucket(e, l, &b, now_ms);
    }
    let mut check = if l.strict == Strict::Asking {
        counter::check_known(e, l.rate, now_ms, l.cost)
    } else {
        let mut c = counter::check_cost(e, l.rate, now_ms, l.cost);
        match l.mode {
            // near the limit, or waiting too long for Redis, no more than
            // a part of this node's share of the headroom before Redis
            // answers
            Mode::Remote => share::cap_to_share(e, l.rate, now_ms, l.cost, 1, l.stale_ms, &mut c),
            Mode::Share => share::cap_to_fleet_share(e, l.rate, now_ms, l.cost, l.nodes, &mut c),
            Mode::Local | Mode::Allow | Mode::Deny => {}
        }
        c
    };
    l.mode.apply(&mut check, now_ms);
    verdict(l.strict, &mut check, now_ms);
    Checked { check, after: check.estimate, bucket: None }
}

/// A bucket's check as the window's answer reads it: passes or not, when
/// a request would pass at once, and an estimate whose headroom under
/// `burst + 1` (`limit_of_bucket`) is what the burst has left.
///
/// A bucket Redis decides (a Redis zone's) is checked here on this node's
/// view of the fleet's level (`Strict::Asking`: a key over its burst is
/// rejected without a round trip, and one far from it may be decided
/// here, `local`, then counted as `Strict::CountOnly`), and decided by
/// Redis's verdict on the level its answer left (`Allowed`, `Rejected`);
/// without an answer, `on_error` decides on this node's view, as for a
/// bucket of its own.
fn check_bucket(e: &Entry, l: &Limit, b: &Bucket, now_ms: u64) -> Checked {
    let level = Some(bucket::level_of(e));
    let mut c = match l.strict {
        Strict::Allowed => bucket::admitted(level, l.rate, b, now_ms),
        Strict::Rejected => bucket::refused(level, l.rate, b, l.cost, now_ms),
        _ => bucket::check(level, l.rate, b, l.cost, now_ms),
    };
    if l.strict == Strict::Asking && l.mode == Mode::Remote {
        // far from the burst, this node may decide it (`bucket::fleet`)
        c.local = bucket::fleet::local(e, l.rate, b.burst, &c, l.cost, l.nodes, now_ms);
    }
    match l.mode {
        Mode::Allow if !l.strict.decided() => c.allowed = true,
        Mode::Deny if !l.strict.decided() => {
            c.allowed = false;
            c.at_once_ms = now_ms + DENY_RETRY_MS;
        }
        _ => {}
    }
    let used =
        u32::try_from(c.excess.div_ceil(bucket::MILLI)).unwrap_or(u32::MAX).saturating_add(1);
    let estimate = Estimate::new(0, used, 0, l.rate.period_ms());
    let check = Check {
        allowed: c.allowed,
        cur: 0,
        estimate,
        retry_at_ms: c.at_once_ms,
        window: 0,
        window_start_ms: now_ms,
    };
    Checked { check, after: estimate, bucket: Some(c) }
}

/// The L a bucket's answer speaks of: its burst and the request itself.
fn limit_of_bucket(l: &Limit) -> u32 {
    match l.bucket {
        Some(b) => b.burst.saturating_add(1),
        None => l.rate.limit,
    }
}

/// What Redis decided for a strict limit replaces the decision from the
/// counts (which have its answer applied: the estimate and the time to
/// retry come from them).
#[inline(always)]
fn verdict(strict: Strict, check: &mut Check, now_ms: u64) {
    match strict {
        Strict::Allowed => check.allowed = true,
        Strict::Rejected => {
            if check.allowed {
                // the counts here moved on since Redis answered
                check.retry_at_ms = now_ms + DENY_RETRY_MS;
            }
            check.allowed = false;
        }
        Strict::Background | Strict::Asking | Strict::CountOnly | Strict::Failed => {}
    }
}

/// Counts the request in an entry, unless the zone's `on_error` says it
/// is not counted. Returns whether an increment is to go to Redis.
#[inline(always)]
fn count(e: &mut Entry, mode: Mode, cost: u32) -> bool {
    if !mode.counts() {
        return false;
    }
    counter::count_cost(e, mode.remote(), cost);
    mode.remote() && cost > 0
}

/// The decision for a request of one limit, as `many` makes it, on one
/// entry. `queue`: the zone has a Redis thread to push to.
#[inline(always)]
pub fn one(
    e: &mut Entry,
    l: &Limit,
    now_ms: u64,
    take: Take,
    queue: bool,
) -> (Decision, Option<Push>) {
    if l.bucket.is_some() {
        let (mut all, mut pushes) = (CheckedAll::new(), Pushes::new());
        let one = Limit { entry: 0, ..*l };
        let entries = std::slice::from_mut(e);
        let d = many_into(entries, &[one], now_ms, take, queue, &mut all, &mut pushes);
        return (d, pushes.first().copied());
    }
    let mut checked = check(e, l, now_ms);
    let allowed = checked.check.allowed;
    // what Redis decided it counted already
    let counted = take.counts(allowed) && l.mode.counts() && !l.strict.decided();
    let send = counted && count(e, l.mode, l.cost) && l.strict != Strict::CountOnly;
    if l.strict != Strict::Background && !l.strict.decided() {
        // checked without this node's unconfirmed increments (`Asking`),
        // or counted in Redis: the entry's estimate as it is now (decided
        // by Redis, nothing counted here: the estimate checked is that)
        checked.after = counter::estimate(e, l.rate, now_ms);
    } else if counted {
        // the entry's estimate with this request in it (what
        // `counter::estimate` gives now, without a second pass)
        checked.after = checked.check.estimate.plus(l.cost);
    }
    let push = if send && queue {
        let due = sync::when(l.rate, checked.after, e.inflight, e.share, now_ms, l.hold_ms);
        counter::wait(e, due.prompt(), now_ms);
        Some(Push {
            limit_index: 0,
            window: checked.check.window,
            limit: l.rate.limit,
            n: l.cost,
            due,
            fresh: counter::fresh(e),
        })
    } else {
        None
    };
    let d = Decision {
        allowed,
        limit: if allowed { l.rate.limit } else { 0 },
        retry_at_ms: if allowed { now_ms } else { checked.check.retry_at_ms },
        tightest: 0,
        checked,
        delay_ms: 0,
        delaying: 0,
        delay_excess: 0,
        blocked: false,
    };
    (d, push)
}

/// The decision for a request of any limits (at least one), writing what
/// each limit said into `all` and the increments to queue into `pushes`
/// (the caller's: lists of a few hundred bytes are not moved on the way
/// out). Every decision is this one; `one` is its fast path for a request
/// of one limit, held to it by a property test.
pub fn many_into<E: Entries + ?Sized>(
    entries: &mut E,
    limits: &[Limit],
    now_ms: u64,
    take: Take,
    queue: bool,
    all: &mut CheckedAll,
    pushes: &mut Pushes,
) -> Decision {
    all.clear();
    pushes.clear();
    all.extend(limits.iter().map(|l| check(entries.entry(l.entry), l, now_ms)));
    let allowed = all.iter().all(|c| c.check.allowed);

    // count, once per entry
    let mut counts: smallvec::SmallVec<[Counted; INLINE]> = smallvec::SmallVec::new();
    if take.counts(allowed) {
        for (i, l) in limits.iter().enumerate() {
            let sharing = || limits.iter().filter(move |o| o.entry == l.entry);
            if limits[..i].iter().any(|o| o.entry == l.entry) {
                continue; // counted with the first limit of its entry
            }
            if sharing().any(|o| o.strict.decided()) {
                continue; // Redis counted it, for every limit of the entry
            }
            // limits sharing the entry (tiers of one period) count the
            // request once, at its heaviest (a `count_if=` limit's 0 in
            // preaccess does not hide another's cost)
            if let Some(c) = all[i].bucket {
                // a bucket keeps what the request leaves in it, here only
                if l.mode.counts() {
                    let e = entries.entry(l.entry);
                    bucket::store(e, bucket::commit(&c, now_ms));
                    if l.strict == Strict::CountOnly && l.mode == Mode::Remote {
                        // decided here (far from the burst): what the
                        // node owes Redis goes, once it is enough
                        let b = l.bucket.map_or(0, |b| b.burst);
                        let owed = bucket::fleet::owe(e, l.rate, b, l.cost, l.nodes, now_ms);
                        if let Some(c) = all[i].bucket.as_mut() {
                            c.owed = owed;
                        }
                    }
                }
                continue;
            }
            let cost = sharing().map(|o| o.cost).max().unwrap_or(l.cost);
            let limit = sharing().map(|o| o.rate.limit).min().unwrap_or(l.rate.limit);
            if count(entries.entry(l.entry), l.mode, cost) && l.strict != Strict::CountOnly {
                counts.push(Counted { limit_index: i, limit, n: cost });
            }
        }
    }
    for (l, c) in limits.iter().zip(all.iter_mut()) {
        if c.bucket.is_none() {
            c.after = counter::estimate(entries.entry(l.entry), l.rate, now_ms);
        }
    }

    // when each increment goes, as the limits of its entry say (`sync`): a
    // key near any of them goes at once, and then waits for Redis's answer
    if queue {
        for &Counted { limit_index: i, limit, n } in &counts {
            let entry = limits[i].entry;
            let (unsent, share) = {
                let e = entries.entry(entry);
                (e.inflight, e.share)
            };
            let due = limits
                .iter()
                .zip(all.iter())
                .filter(|(o, _)| o.entry == entry)
                .map(|(o, c)| sync::when(o.rate, c.after, unsent, share, now_ms, o.hold_ms))
                .fold(Due::LATEST, Due::min);
            let e = entries.entry(entry);
            let fresh = counter::fresh(e);
            counter::wait(e, due.prompt(), now_ms);
            pushes.push(Push { limit_index: i, window: all[i].check.window, limit, n, due, fresh });
        }
    }

    // the answer
    let (tightest, retry_at_ms) = if allowed {
        let mut tightest = 0;
        let mut remaining = u32::MAX;
        for (i, (l, c)) in limits.iter().zip(all.iter()).enumerate() {
            let left = c.after.remaining(limit_of_bucket(l));
            if left < remaining {
                remaining = left;
                tightest = i;
            }
        }
        (tightest, now_ms)
    } else {
        let tightest = all.iter().position(|c| !c.check.allowed).unwrap_or(0);
        let retry =
            all.iter().filter(|c| !c.check.allowed).fold(now_ms, |r, c| r.max(c.check.retry_at_ms));
        (tightest, retry)
    };
    let (mut delay_ms, mut delaying, mut delay_excess) = (0, 0, 0);
    if allowed {
        for (i, b) in all.iter().enumerate().filter_map(|(i, c)| Some((i, c.bucket?))) {
            if b.delay_ms > delay_ms {
                (delay_ms, delaying, delay_excess) = (b.delay_ms, i, b.excess);
            }
        }
    }
    Decision {
        allowed,
        limit: if allowed { limit_of_bucket(&limits[tightest]) } else { 0 },
        retry_at_ms,
        tightest,
        checked: all[tightest],
        delay_ms,
        delaying,
        delay_excess,
        blocked: false,
    }
}

#[cfg(test)]
#[path = "decide_tests.rs"]
mod tests;
