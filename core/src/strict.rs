//! Strict mode: the decision made in Redis, atomically, by a script that
//! decides one or more keys a call. What the script is, what it is given,
//! and how its answer is read; `decide` is the same decision in Rust (the
//! script's reference, and what the unit tests check the arithmetic of).
//!
//! For each key (a group of its requests), the script reads both windows
//! of the key (they share a hash tag, so one cluster slot), checks each
//! request of the group in order against the sliding estimate
//! (`estimate + cost − 1 < L`), adds only the allowed ones to the current
//! window (rejected requests are not counted), sets the counter's TTL when
//! it created it, and answers the counts and one flag per request.
//! Requests of one key that wait together share one group; a worker's
//! link puts the keys it writes together in one call (a cluster's keys go
//! a call each: one slot per call).
//!
//! Each request carries its deadline in Redis's clock (when it stops
//! waiting and `on_error` decides it): a script that runs after it (Redis
//! was stalled, the call sat in a buffer) neither checks nor counts that
//! request, so a request denied for the timeout is never counted late.
//! The node learns the offset of Redis's clock from its own with `TIME`
//! when it connects; without it (an ACL that refuses `TIME`) deadlines are
//! 0, and the script counts whatever time it runs.
//!
//! A request that happened already (a `count_if=` count, after the
//! response) goes down the same call as the checks (deadline `COUNTED`):
//! the script counts it whatever the estimate. On the worker's strict link
//! it is then in Redis before any later check of the key from that worker.

use crate::key::EntryId;
use crate::key::{write_bucket_key_for_tag, write_conn_key_for_tag, write_key_for_tag};
use crate::rate::Rate;
use crate::resp;
use crate::tickets::Ticket;

#[path = "strict_answer.rs"]
mod answer;
#[path = "strict_texts.rs"]
mod texts;
pub use answer::{parse_answer, Answer, Answers, Outcome, Part, Verdicts};
pub use texts::Texts;

/// The most requests a period a limit may allow to be decided in Redis
/// without `strict` (`small`).
pub const SMALL_MAX: u32 = 20;

/// Whether a limit is small enough to be decided in Redis as `strict` is,
/// on a zone with Redis: at most `SMALL_MAX` requests a period and no more
/// than one a second on average. Decided in the background, each node's
/// first requests for a key (before its first reply) and those of the
/// nodes that count while it waits for one could pass the limit several
/// times over, which a login or password-reset rule cannot afford; such a
/// key's allowed requests are few, so a round trip each costs little (a
/// key over its limit is refused at once, without one).
#[inline]
pub fn small(rate: Rate) -> bool {
    rate.limit <= SMALL_MAX && rate.limit <= rate.period
}

/// What a bucket group's first argument (the time into the window for a
/// window's group) is made of: this plus its `burst=`, a value no time
/// into a window reaches (the script tells the two apart by it).
pub const BUCKET_MARK: u64 = 1 << 40;

/// What a conn group's first argument is (`Kind::Conn`): a value no time
/// into a window and no bucket's mark reaches.
pub const CONN_MARK: u64 = 1 << 41;

/// How a conn group's answer packs two numbers in one integer: the low
/// part below this, the high part times it (`conn_fleet::Reply`).
pub const CONN_SPLIT: u64 = 1 << 20;

/// What a group decides: a key's sliding window, its bucket (limit_req's
/// `burst=`, of that many requests), or its slots in flight
/// (`redis_ratelimit_conn`: the holder's lease of the key's slots,
/// `conn_fleet`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Window,
    Bucket(u32),
    Conn,
}

impl Kind {
    /// A window's, or a bucket's of `burst`.
    #[inline]
    pub fn of_burst(burst: Option<u32>) -> Kind {
        burst.map_or(Kind::Window, Kind::Bucket)
    }

    /// A bucket's burst.
    #[inline]
    pub fn burst(self) -> Option<u32> {
        match self {
            Kind::Bucket(b) => Some(b),
            _ => None,
        }
    }
}

/// The deadline of a request that happened already: the script counts it
/// whatever the estimate and whenever it runs (written `-1`).
pub const COUNTED: u64 = u64::MAX;

/// A group's first argument when the group before it in the call has the
/// same limit, period and window: its four limit arguments are that
/// group's (a call's groups mostly share them, and each argument costs
/// Redis a string to read and the script one to make).
pub const SAME_AS_BEFORE: &[u8] = b"=";

