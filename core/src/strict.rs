//! Strict mode: the decision made in Redis, atomically, by one script per
//! key. What the script is, what it is given, and how its answer is read;
//! `decide` is the same decision in Rust (the script's reference, and what
//! the unit tests check the arithmetic of).
//!
//! The script reads both windows of the key (they share a hash tag, so one
//! cluster slot), checks each request of the group in order against the
//! sliding estimate (`estimate + cost − 1 < L`), adds only the allowed ones
//! to the current window (rejected requests are not counted), sets the
//! counter's TTL when it created it, and answers the counts and one flag per
//! request. Requests of one key that wait together share one call.
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

use crate::key::write_key_for_tag;
use crate::rate::Rate;
use crate::resp;

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

/// The deadline of a request that happened already: the script counts it
/// whatever the estimate and whenever it runs (written `-1`).
pub const COUNTED: u64 = u64::MAX;

/// The script: `KEYS[1]` the current window's counter, `KEYS[2]` the
/// previous one's; `ARGV` limit, period (ms), time into the window (ms),
/// TTL (s), then per request its cost and its deadline (ms in Redis's
/// clock, 0: none, -1: counted whatever the estimate, `COUNTED`). Answers
/// `{cur, prev, a1, a2, ...}` with `ai` 1 when request `i` is allowed (and
/// counted), 0 when it is not, 2 when the script ran after its deadline
/// (neither). One `MGET` reads both windows
/// (the same slot). A counter that holds something else than an integer
/// is an error reply (the script's own; a key of another type reads as nil
/// for `MGET` and then fails `INCRBY` with `WRONGTYPE`), so the item fails
/// alone. `TIME` is read only when a request has a deadline (before any
/// write: Redis before 5 needs its effects replicated to allow that).
pub const SCRIPT: &str = r#"-- ngx_http_redis_ratelimit strict mode
local both = redis.call('MGET', KEYS[1], KEYS[2])
local cur = tonumber(both[1] or 0)
local prev = tonumber(both[2] or 0)
if not cur or not prev or cur < 0 or prev < 0 or cur % 1 ~= 0 or prev % 1 ~= 0 then
  return redis.error_reply('ERR redis_ratelimit: the counter is not an integer')
end
local limit = tonumber(ARGV[1])
local p = tonumber(ARGV[2])
local e = tonumber(ARGV[3])
if e > p then e = p end
local weighted = prev * (p - e)
local cap = limit * p
local out = {0, prev}
local j = 2
local added = 0
local now
for i = 5, #ARGV - 1, 2 do
  local c = tonumber(ARGV[i])
  local dl = tonumber(ARGV[i + 1])
  if dl > 0 and not now then
    if redis.replicate_commands then redis.replicate_commands() end
    local t = redis.call('TIME')
    now = t[1] * 1000 + math.floor(t[2] / 1000)
  end
  local k = c
  if k < 1 then k = 1 end
  j = j + 1
  if dl < 0 then
    added = added + c
    out[j] = 1
  elseif dl > 0 and now > dl then
    out[j] = 2
  elseif weighted + (cur + added + k - 1) * p < cap then
    added = added + c
    out[j] = 1
  else
    out[j] = 0
  end
end
if added > 0 then
  local now_count = redis.call('INCRBY', KEYS[1], added)
  if now_count == added then
    redis.call('EXPIRE', KEYS[1], tonumber(ARGV[4]))
  end
  cur = now_count
end
out[1] = cur
return out
"#;

/// The script's SHA1 (what `EVALSHA` names it by), as Redis computes it;
/// worked out once.
pub fn sha1_hex() -> &'static str {
    static SHA: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    SHA.get_or_init(|| sha1(SCRIPT.as_bytes()).iter().map(|b| format!("{b:02x}")).collect())
}

