//! `limit_req`'s leaky bucket, pure: a key's excess, in thousandths of a
//! request, drains at the rate; a request adds its cost (a thousand per
//! request); one that would take the excess over `burst` is rejected and
//! adds nothing; one that takes it over `delay` waits until the excess above
//! `delay` has drained (`nodelay`: never). The arithmetic of
//! `ngx_http_limit_req_module.c`, with two differences:
//!
//! - the drain is exact for every period (nginx keeps the rate as
//!   thousandths of a request per second in an integer: `1r/m` drains 16
//!   a second there, 16.67 here; it has no `r/h` or `r/d`);
//! - a request may weigh more than one (`cost=`). A key's level may fall to
//!   one request below empty (a key that was idle), and the request's cost
//!   is added to that: a request of cost 1 to an idle key leaves the excess
//!   at 0, as nginx's first request of a key does, and one of cost 3 leaves
//!   2 000.

use crate::rate::Rate;
use crate::table::Entry;

/// A thousandth of a request: the unit of the excess.
pub const MILLI: u64 = 1000;

/// The most `burst=` and `delay=` accept.
pub const MAX_BURST: u32 = 1_000_000;

/// When a request over the rate waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delay {
    /// Once the excess is above this many requests (`delay=N`; 0 when
    /// none of `delay=` and `nodelay` is given, as in `limit_req`).
    Above(u32),
    /// Never (`nodelay`): what the burst lets through passes at once.
    Never,
}

/// A `redis_ratelimit` line's bucket: `burst=` (0 by default) and when a
/// request waits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub burst: u32,
    pub delay: Delay,
}

impl Bucket {
    /// The excess (thousandths) up to which a request passes at once.
    fn at_once(&self) -> u64 {
        match self.delay {
            Delay::Above(d) => u64::from(d.min(self.burst)) * MILLI,
            Delay::Never => u64::from(self.burst) * MILLI,
        }
    }
}

/// A key's bucket: its excess (thousandths of a request) as of `last_ms`
/// (`Option<Level>`: `None` for a key not seen yet).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Level {
    pub excess: u64,
    pub last_ms: u64,
}

/// What a bucket says of one request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Checked {
    pub allowed: bool,
    /// The key's excess with this request in it (for a rejected request,
    /// what it would have been: `limit_req` logs that).
    pub excess: u64,
    /// How long an allowed request waits (ms; 0: not delayed).
    pub delay_ms: u64,
    /// When a request of the same cost would pass without waiting (ms
    /// since the epoch; `now` if it would now): `Retry-After` of a
    /// rejected request.
    pub at_once_ms: u64,
    /// A bucket of a zone with Redis (`fleet`): this node may decide the
    /// request on its own (far from the burst).
    pub local: bool,
    /// And what the node owes Redis of the key, taken to be sent with this
    /// request (thousandths; 0: nothing).
    pub owed: u64,
}

impl Checked {
    /// Requests left before the burst is used up, after this one.
    pub fn remaining(&self, b: &Bucket) -> u32 {
        let room = (u64::from(b.burst) * MILLI).saturating_sub(self.excess) / MILLI;
        u32::try_from(room).unwrap_or(u32::MAX)
    }
}

#[path = "bucket_fleet.rs"]
pub mod fleet;

/// Thousandths of a request a bucket of `rate` drains in `ms`.
pub fn drained(rate: Rate, ms: u64) -> u64 {
    let milli = u128::from(rate.limit) * u128::from(ms) * u128::from(MILLI);
    u64::try_from(milli / u128::from(rate.period_ms().max(1))).unwrap_or(u64::MAX)
}