/// The most groups (keys) one call decides: a call holds Redis for a few
/// µs per group.
pub const MAX_GROUPS: usize = 32;

/// A worker's strict link writes what waits once this many keys can go
/// (their keys have no call out), not at the end of the event loop's
/// turn: a turn that reads many requests would otherwise hold the first
/// one's call back for all the others, whose reading and answering takes
/// longer than a round trip to a Redis nearby. Six keys share a call's
/// fixed cost (a `send()`, Redis's reading and answering of one call).
pub const EARLY_GROUPS: usize = 6;

/// A link writes early (`EARLY_GROUPS`) only while fewer than this many
/// calls are out: a link with this many out is waiting for a Redis that
/// is slow or busy, and what waits goes at the end of the turn, in
/// calls as large as can be, which cost Redis less a key.
pub const EARLY_MAX_OUT: usize = 8;

/// The most integers one call's answer holds (two per group and one per
/// request), well within a reply's bounds (`resp::MAX_ARRAY`); a group
/// goes whole, however many requests it has.
pub const MAX_ANSWER: usize = 4096;

/// The script (`strict.lua`): one call decides one or more groups, each a
/// key's requests. `KEYS` two per group: the current window's counter,
/// then the previous one's. `ARGV[1]` is 1 when some request has a
/// deadline (`TIME` is then read once, before any write: Redis before 5
/// needs its effects replicated to allow that); then per group: time into
/// the window (ms), limit, period (ms), TTL (s) (or `SAME_AS_BEFORE`: those of the
/// group before), the number of requests, and per request its cost and
/// its deadline (ms in Redis's clock, 0: none, -1: counted whatever the
/// estimate, `COUNTED`).
///
/// Answers per group `cur, prev, a1, a2, ...` in one flat array, with `ai`
/// 1 when request `i` is allowed (and counted), 0 when it is not, 2 when
/// the script ran after its deadline (neither). One `MGET` reads every
/// group's windows (a cluster's call has one group, whose windows share
/// a slot); a group reads a counter an earlier group of the call wrote as
/// that group left it (two limits of one key, or a window that is the
/// next one's previous). A group whose counter holds something else
/// than an integer, or whose `INCRBY` fails (`WRONGTYPE`: a key of another
/// type reads as nil for `MGET`), counts nothing and answers `cur` -1, and
/// the call's other groups go on; a call of one group answers the error
/// reply itself (what a group that failed is called again alone for, to
/// learn and log).
pub const SCRIPT: &str = include_str!("strict.lua");

/// The script's SHA1 (what `EVALSHA` names it by), as Redis computes it;
/// worked out once.
pub fn sha1_hex() -> &'static str {
    static SHA: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SHA.get_or_init(|| {
        crate::sha1::sha1(SCRIPT.as_bytes()).iter().map(|b| format!("{b:02x}")).collect()
    })
}

/// A request's deadline in Redis's clock: when it stops waiting
/// (`deadline_ms`, this node's clock, 0: none) moved by what this node
/// learnt of Redis's clock (`offset_ms`, Redis's minus ours; `None`: not
/// known, no deadline).
pub fn redis_deadline(deadline_ms: u64, offset_ms: Option<i64>) -> u64 {
    match offset_ms {
        _ if deadline_ms == COUNTED => COUNTED,
        Some(off) if deadline_ms > 0 => deadline_ms.saturating_add_signed(off).max(1),
        _ => 0,
    }
}

/// The offset of Redis's clock from ours (ms, Redis's minus ours), from its
/// `TIME` answer (`secs`, `micros`) read between `before_ms` and
/// `after_ms` of our clock: Redis read its clock about halfway.
pub fn clock_offset(secs: u64, micros: u64, before_ms: u64, after_ms: u64) -> i64 {
    let redis = secs.saturating_mul(1000).saturating_add(micros / 1000);
    let ours = before_ms / 2 + after_ms / 2 + (before_ms % 2 + after_ms % 2) / 2;
    redis as i64 - ours as i64
}

/// One request of a group: its ticket (the caller's: which request waits
/// for the answer), its cost, and when it stops waiting (this node's
/// clock: 0 none, `COUNTED`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Request {
    pub ticket: Ticket,
    pub cost: u32,
    pub deadline_ms: u64,
}