/// The arguments after the two keys: limit, period in ms, time into the
/// window in ms, TTL in seconds (two periods: the window is read as the
/// previous one during the next), then per request its cost and deadline
/// (ms in Redis's clock, 0: none).
pub fn args(
    limit: u32,
    period: u32,
    elapsed_ms: u64,
    costs: &[u32],
    deadlines: &[u64],
    mut f: impl FnMut(u64),
) {
    let p = u64::from(period) * 1000;
    for n in [u64::from(limit), p, elapsed_ms.min(p), 2 * u64::from(period)] {
        f(n);
    }
    for (i, &c) in costs.iter().enumerate() {
        f(u64::from(c));
        f(deadlines.get(i).copied().unwrap_or(0));
    }
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

/// One call of the script for a group of requests of one key: `EVALSHA
/// <sha> 2`, its two keys (the current window `window` and the one
/// before, under `prefix` and the key's hash `tag`) and its arguments.
/// `now_ms` is when it is sent: the time into the window is worked out
/// then.
#[derive(Clone, Copy, Debug)]
pub struct Call<'a> {
    pub prefix: &'a [u8],
    pub tag: &'a [u8],
    pub period: u32,
    pub window: u64,
    pub limit: u32,
    pub now_ms: u64,
    pub costs: &'a [u32],
    /// Per request, its deadline in Redis's clock (0: none).
    pub deadlines: &'a [u64],
}

/// One word of a call: bytes, a number, or the key of the window that
/// starts at this second (each written without a scratch copy).
enum Word<'a> {
    Bytes(&'a [u8]),
    Number(u64),
    Key(u64),
}

impl Call<'_> {
    /// Its words after `EVALSHA <sha> 2` (the same in every call), each
    /// handed to `f`.
    fn each(&self, mut f: impl FnMut(Word<'_>)) {
        let p = u64::from(self.period);
        f(Word::Key(self.window * p));
        f(Word::Key(self.window.saturating_sub(1) * p));
        let elapsed = self.now_ms.saturating_sub(self.window * p * 1000);
        args(self.limit, self.period, elapsed, self.costs, self.deadlines, |n| {
            f(if n == COUNTED { Word::Bytes(b"-1") } else { Word::Number(n) })
        });
    }

    /// The command's words (for a `redis::Cmd`).
    pub fn words(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(9 + 2 * self.costs.len());
        out.extend([&b"EVALSHA"[..], sha1_hex().as_bytes(), b"2"].map(<[u8]>::to_vec));
        self.each(|w| {
            out.push(match w {
                Word::Bytes(b) => b.to_vec(),
                Word::Number(n) => n.to_string().into_bytes(),
                Word::Key(start) => {
                    let mut key = Vec::new();
                    write_key_for_tag(&mut key, self.prefix, self.tag, self.period, start);
                    key
                }
            })
        });
        out
    }

    /// The command written as RESP at the end of `out` (a strict link's
    /// request path: written in place, no allocation per word).
    pub fn write(&self, out: &mut Vec<u8>) {
        static HEAD: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
        let head = HEAD.get_or_init(|| {
            let mut head = Vec::new();
            for w in [&b"EVALSHA"[..], sha1_hex().as_bytes(), b"2"] {
                resp::bulk(&mut head, w);
            }
            head
        });
        let p = u64::from(self.period);
        // `<prefix>{<tag>}:<period>:` and then the window's start
        let key = self.prefix.len() + self.tag.len() + 4 + resp::digits(p);
        let words = 9 + 2 * self.costs.len();
        // the words after the keys: numbers of at most 20 digits
        let room = 8 + head.len() + 2 * (key + 28) + (words - 5) * 27;
        let mut w = resp::Writer::new(out, room);
        w.array(words);
        w.put(head);
        let (cur, prev) = (self.window * p, self.window.saturating_sub(1) * p);
        let head_at = w.mark();
        w.bulk_head(key + resp::digits(cur));
        w.put(self.prefix);
        w.put(b"{");
        w.put(self.tag);
        w.put(b"}:");
        w.decimal(p);
        w.put(b":");
        let start_at = w.mark();
        w.decimal(cur);
        w.put(b"\r\n");
        if resp::digits(prev) == resp::digits(cur) {
            // the same name up to the window's start (as a rule)
            w.again(head_at, start_at);
        } else {
            w.bulk_head(key + resp::digits(prev));
            w.again(start_at - key, start_at);
        }
        w.decimal(prev);
        w.put(b"\r\n");
        let elapsed = self.now_ms.saturating_sub(cur * 1000);
        args(self.limit, self.period, elapsed, self.costs, self.deadlines, |n| {
            if n == COUNTED {
                w.put(b"$2\r\n-1\r\n");
            } else {
                w.bulk_u64(n);
            }
        });
    }
}

