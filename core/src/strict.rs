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

use crate::key::write_key_for_tag;
use crate::resp;

/// The script: `KEYS[1]` the current window's counter, `KEYS[2]` the
/// previous one's; `ARGV` limit, period (ms), time into the window (ms),
/// TTL (s), then one cost per request. Answers `{cur, prev, a1, a2, ...}`
/// with `ai` 1 when request `i` is allowed (and counted). One `MGET` reads
/// both windows (the same slot). A counter that holds something else than
/// an integer is an error reply (the script's own; a key of another type
/// reads as nil for `MGET` and then fails `INCRBY` with `WRONGTYPE`), so the
/// item fails alone.
pub const SCRIPT: &str = r#"-- ngx_http_redis_ratelimit strict mode
local function count(v)
  if not v then return 0 end
  local n = tonumber(v)
  if not n or n < 0 or n ~= math.floor(n) then
    return nil
  end
  return n
end
local both = redis.call('MGET', KEYS[1], KEYS[2])
local cur = count(both[1])
local prev = count(both[2])
if not cur or not prev then
  return redis.error_reply('ERR redis_ratelimit: the counter is not an integer')
end
local limit = tonumber(ARGV[1])
local p = tonumber(ARGV[2])
local e = tonumber(ARGV[3])
local ttl = tonumber(ARGV[4])
if e > p then e = p end
local weighted = prev * (p - e)
local cap = limit * p
local out = {0, prev}
local added = 0
for i = 5, #ARGV do
  local c = tonumber(ARGV[i])
  local k = c
  if k < 1 then k = 1 end
  if weighted + (cur + added + k - 1) * p < cap then
    added = added + c
    out[#out + 1] = 1
  else
    out[#out + 1] = 0
  end
end
if added > 0 then
  local now = redis.call('INCRBY', KEYS[1], added)
  if now == added then
    redis.call('EXPIRE', KEYS[1], ttl)
  end
  cur = now
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
/// previous one during the next), one cost per request.
pub fn args(
    limit: u32,
    period: u32,
    elapsed_ms: u64,
    costs: &[u32],
) -> impl Iterator<Item = u64> + '_ {
    let p = u64::from(period) * 1000;
    [u64::from(limit), p, elapsed_ms.min(p), 2 * u64::from(period)]
        .into_iter()
        .chain(costs.iter().map(|&c| u64::from(c)))
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
}

impl Call<'_> {
    /// Its words, each built in `scratch` and handed to `f`.
    fn each(&self, scratch: &mut Vec<u8>, mut f: impl FnMut(&[u8])) {
        let p = u64::from(self.period);
        f(b"EVALSHA");
        f(sha1_hex().as_bytes());
        f(b"2");
        for w in [self.window, self.window.saturating_sub(1)] {
            scratch.clear();
            write_key_for_tag(scratch, self.prefix, self.tag, self.period, w * p);
            f(scratch);
        }
        let elapsed = self.now_ms.saturating_sub(self.window * p * 1000);
        for n in args(self.limit, self.period, elapsed, self.costs) {
            scratch.clear();
            resp::push_u64(scratch, n);
            f(scratch);
        }
    }

    /// The command's words (for a `redis::Cmd`).
    pub fn words(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::with_capacity(9 + self.costs.len());
        self.each(&mut Vec::new(), |w| out.push(w.to_vec()));
        out
    }

    /// The command written as RESP at the end of `out` (a strict link's
    /// request path: no allocation per word).
    pub fn write(&self, out: &mut Vec<u8>, scratch: &mut Vec<u8>) {
        resp::array(out, 9 + self.costs.len());
        self.each(scratch, |w| resp::bulk(out, w));
    }
}

/// What Redis answered for a group.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The current window's count after the call (ours included).
    pub cur: u64,
    /// The previous window's count.
    pub prev: u64,
    /// One flag per request of the group, in order.
    pub allowed: Vec<bool>,
}