/// One key's requests in a call: its two windows (under the call's prefix
/// and the key's hash `tag`), its limit, and its requests; or, for a
/// bucket (`Kind::Bucket`), the key's bucket of that rate (named twice,
/// where a window's group names its two windows); for a concurrency
/// limit (`Kind::Conn`), the key's hash of leases (named twice), its
/// `limit` the number, its `period` the lease (ms), and its two requests
/// the holder's slots in use and the slots it asks to hold, both counted
/// (`conn_fleet`).
#[derive(Clone, Copy, Debug)]
pub struct Group<'a> {
    pub tag: &'a [u8],
    /// What names the call's prefix and this tag for the writer, if the
    /// caller can say (a link's zone table entry: one prefix, and an entry
    /// per key): text kept for a key is then found by it, not by
    /// comparing bytes (`Texts`).
    pub key: Option<EntryId>,
    pub period: u32,
    pub window: u64,
    pub limit: u32,
    pub kind: Kind,
    pub requests: &'a [Request],
}

impl Group<'_> {
    /// Some request waits with a deadline (what makes the script read
    /// `TIME`, when Redis's clock is known).
    #[inline(always)]
    fn has_deadline(&self) -> bool {
        self.requests.iter().any(|r| r.deadline_ms > 0 && r.deadline_ms != COUNTED)
    }

    /// The script reads `TIME` for it: a bucket drains by Redis's clock
    /// (one clock for every node), a request's deadline is in it.
    #[inline(always)]
    fn timed(&self, offset_known: bool) -> bool {
        self.kind != Kind::Window || offset_known && self.has_deadline()
    }

    /// Its key's name in full (both of a bucket's are its bucket's).
    fn write_key(&self, out: &mut Vec<u8>, prefix: &[u8], start: u64) {
        match self.kind {
            Kind::Bucket(_) => {
                write_bucket_key_for_tag(out, prefix, self.tag, self.period, self.limit)
            }
            Kind::Conn => write_conn_key_for_tag(out, prefix, self.tag),
            Kind::Window => write_key_for_tag(out, prefix, self.tag, self.period, start),
        }
    }

    /// When its current window and the one before start (s).
    fn starts(&self) -> (u64, u64) {
        let p = u64::from(self.period);
        (self.window * p, self.window.saturating_sub(1) * p)
    }

    /// The first four of its arguments: the time into the window in ms
    /// (at `now_ms`), then the rate's three: limit, period in ms, TTL in
    /// seconds (two periods: the window is read as the previous one during
    /// the next). The four are the same for the groups of one limit,
    /// period and window (at one time): a group whose four are those of
    /// the group before it in the call sends `SAME_AS_BEFORE` instead
    /// (`same_limit`). The rate's three are the same for every group of
    /// the rate, and a writer keeps their text (`Texts`). A bucket's first
    /// is `BUCKET_MARK` plus its burst. A conn group's are `CONN_MARK`,
    /// the number, the lease (ms) and the holder (who writes the call).
    #[inline(always)]
    fn limit_args(&self, now_ms: u64, holder: u64) -> [u64; 4] {
        let p = u64::from(self.period) * 1000;
        let first = match self.kind {
            Kind::Bucket(b) => BUCKET_MARK + u64::from(b),
            Kind::Conn => return [CONN_MARK, u64::from(self.limit), self.period.into(), holder],
            Kind::Window => now_ms.saturating_sub(self.starts().0 * 1000).min(p),
        };
        [first, u64::from(self.limit), p, 2 * u64::from(self.period)]
    }

    /// The rest of its arguments: the number of requests, then per
    /// request its cost and its deadline in Redis's clock.
    #[inline(always)]
    fn request_args(&self, offset_ms: Option<i64>, mut f: impl FnMut(u64)) {
        f(self.requests.len() as u64);
        for r in self.requests {
            f(u64::from(r.cost));
            f(redis_deadline(r.deadline_ms, offset_ms));
        }
    }

    /// Whether `limit_args` are the same as `other`'s (at any one time).
    #[inline(always)]
    fn same_limit(&self, other: &Group) -> bool {
        self.limit == other.limit
            && self.period == other.period
            && self.window == other.window
            && self.kind == other.kind
    }
}

/// One call of the script: `EVALSHA <sha> <2 × groups>`, each group's two
/// keys, then whether `TIME` is needed and each group's arguments. `now_ms`
/// is when it is sent (the time into each window is worked out then);
/// `clock_offset_ms` moves deadlines into Redis's clock (`None`: unknown,
/// no deadline).
#[derive(Clone, Copy, Debug)]
pub struct Call<'a, G> {
    pub prefix: &'a [u8],
    pub now_ms: u64,
    pub clock_offset_ms: Option<i64>,
    /// Who writes it (a conn group's holder: `conn_fleet::holder`).
    pub holder: u64,
    /// Its groups (gone through once per part of the call).
    pub groups: G,
}

