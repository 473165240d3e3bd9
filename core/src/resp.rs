//! RESP2, the Redis protocol, as much of it as a strict link needs: a
//! command written as an array of bulk strings, and replies read one at a
//! time from a buffer that may hold part of one. Bounded: a reply deeper,
//! longer or larger than any the module asks for is a protocol error (the
//! link is then dropped), never a large allocation.

/// Most elements of an array reply (the strict script answers 2 + one per
/// waiting request of a key; a worker has at most a few thousand).
pub const MAX_ARRAY: usize = 1 << 16;
/// Largest bulk string (`SCRIPT LOAD` answers 40 bytes).
pub const MAX_BULK: usize = 1 << 20;
/// Largest status or error line.
pub const MAX_LINE: usize = 64 << 10;
/// Deepest nesting of arrays.
pub const MAX_DEPTH: usize = 4;

/// One reply.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Value {
    /// `+OK`
    Status(String),
    /// `-ERR ...`: the whole text, code first.
    Error(String),
    Int(i64),
    /// `$-1` is `None`.
    Bulk(Option<Vec<u8>>),
    /// `*-1` is `None`.
    Array(Option<Vec<Value>>),
}

impl Value {
    /// An error reply's code: its first word (`NOSCRIPT`, `READONLY` ...).
    pub fn error_code(&self) -> Option<&str> {
        match self {
            Value::Error(t) => Some(t.split(' ').next().unwrap_or("")),
            _ => None,
        }
    }
}

/// The stream is not RESP2 within the bounds above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProtocolError;

/// Appends a command: an array of bulk strings.
pub fn command<A: AsRef<[u8]>>(out: &mut Vec<u8>, args: &[A]) {
    array(out, args.len());
    for a in args {
        bulk(out, a.as_ref());
    }
}

/// Appends an array's header (`*n`).
pub fn array(out: &mut Vec<u8>, n: usize) {
    out.push(b'*');
    push_u64(out, n as u64);
    out.extend_from_slice(b"\r\n");
}

/// Appends a bulk string.
pub fn bulk(out: &mut Vec<u8>, b: &[u8]) {
    bulk_head(out, b.len());
    out.extend_from_slice(b);
    out.extend_from_slice(b"\r\n");
}

/// Appends a bulk string's head, for `len` bytes the caller writes next
/// (then CRLF).
pub fn bulk_head(out: &mut Vec<u8>, len: usize) {
    out.push(b'$');
    push_u64(out, len as u64);
    out.extend_from_slice(b"\r\n");
}

/// "00", "01", ... "99": two digits a step.
const PAIRS: &[u8; 200] = b"\
0001020304050607080910111213141516171819\
2021222324252627282930313233343536373839\
4041424344454647484950515253545556575859\
6061626364656667686970717273747576777879\
8081828384858687888990919293949596979899";

/// Writes `n` in decimal into `buf`, ending just before `end`, four
/// digits a division (a strict call writes a dozen numbers of up to 13
/// digits); returns where it starts.
#[inline(always)]
fn decimal(buf: &mut [u8], end: usize, n: u64) -> usize {
    let mut i = end;
    let mut n = n;
    while n >= 10_000 {
        let r = (n % 10_000) as usize;
        n /= 10_000;
        let (hi, lo) = (r / 100 * 2, r % 100 * 2);
        i -= 4;
        buf[i..i + 2].copy_from_slice(&PAIRS[hi..hi + 2]);
        buf[i + 2..i + 4].copy_from_slice(&PAIRS[lo..lo + 2]);
    }
    // below 10 000
    let mut n = n as usize;
    if n >= 100 {
        let d = n % 100 * 2;
        n /= 100;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&PAIRS[d..d + 2]);
    }
    if n >= 10 {
        let d = n * 2;
        i -= 2;
        buf[i..i + 2].copy_from_slice(&PAIRS[d..d + 2]);
    } else {
        i -= 1;
        buf[i] = b'0' + n as u8;
    }
    i
}

/// A number's decimal digits, written once: their count is known before
/// they are copied (a key name's length goes before the name).
pub struct Digits {
    buf: [u8; 20],
    at: usize,
}