/// How long (ms) a bucket of `rate` takes to drain `milli` thousandths,
/// rounded down as `limit_req` rounds its delays.
pub fn drain_ms(rate: Rate, milli: u64) -> u64 {
    let ms =
        u128::from(milli) * u128::from(rate.period_ms()) / (u128::from(rate.limit.max(1)) * 1000);
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// The level of a key at `now_ms` before a request is added, in
/// thousandths (at least one request below empty): its stored excess less
/// what drained since (a key not seen yet, or idle long enough, is at the
/// floor). A clock that went back drains nothing.
fn before(level: Option<Level>, rate: Rate, now_ms: u64) -> i128 {
    let floor = -i128::from(MILLI);
    match level {
        None => floor,
        Some(l) => {
            let gone = drained(rate, now_ms.saturating_sub(l.last_ms));
            (i128::from(l.excess) - i128::from(gone)).max(floor)
        }
    }
}

/// Checks a request of `cost` against a key's bucket (nothing changes:
/// `commit` stores what an allowed request leaves).
pub fn check(level: Option<Level>, rate: Rate, b: &Bucket, cost: u32, now_ms: u64) -> Checked {
    let was = before(level, rate, now_ms);
    let with = (was + i128::from(cost) * i128::from(MILLI)).max(0);
    let with = u64::try_from(with).unwrap_or(u64::MAX);
    let burst = u64::from(b.burst) * MILLI;
    let at_once = b.at_once();
    if with > burst {
        return Checked {
            allowed: false,
            excess: with,
            delay_ms: 0,
            at_once_ms: now_ms + ceil_drain_ms(rate, with.saturating_sub(at_once)),
            local: false,
            owed: 0,
        };
    }
    // it waits until the excess above `at_once` has drained
    let delay_ms = drain_ms(rate, with.saturating_sub(at_once));
    Checked {
        allowed: true,
        excess: with,
        delay_ms,
        at_once_ms: now_ms + delay_ms,
        local: false,
        owed: 0,
    }
}

/// `drain_ms` rounded up: the first whole ms by which `milli` has drained.
fn ceil_drain_ms(rate: Rate, milli: u64) -> u64 {
    let num = u128::from(milli) * u128::from(rate.period_ms());
    let den = u128::from(rate.limit.max(1)) * 1000;
    u64::try_from(num.div_ceil(den)).unwrap_or(u64::MAX)
}

/// What an allowed request leaves in the key's bucket.
pub fn commit(c: &Checked, now_ms: u64) -> Level {
    Level { excess: c.excess, last_ms: now_ms }
}

/// A request Redis's script admitted (`strict.lua`), on the key's level as
/// Redis left it (`mirror`), which holds the request: its excess and its
/// delay as `check` would have given them there.
pub fn admitted(level: Option<Level>, rate: Rate, b: &Bucket, now_ms: u64) -> Checked {
    let excess = u64::try_from(before(level, rate, now_ms).max(0)).unwrap_or(0);
    let delay_ms = drain_ms(rate, excess.saturating_sub(b.at_once()));
    Checked { allowed: true, excess, delay_ms, at_once_ms: now_ms + delay_ms, ..NONE }
}

/// A `Checked` with nothing in it (for `..` in the others).
const NONE: Checked =
    Checked { allowed: false, excess: 0, delay_ms: 0, at_once_ms: 0, local: false, owed: 0 };

/// A request Redis's script rejected, on the key's level as Redis left it:
/// what `check` says there, rejected whatever it says (a level that
/// drained meanwhile is retried a request's drain from now).
pub fn refused(level: Option<Level>, rate: Rate, b: &Bucket, cost: u32, now_ms: u64) -> Checked {
    let c = check(level, rate, b, cost, now_ms);
    let at_once_ms = if c.allowed { now_ms + ceil_drain_ms(rate, MILLI) } else { c.at_once_ms };
    Checked { allowed: false, delay_ms: 0, at_once_ms, ..c }
}

/// The level Redis's script answers for a key (`held`: its excess plus
/// one request, never below 0), as this node keeps it at `now_ms`: a
/// level below empty is an empty one that much earlier.
pub fn mirror(held: u64, rate: Rate, now_ms: u64) -> Level {
    match held.checked_sub(MILLI) {
        Some(excess) => Level { excess, last_ms: now_ms },
        None => {
            Level { excess: 0, last_ms: now_ms.saturating_sub(ceil_drain_ms(rate, MILLI - held)) }
        }
    }
}

/// The largest rate a bucket takes (requests per period): what its entry
/// id's period part has room for (`id_period`).
pub const MAX_BUCKET_LIMIT: u32 = (1 << 29) - 1;

/// What a bucket's entry id is made with in place of the period (the
/// table's ids hash a namespace, a period and a key): a value no window's
/// period takes (the top bit set), one per rate, so a key's bucket and its
/// windows never share an entry, and lines of one zone with one rate share
/// the bucket, as `limit_req` lines of one zone do. `None` for a rate
/// above `MAX_BUCKET_LIMIT` or a period other than r/s, r/m, r/h, r/d.
pub fn id_period(rate: Rate) -> Option<u32> {
    let unit = match rate.period {
        1 => 0,
        60 => 1,
        3600 => 2,
        86400 => 3,
        _ => return None,
    };
    (rate.limit <= MAX_BUCKET_LIMIT).then_some(1 << 31 | unit << 29 | rate.limit)
}

/// The period part of a bucket's entry id: `id_period`, or for a rate
/// above a bucket's largest (from variables) the top value, still no
/// window's.
pub fn entry_period(rate: Rate) -> u32 {
    id_period(rate).unwrap_or(u32::MAX)
}

/// A bucket's level as its table entry keeps it: the excess in `cur`
/// (thousandths; at most `MAX_BURST` requests of them), the time of its
/// last change in `blocked_until_ms` (never after now, so never read as an
/// open breaker). A new entry (all zero) reads as a key long idle, which
/// is what a key not seen yet is.
pub fn level_of(e: &Entry) -> Level {
    Level { excess: u64::from(e.cur), last_ms: e.blocked_until_ms }
}

/// Stores what an allowed request leaves (`commit`) in the key's entry.
pub fn store(e: &mut Entry, l: Level) {
    e.cur = u32::try_from(l.excess).unwrap_or(u32::MAX);
    e.blocked_until_ms = l.last_ms;
}

#[cfg(test)]
#[path = "bucket_tests.rs"]
mod tests;