/// What Redis answered for a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The current window's count after the call (ours included).
    pub cur: u64,
    /// The previous window's count.
    pub prev: u64,
    /// One per request of the group, in order: allowed (and counted) or
    /// not; `None` when the script ran after the request's deadline (not
    /// checked, not counted: `on_error` decided it).
    pub allowed: smallvec::SmallVec<[Option<bool>; 4]>,
}

/// Reads the script's reply (the integers of its array), checking that it
/// has one flag per request: anything else is `None` (the group fails, and
/// its requests are decided by `on_error`).
pub fn parse_answer(values: &[i64], requests: usize) -> Option<Answer> {
    let (&cur, rest) = values.split_first()?;
    let (&prev, flags) = rest.split_first()?;
    if flags.len() != requests
        || cur < 0
        || prev < 0
        || flags.iter().any(|&f| !(0..=2).contains(&f))
    {
        return None;
    }
    Some(Answer {
        cur: cur as u64,
        prev: prev as u64,
        allowed: flags.iter().map(|&f| (f != 2).then_some(f == 1)).collect(),
    })
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

/// SHA-1 (FIPS 180-4), for the script's name only: the one digest Redis
/// uses for `EVALSHA`.
fn sha1(data: &[u8]) -> [u8; 20] {
    let mut h: [u32; 5] = [0x6745_2301, 0xEFCD_AB89, 0x98BA_DCFE, 0x1032_5476, 0xC3D2_E1F0];
    let mut msg = data.to_vec();
    let bits = (data.len() as u64).wrapping_mul(8);
    msg.push(0x80);
    while msg.len() % 64 != 56 {
        msg.push(0);
    }
    msg.extend_from_slice(&bits.to_be_bytes());
    for block in msg.chunks_exact(64) {
        let mut w = [0u32; 80];
        for (i, word) in block.chunks_exact(4).enumerate() {
            w[i] = u32::from_be_bytes([word[0], word[1], word[2], word[3]]);
        }
        for i in 16..80 {
            w[i] = (w[i - 3] ^ w[i - 8] ^ w[i - 14] ^ w[i - 16]).rotate_left(1);
        }
        let [mut a, mut b, mut c, mut d, mut e] = h;
        for (i, &wi) in w.iter().enumerate() {
            let (f, k) = match i {
                0..=19 => ((b & c) | (!b & d), 0x5A82_7999),
                20..=39 => (b ^ c ^ d, 0x6ED9_EBA1),
                40..=59 => ((b & c) | (b & d) | (c & d), 0x8F1B_BCDC),
                _ => (b ^ c ^ d, 0xCA62_C1D6),
            };
            let t =
                a.rotate_left(5).wrapping_add(f).wrapping_add(e).wrapping_add(k).wrapping_add(wi);
            e = d;
            d = c;
            c = b.rotate_left(30);
            b = a;
            a = t;
        }
        for (x, y) in h.iter_mut().zip([a, b, c, d, e]) {
            *x = x.wrapping_add(y);
        }
    }
    let mut out = [0u8; 20];
    for (i, x) in h.iter().enumerate() {
        out[i * 4..i * 4 + 4].copy_from_slice(&x.to_be_bytes());
    }
    out
}

#[cfg(test)]
#[path = "strict_tests.rs"]
mod tests;