impl Digits {
    #[inline(always)]
    pub fn of(n: u64) -> Digits {
        let mut buf = [0u8; 20];
        let at = decimal(&mut buf, 20, n);
        Digits { buf, at }
    }

    /// How many digits (1 to 20).
    #[inline(always)]
    pub fn count(&self) -> usize {
        20 - self.at
    }

    #[inline(always)]
    pub fn as_bytes(&self) -> &[u8] {
        &self.buf[self.at..]
    }
}

/// Appends `n` in decimal.
pub fn push_u64(out: &mut Vec<u8>, n: u64) {
    let mut digits = [0u8; 20];
    let at = decimal(&mut digits, 20, n);
    out.extend_from_slice(&digits[at..]);
}

/// `n` as a bulk string (`$<len>\r\n<digits>\r\n`) at the end of `buf`,
/// written back to front (the digits first, then their count): returns
/// where it starts.
#[inline]
fn bulk_digits(buf: &mut [u8; 27], n: u64) -> usize {
    buf[25..].copy_from_slice(b"\r\n");
    let at = decimal(buf, 25, n);
    let len = 25 - at;
    // at least 5 bytes before the digits (20 at most): `$`, two, CRLF
    buf[at - 2..at].copy_from_slice(b"\r\n");
    // the length: 1 to 20
    if len >= 10 {
        buf[at - 4..at - 2].copy_from_slice(&PAIRS[len * 2..len * 2 + 2]);
        buf[at - 5] = b'$';
        at - 5
    } else {
        buf[at - 3] = b'0' + len as u8;
        buf[at - 4] = b'$';
        at - 4
    }
}

/// `<mark><n>\r\n` (an array's or a bulk string's head) at the end of
/// `buf`, written back to front: returns where it starts.
#[inline(always)]
fn head_digits(buf: &mut [u8; 24], mark: u8, n: u64) -> usize {
    buf[22..].copy_from_slice(b"\r\n");
    let at = decimal(buf, 22, n);
    buf[at - 1] = mark;
    at - 1
}

/// A command appended to a buffer: room reserved once for what the caller
/// expects to write (a hint: a word past it makes more), each word copied
/// in. Nothing is written twice: no zeroed room to write over.
pub struct Writer<'a> {
    out: &'a mut Vec<u8>,
}

impl<'a> Writer<'a> {
    /// Room for about `room` bytes at the end of `out`.
    pub fn new(out: &'a mut Vec<u8>, room: usize) -> Writer<'a> {
        out.reserve(room);
        Writer { out }
    }

    #[inline(always)]
    pub fn put(&mut self, b: &[u8]) {
        self.out.extend_from_slice(b);
    }

    /// One byte.
    #[inline(always)]
    pub fn byte(&mut self, b: u8) {
        self.out.push(b);
    }

    /// Where the next byte goes (for `again`).
    #[inline(always)]
    pub fn mark(&self) -> usize {
        self.out.len()
    }

    /// What was written since `from` (a mark).
    #[inline(always)]
    pub fn since(&self, from: usize) -> &[u8] {
        &self.out[from..]
    }

    /// Writes again what was written from `from` to `to` (marks).
    #[inline(always)]
    pub fn again(&mut self, from: usize, to: usize) {
        self.out.extend_from_within(from..to);
    }

    /// An array's header (`*n`), in one copy.
    #[inline(always)]
    pub fn array(&mut self, n: usize) {
        let mut buf = [0u8; 24];
        let at = head_digits(&mut buf, b'*', n as u64);
        self.put(&buf[at..]);
    }

    /// A bulk string's head, for `len` bytes written next (then CRLF), in
    /// one copy.
    #[inline(always)]
    pub fn bulk_head(&mut self, len: usize) {
        let mut buf = [0u8; 24];
        let at = head_digits(&mut buf, b'$', len as u64);
        self.put(&buf[at..]);
    }

    /// `n` in decimal as a bulk string (what `bulk` makes of its digits),
    /// in one copy.
    #[inline(always)]
    pub fn bulk_u64(&mut self, n: u64) {
        if n < 10 {
            // a count, a flag, a cost: as a rule one digit
            self.put(&[b'$', b'1', b'\r', b'\n', b'0' + n as u8, b'\r', b'\n']);
            return;
        }
        let mut buf = [0u8; 27];
        let at = bulk_digits(&mut buf, n);
        self.put(&buf[at..]);
    }
}

/// A number's bulk-string text but its last four digits and CRLF
/// (`$<len>\r\n<digits>`), for numbers that share it (`bulk_u64_near`):
/// the deadlines of calls written in a row differ in their last digits.
#[derive(Debug, Default)]
pub struct Near {
    /// The number's digits but the last four (`n / 10_000`).
    high: u64,
    /// Empty: none yet.
    text: smallvec::SmallVec<[u8; 24]>,
}

impl Writer<'_> {
    /// `bulk_u64(n)`, with the text `near` kept of a number with the same
    /// digits but the last four (kept of this one if not).
    #[inline(always)]
    pub fn bulk_u64_near(&mut self, n: u64, near: &mut Near) {
        if n < 10_000 {
            self.bulk_u64(n);
            return;
        }
        let high = n / 10_000;
        if near.high != high || near.text.is_empty() {
            let mut buf = [0u8; 27];
            let at = bulk_digits(&mut buf, n);
            self.put(&buf[at..]);
            near.high = high;
            near.text.clear();
            near.text.extend_from_slice(&buf[at..27 - 6]);
            return;
        }
        let low = (n % 10_000) as usize;
        let (a, b) = (low / 100 * 2, low % 100 * 2);
        self.put(&near.text);
        self.put(&[PAIRS[a], PAIRS[a + 1], PAIRS[b], PAIRS[b + 1], b'\r', b'\n']);
    }
}