impl<'a, G: Iterator<Item = Group<'a>> + Clone> Call<'a, G> {
    /// Some request has a deadline in Redis's clock: the script reads
    /// `TIME`.
    fn timed(&self) -> bool {
        self.groups.clone().any(|g| g.timed(self.clock_offset_ms.is_some()))
    }

    /// Its groups, each with whether its limit arguments are those of the
    /// group before it (then written `SAME_AS_BEFORE`).
    fn same_as_before(&self) -> impl Iterator<Item = (Group<'a>, bool)> {
        self.groups.clone().scan(None, |before: &mut Option<Group<'a>>, g| {
            let same = before.is_some_and(|b| b.same_limit(&g));
            *before = Some(g);
            Some((g, same))
        })
    }

    /// Its words after `EVALSHA <sha>`, each handed to `f`.
    fn each(&self, mut f: impl FnMut(Word<'a>)) {
        f(Word::Number(2 * self.groups.clone().count() as u64));
        for g in self.groups.clone() {
            let (cur, prev) = g.starts();
            f(Word::Key(g, cur));
            f(Word::Key(g, prev));
        }
        f(Word::Number(u64::from(self.timed())));
        for (g, same) in self.same_as_before() {
            if same {
                f(Word::Bytes(SAME_AS_BEFORE));
            } else {
                for n in g.limit_args(self.now_ms, self.holder) {
                    f(Word::Number(n));
                }
            }
            g.request_args(self.clock_offset_ms, |n| {
                f(if n == COUNTED { Word::Bytes(b"-1") } else { Word::Number(n) })
            });
        }
    }

    /// The command's words (for a `redis::Cmd`).
    pub fn words(&self) -> Vec<Vec<u8>> {
        let mut out = vec![b"EVALSHA".to_vec(), sha1_hex().as_bytes().to_vec()];
        self.each(|w| {
            out.push(match w {
                Word::Bytes(b) => b.to_vec(),
                Word::Number(n) => n.to_string().into_bytes(),
                Word::Key(g, start) => {
                    let mut key = Vec::new();
                    g.write_key(&mut key, self.prefix, start);
                    key
                }
            })
        });
        out
    }

    /// The command written as RESP at the end of `out` (a strict link's
    /// request path: appended to room reserved once, no allocation per
    /// word). A call of one group whose key, window, flag and number of
    /// requests are those of the writer's last such call copies its text
    /// up to the arguments (`Texts::one`): a hot key's calls differ only
    /// in them.
    pub fn write(&self, out: &mut Vec<u8>, texts: &mut Texts) {
        let mut groups = self.groups.clone();
        let (Some(g), None) = (groups.next(), groups.next()) else {
            let mut w = self.write_head(out, texts);
            self.write_args(&mut w, texts);
            return;
        };
        let timed = g.timed(self.clock_offset_ms.is_some());
        let shape = (g.period, g.window, g.requests.len(), timed, g.kind, g.limit);
        let room = 28 * (5 + 2 * g.requests.len());
        if texts.one_shape == Some(shape) && texts.one_names(self.prefix, &g) {
            out.reserve(texts.one.len() + room);
            out.extend_from_slice(&texts.one);
        } else {
            let at = out.len();
            self.write_head(out, texts);
            texts.one.clear();
            texts.one.extend_from_slice(&out[at..]);
            texts.one_shape = Some(shape);
            texts.one_name.clear();
            texts.one_name.extend_from_slice(self.prefix);
            texts.one_name.push(b'{');
            texts.one_name.extend_from_slice(g.tag);
            texts.one_key = g.key;
        }
        let mut w = resp::Writer::new(out, room);
        self.write_group_args(&mut w, g, false, texts);
    }

    /// The array's head, `EVALSHA <sha>`, the number of keys, the keys and
    /// whether `TIME` is read; the writer has room for the arguments.
    fn write_head<'o>(&self, out: &'o mut Vec<u8>, texts: &mut Texts) -> resp::Writer<'o> {
        static HEAD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let head = HEAD.get_or_init(|| {
            let mut head = Vec::new();
            for w in [&b"EVALSHA"[..], sha1_hex().as_bytes()] {
                resp::bulk(&mut head, w);
            }
            head
        });
        // the array's head, the number of keys and the flag: at most 32
        let (mut groups, mut words, mut room) = (0, 4, 32 + head.len());
        let mut timed = false;
        for (g, same) in self.same_as_before() {
            groups += 1;
            words += if same { 4 } else { 7 } + 2 * g.requests.len();
            // keys (a period of at most 10 digits), then numbers of at
            // most 20 digits
            room +=
                2 * (self.prefix.len() + g.tag.len() + 14 + 28) + (5 + 2 * g.requests.len()) * 27;
            timed = timed || g.timed(self.clock_offset_ms.is_some());
        }
        let mut w = resp::Writer::new(out, room);
        w.array(words);
        w.put(head);
        w.bulk_u64(2 * groups as u64);
        for g in self.groups.clone() {
            let (cur, prev) = texts.tails(&g);
            // `<prefix>{<tag>`, then the window's tail (CRLF included)
            let name = self.prefix.len() + 1 + g.tag.len();
            let head_at = w.mark();
            w.bulk_head(name + cur.len() - 2);
            let name_at = w.mark();
            w.put(self.prefix);
            w.byte(b'{');
            w.put(g.tag);
            let tag_end = w.mark();
            w.put(cur);
            if prev.len() == cur.len() {
                // the same head and name (as a rule)
                w.again(head_at, tag_end);
            } else {
                w.bulk_head(name + prev.len() - 2);
                w.again(name_at, tag_end);
            }
            w.put(prev);
        }
        w.put(if timed { b"$1\r\n1\r\n" } else { b"$1\r\n0\r\n" });
        w
    }

    /// Every group's arguments.
    fn write_args(&self, w: &mut resp::Writer<'_>, texts: &mut Texts) {
        for (g, same) in self.same_as_before() {
            self.write_group_args(w, g, same, texts);
        }
    }

    /// A group's arguments: its limit's (`SAME_AS_BEFORE`: those of the group before
    /// it), then its requests'.
    #[inline(always)]
    fn write_group_args(
        &self,
        w: &mut resp::Writer<'_>,
        g: Group<'a>,
        same: bool,
        texts: &mut Texts,
    ) {
        if same {
            w.put(b"$1\r\n=\r\n");
        } else {
            let [elapsed, limit, period, ttl] = g.limit_args(self.now_ms, self.holder);
            w.bulk_u64(elapsed);
            if texts.rate == Some((g.limit, g.period, g.kind)) {
                w.put(&texts.rate_text);
            } else {
                let at = w.mark();
                for n in [limit, period, ttl] {
                    w.bulk_u64(n);
                }
                texts.rate_text.clear();
                texts.rate_text.extend_from_slice(w.since(at));
                texts.rate = Some((g.limit, g.period, g.kind));
            }
        }
        w.bulk_u64(g.requests.len() as u64);
        for r in g.requests {
            w.bulk_u64(u64::from(r.cost));
            match redis_deadline(r.deadline_ms, self.clock_offset_ms) {
                COUNTED => w.put(b"$2\r\n-1\r\n"),
                d => w.bulk_u64_near(d, &mut texts.deadline),
            }
        }
    }
}