/// Reads the script's reply (the integers of its array), checking that it
/// has one flag per request: anything else is `None` (the group fails, and
/// its requests are decided by `on_error`).
pub fn parse_answer(values: &[i64], requests: usize) -> Option<Answer> {
    let (&cur, rest) = values.split_first()?;
    let (&prev, flags) = rest.split_first()?;
    if flags.len() != requests || cur < 0 || prev < 0 || flags.iter().any(|&f| f != 0 && f != 1) {
        return None;
    }
    Some(Answer {
        cur: cur as u64,
        prev: prev as u64,
        allowed: flags.iter().map(|&f| f == 1).collect(),
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
mod tests {
    use super::*;

    #[test]
    fn sha1_known_digests() {
        let hex = |d: [u8; 20]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
        assert_eq!(hex(sha1(b"")), "da39a3ee5e6b4b0d3255bfef95601890afd80709");
        assert_eq!(hex(sha1(b"abc")), "a9993e364706816aba3e25717850c26c9cd0d89d");
        let long = b"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
        assert_eq!(hex(sha1(long)), "84983e441c3bd26ebaae4aa1f95129e5e54670f1");
        assert_eq!(sha1_hex().len(), 40);
    }

    #[test]
    fn a_fresh_key_gets_exactly_its_limit() {
        let (cur, flags) = decide(5, 60_000, 0, 0, 0, &[1; 8]);
        assert_eq!(cur, 5);
        assert_eq!(flags, [true, true, true, true, true, false, false, false]);
    }

    #[test]
    fn the_previous_window_weighs_by_time_left() {
        // prev 10 at a quarter into the window weighs 7.5 of 10
        let (cur, flags) = decide(10, 1000, 250, 10, 0, &[1; 4]);
        assert_eq!(flags, [true, true, true, false]);
        assert_eq!(cur, 3);
        // at the window's end the previous window weighs nothing
        let (cur, _) = decide(10, 1000, 5000, 10, 0, &[1; 12]);
        assert_eq!(cur, 10);
    }

    #[test]
    fn costs_and_rejected_requests_are_not_counted() {
        // 3 left: a cost of 4 is refused, the 2 and the 1 after it pass
        let (cur, flags) = decide(10, 1000, 0, 0, 7, &[4, 2, 1, 1]);
        assert_eq!(flags, [false, true, true, false]);
        assert_eq!(cur, 10);
        // cost 0 checks without counting
        let (cur, flags) = decide(10, 1000, 0, 0, 9, &[0, 0]);
        assert_eq!((cur, flags), (9, vec![true, true]));
        let (_, flags) = decide(10, 1000, 0, 0, 10, &[0]);
        assert_eq!(flags, [false]);
    }

    #[test]
    fn args_and_answers() {
        assert_eq!(
            args(100, 60, 1500, &[1, 3]).collect::<Vec<_>>(),
            [100, 60_000, 1500, 120, 1, 3]
        );
        assert_eq!(args(5, 1, 99_999, &[1]).collect::<Vec<_>>(), [5, 1000, 1000, 2, 1]);
        let a = parse_answer(&[7, 2, 1, 0], 2).unwrap();
        assert_eq!(a, Answer { cur: 7, prev: 2, allowed: vec![true, false] });
        assert_eq!(parse_answer(&[7, 2, 1], 2), None);
        assert_eq!(parse_answer(&[7, 2, 2], 1), None);
        assert_eq!(parse_answer(&[-1, 2, 1], 1), None);
        assert_eq!(parse_answer(&[], 0), None);
    }

    #[test]
    fn a_call_names_both_windows_and_the_time_into_the_current_one() {
        let costs = [1, 2];
        let c = Call {
            prefix: b"rl:",
            tag: b"z:k",
            period: 60,
            window: 100,
            limit: 5,
            now_ms: 6_000_250,
            costs: &costs,
        };
        let words = c.words();
        let text: Vec<String> =
            words.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect();
        assert_eq!(text[..3], ["EVALSHA", sha1_hex(), "2"]);
        assert_eq!(
            text[3..],
            ["rl:{z:k}:60:6000", "rl:{z:k}:60:5940", "5", "60000", "250", "120", "1", "2"]
        );
        let (mut out, mut scratch, mut want) = (Vec::new(), Vec::new(), Vec::new());
        c.write(&mut out, &mut scratch);
        resp::command(&mut want, &words);
        assert_eq!(out, want);
        let first = Call { window: 0, now_ms: 5, costs: &[], ..c };
        assert_eq!(first.words()[4], b"rl:{z:k}:60:0");
    }
}