/// Reads one reply from the start of `buf`: `Ok(None)` when `buf` holds
/// only part of it, else the reply and the bytes it took.
pub fn parse(buf: &[u8]) -> Result<Option<(Value, usize)>, ProtocolError> {
    let mut at = 0;
    match value(buf, &mut at, 0)? {
        Some(v) => Ok(Some((v, at))),
        None => Ok(None),
    }
}

/// What `read_ints` found at the start of a buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ints {
    /// A whole array of integers (what the script answers), its elements
    /// in the caller's vector: the bytes it took.
    Read(usize),
    /// Only part of a reply so far.
    Partial,
    /// A reply of another kind, for `parse` to read.
    Other,
}

/// Reads an array of integers from the start of `buf` straight into
/// `ints` (cleared first; no `Value` per element, the caller's room used
/// again), as `parse` would read it.
pub fn read_ints(buf: &[u8], ints: &mut Vec<i64>) -> Result<Ints, ProtocolError> {
    ints.clear();
    // an array's head read as an integer line is (`*` for `:`); a head
    // that is not one (a nil array, a partial line) goes to `parse`
    let (Some(b'*'), Some((n, mut at))) = (buf.first(), short_int(buf, 1)) else {
        return Ok(Ints::Other);
    };
    let Ok(n @ 0..=MAX_ARRAY) = usize::try_from(n) else {
        return Ok(Ints::Other);
    };
    // room for the whole array at once (a call of several keys answers
    // three or more integers a key), never more than the bytes at hand
    // can hold (`:0\r\n` is the shortest element)
    ints.reserve(n.min(4096).min(buf.len().saturating_sub(at) / 4));
    while ints.len() < n {
        match buf.get(at) {
            Some(b':') => {}
            // an element of another kind: the general reader
            Some(_) => return Ok(Ints::Other),
            None => return Ok(Ints::Partial),
        }
        match short_int(buf, at + 1) {
            Some((n, end)) => {
                ints.push(n);
                at = end;
            }
            None => {
                let Some(text) = line(buf, &mut at)? else {
                    return Ok(Ints::Partial);
                };
                ints.push(number(&text[1..])?);
            }
        }
    }
    Ok(Ints::Read(at))
}