/// One word of a call: bytes, a number, or a group's key of the window
/// that starts at this second (each written without a scratch copy).
enum Word<'a> {
    Bytes(&'a [u8]),
    Number(u64),
    Key(Group<'a>, u64),
}

/// The script's decision in Rust, with the same arithmetic: for counts
/// `prev`, `cur` at `elapsed_ms` into a window of `period_ms`, which of the
/// requests (`costs`, in order) a limit of `limit` allows, and the count
/// after them.
pub fn decide(
    limit: u32,
    period_ms: u64,
    elapsed_ms: u64,
    prev: u64,
    cur: u64,
    costs: &[u32],
) -> (u64, Vec<bool>) {
    let e = elapsed_ms.min(period_ms);
    let weighted = u128::from(prev) * u128::from(period_ms - e);
    let cap = u128::from(limit) * u128::from(period_ms);
    let mut added = 0u64;
    let flags = costs
        .iter()
        .map(|&c| {
            let k = u64::from(c.max(1));
            let ok = weighted + u128::from(cur + added + k - 1) * u128::from(period_ms) < cap;
            if ok {
                added += u64::from(c);
            }
            ok
        })
        .collect();
    (cur + added, flags)
}

#[cfg(test)]
#[path = "strict_tests.rs"]
mod tests;