/// An integer line's digits from `at`: 1 to 18 of them (no sign) and
/// CRLF, all here, read in one pass; `None` for anything else (a sign, a
/// longer number, a partial line, an error), which `line` and `number`
/// then read as they read any line. The script's answers are such lines.
#[inline(always)]
fn short_int(buf: &[u8], at: usize) -> Option<(i64, usize)> {
    let rest = buf.get(at..)?;
    let mut n: i64 = 0;
    let mut i = 0;
    while let Some(d) = rest.get(i).map(|b| b.wrapping_sub(b'0')).filter(|&d| d <= 9) {
        if i == 18 {
            return None;
        }
        n = n * 10 + i64::from(d);
        i += 1;
    }
    match rest.get(i..i + 2) {
        Some(b"\r\n") if i > 0 => Some((n, at + i + 2)),
        _ => None,
    }
}

/// A line without its CRLF, from `*at` (moved past it); `None`: not all
/// of it is here yet.
fn line<'a>(buf: &'a [u8], at: &mut usize) -> Result<Option<&'a [u8]>, ProtocolError> {
    let rest = buf.get(*at..).unwrap_or_default();
    let Some(end) = rest.iter().position(|&b| b == b'\n') else {
        return if rest.len() > MAX_LINE { Err(ProtocolError) } else { Ok(None) };
    };
    if end == 0 || rest[end - 1] != b'\r' || end > MAX_LINE {
        return Err(ProtocolError);
    }
    *at += end + 1;
    Ok(Some(&rest[..end - 1]))
}

/// An integer line's text: an optional `-` and 1 to 19 digits (what
/// `i64::from_str` takes of Redis's integers, without its `+` or an
/// overflow), read in place.
fn number(text: &[u8]) -> Result<i64, ProtocolError> {
    let (negative, digits) = match text.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, text),
    };
    if digits.is_empty() || digits.len() > 19 {
        return Err(ProtocolError);
    }
    let mut n: u64 = 0;
    for &b in digits {
        if !b.is_ascii_digit() {
            return Err(ProtocolError);
        }
        n = n * 10 + u64::from(b - b'0');
    }
    if negative {
        // down to i64::MIN
        0i64.checked_sub_unsigned(n).ok_or(ProtocolError)
    } else {
        i64::try_from(n).map_err(|_| ProtocolError)
    }
}

/// A length: -1 (nil) or 0..=max.
fn length(text: &[u8], max: usize) -> Result<Option<usize>, ProtocolError> {
    match number(text)? {
        -1 => Ok(None),
        n if n >= 0 && (n as u64) <= max as u64 => Ok(Some(n as usize)),
        _ => Err(ProtocolError),
    }
}

fn value(buf: &[u8], at: &mut usize, depth: usize) -> Result<Option<Value>, ProtocolError> {
    let start = *at;
    let Some(head) = line(buf, at)? else {
        return Ok(None);
    };
    let (&kind, text) = head.split_first().ok_or(ProtocolError)?;
    let text_of = |t: &[u8]| String::from_utf8_lossy(t).into_owned();
    let v = match kind {
        b'+' => Value::Status(text_of(text)),
        b'-' => Value::Error(text_of(text)),
        b':' => Value::Int(number(text)?),
        b'$' => match length(text, MAX_BULK)? {
            None => Value::Bulk(None),
            Some(n) => {
                let end = *at + n;
                if buf.len() < end + 2 {
                    *at = start;
                    return Ok(None);
                }
                if &buf[end..end + 2] != b"\r\n" {
                    return Err(ProtocolError);
                }
                let b = buf[*at..end].to_vec();
                *at = end + 2;
                Value::Bulk(Some(b))
            }
        },
        b'*' => match length(text, MAX_ARRAY)? {
            None => Value::Array(None),
            Some(n) => {
                if depth >= MAX_DEPTH {
                    return Err(ProtocolError);
                }
                // not more room than the bytes at hand can fill (3 each)
                let mut items = Vec::with_capacity(n.min(buf.len().saturating_sub(*at) / 3));
                for _ in 0..n {
                    match value(buf, at, depth + 1)? {
                        Some(v) => items.push(v),
                        None => {
                            *at = start;
                            return Ok(None);
                        }
                    }
                }
                Value::Array(Some(items))
            }
        },
        _ => return Err(ProtocolError),
    };
    Ok(Some(v))
}

#[cfg(test)]
#[path = "resp_tests.rs"]
mod tests;
