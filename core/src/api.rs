//! The JSON API's pure parts (`redis_ratelimit_api`): which resource a path
//! names, keys percent-decoded (and an address key's textual form), the
//! small JSON bodies of its writes, their times, and its problem details.

use std::fmt::Write;
use std::net::IpAddr;

use crate::control::MAX_TTL_MS;
use crate::rate::Rate;
use crate::text::json_string;

/// Most bytes of a write's body.
pub const MAX_BODY: usize = 4096;
/// Most keys `top` lists (a zone's sketch holds at most 64).
pub const MAX_TOP: usize = 64;

/// What a path under the API's location names.
#[derive(Debug, PartialEq, Eq)]
pub enum Route {
    /// `/`: the API's resources.
    Root,
    /// `zones`.
    Zones,
    /// `zones/{zone}`.
    Zone(String),
    /// `zones/{zone}/top`.
    Top(String),
    /// `zones/{zone}/keys/{key}`, its `block` or its `override`.
    Key(String, Vec<u8>, Part),
}

/// What of a key a path names.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Part {
    Key,
    Block,
    Override,
}

/// A request the API cannot answer as asked: its status, and what to say.
#[derive(Debug, PartialEq, Eq)]
pub struct Problem {
    pub status: u16,
    pub detail: String,
    /// The field (of the body, the path or the query) at fault.
    pub field: Option<&'static str>,
}

impl Problem {
    pub fn new(status: u16, field: Option<&'static str>, detail: impl Into<String>) -> Problem {
        Problem { status, detail: detail.into(), field }
    }

    fn bad(field: &'static str, detail: impl Into<String>) -> Problem {
        Problem::new(400, Some(field), detail)
    }

    /// RFC 9457's body: `title` from the status, the detail, and the
    /// field in `invalid-params`.
    pub fn body(&self) -> String {
        let title = match self.status {
            400 => "Bad Request",
            403 => "Forbidden",
            404 => "Not Found",
            405 => "Method Not Allowed",
            413 => "Content Too Large",
            415 => "Unsupported Media Type",
            503 => "Service Unavailable",
            507 => "Insufficient Storage",
            _ => "Error",
        };
        let mut out = String::with_capacity(160 + self.detail.len());
        let _ = write!(
            out,
            "{{\"type\":\"about:blank\",\"title\":\"{title}\",\"status\":{},\"detail\":{}",
            self.status,
            json_string(&self.detail)
        );
        if let Some(f) = self.field {
            let _ = write!(
                out,
                ",\"invalid-params\":[{{\"name\":\"{f}\",\"reason\":{}}}]",
                json_string(&self.detail)
            );
        }
        out.push_str("}\n");
        out
    }
}

/// The route of `path`, the request's path below the API's location as the
/// client wrote it (percent-encoded: a key may hold `/`).
pub fn route(path: &[u8]) -> Result<Route, Problem> {
    let path = path.strip_prefix(b"/").unwrap_or(path);
    let path = path.strip_suffix(b"/").unwrap_or(path);
    if path.is_empty() {
        return Ok(Route::Root);
    }
    let parts: Vec<&[u8]> = path.split(|&b| b == b'/').collect();
    let not_found = || Problem::new(404, None, "no such resource");
    let zone = |seg: &[u8]| -> Result<String, Problem> {
        let name = decode(seg).map_err(|_| Problem::bad("zone", "is not percent-encoded text"))?;
        String::from_utf8(name).map_err(|_| Problem::new(404, Some("zone"), "no such zone"))
    };
    match parts.as_slice() {
        [b"zones"] => Ok(Route::Zones),
        [b"zones", z] => Ok(Route::Zone(zone(z)?)),
        [b"zones", z, b"top"] => Ok(Route::Top(zone(z)?)),
        [b"zones", z, b"keys", k, rest @ ..] => {
            let part = match rest {
                [] => Part::Key,
                [b"block"] => Part::Block,
                [b"override"] => Part::Override,
                _ => return Err(not_found()),
            };
            let key = decode(k).map_err(|why| Problem::bad("key", why))?;
            if key.is_empty() {
                return Err(Problem::bad("key", "is empty"));
            }
            Ok(Route::Key(zone(z)?, key, part))
        }
        _ => Err(not_found()),
    }
}

/// Percent-decoding (RFC 3986): `%XX` is the byte XX, every other byte is
/// itself.
pub fn decode(s: &[u8]) -> Result<Vec<u8>, &'static str> {
    let mut out = Vec::with_capacity(s.len());
    let mut i = 0;
    while i < s.len() {
        if s[i] == b'%' {
            let hex = |b: u8| (b as char).to_digit(16);
            match (s.get(i + 1).and_then(|&b| hex(b)), s.get(i + 2).and_then(|&b| hex(b))) {
                (Some(h), Some(l)) => out.push((h * 16 + l) as u8),
                _ => return Err("holds a % not followed by two hex digits"),
            }
            i += 3;
        } else {
            out.push(s[i]);
            i += 1;
        }
    }
    Ok(out)
}

/// A key of a zone keyed by an address in binary (`$binary_remote_addr`)
/// as the API writes it: the address as text; other keys as given.
pub fn key_text(key: &[u8], binary_addr: bool) -> String {
    if binary_addr {
        if let Ok(b) = <[u8; 4]>::try_from(key) {
            return IpAddr::from(b).to_string();
        }
        if let Ok(b) = <[u8; 16]>::try_from(key) {
            return IpAddr::from(b).to_string();
        }
    }
    String::from_utf8_lossy(key).into_owned()
}

/// The key bytes for a key given in the API's path: an address as text
/// for a binary-address zone (its 4 or 16 bytes), any other key as is.
pub fn key_bytes(given: Vec<u8>, binary_addr: bool) -> Result<Vec<u8>, Problem> {
    if !binary_addr {
        return Ok(given);
    }
    let ip: Option<IpAddr> = std::str::from_utf8(&given).ok().and_then(|t| t.parse().ok());
    match ip {
        Some(IpAddr::V4(a)) => Ok(a.octets().to_vec()),
        Some(IpAddr::V6(a)) => Ok(a.octets().to_vec()),
        None => Err(Problem::bad("key", "is not an IP address (the zone's key is an address)")),
    }
}

/// `n=` of `top`'s query: 20 by default, 1 to `MAX_TOP`.
pub fn top_n(query: &[u8]) -> Result<usize, Problem> {
    let mut n = 20;
    for pair in query.split(|&b| b == b'&').filter(|p| !p.is_empty()) {
        if let Some(v) = pair.strip_prefix(b"n=") {
            n = std::str::from_utf8(v)
                .ok()
                .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) && t.len() < 6)
                .and_then(|t| t.parse::<usize>().ok())
                .filter(|n| (1..=MAX_TOP).contains(n))
                .ok_or_else(|| Problem::bad("n", format!("is a number from 1 to {MAX_TOP}")))?;
        }
    }
    Ok(n)
}

/// A write's body: what it sets.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Body {
    pub rate: Option<Rate>,
    pub ttl_ms: Option<u64>,
}

/// Reads a write's body: a JSON object with `ttl` (a time, `"15m"`, or
/// seconds) and, when `rate_too`, `rate` (`"1000r/m"`); both required
/// but for a block's `ttl`, which defaults to `default_ttl_ms`.
pub fn body(bytes: &[u8], rate_too: bool, default_ttl_ms: Option<u64>) -> Result<Body, Problem> {
    if bytes.len() > MAX_BODY {
        return Err(Problem::new(413, None, format!("a body is at most {MAX_BODY} bytes")));
    }
    let members = Json::new(bytes).object().map_err(|at| {
        Problem::new(400, Some("body"), format!("is not a JSON object (at byte {at})"))
    })?;
    let mut out = Body::default();
    for (name, value) in members {
        match name.as_str() {
            "ttl" => out.ttl_ms = Some(ttl(&value)?),
            "rate" if rate_too => {
                let Value::Text(t) = &value else {
                    return Err(Problem::bad("rate", "is a string such as \"1000r/m\""));
                };
                let rate =
                    Rate::parse(t.as_bytes()).map_err(|e| Problem::bad("rate", e.to_string()))?;
                out.rate = Some(rate);
            }
            _ => {
                return Err(Problem::new(
                    400,
                    Some("body"),
                    format!("has a member this resource does not take: {}", json_string(&name)),
                ))
            }
        }
    }
    if rate_too && out.rate.is_none() {
        return Err(Problem::bad("rate", "is required"));
    }
    if out.ttl_ms.is_none() {
        out.ttl_ms = Some(default_ttl_ms.ok_or_else(|| Problem::bad("ttl", "is required"))?);
    }
    Ok(out)
}

/// A control's time: a string in nginx's form (`90s`, `15m`, `1h30m`,
/// `1d`; no unit: seconds) or a number of seconds; 1 s to 30 days.
fn ttl(v: &Value) -> Result<u64, Problem> {
    let ms = match v {
        Value::Number(n) => n.checked_mul(1000),
        Value::Text(t) => time_ms(t.as_bytes()),
    };
    let max_days = MAX_TTL_MS / 86_400_000;
    match ms {
        Some(ms) if (1000..=MAX_TTL_MS).contains(&ms) => Ok(ms),
        _ => Err(Problem::bad(
            "ttl",
            format!("is a time from 1s to {max_days}d (\"15m\", \"1h\", or seconds)"),
        )),
    }
}

/// `1h30m`, `500ms`, `90` (seconds): nginx's time syntax, in ms.
pub fn time_ms(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    let mut total: u64 = 0;
    let mut i = 0;
    while i < s.len() {
        let start = i;
        while i < s.len() && s[i].is_ascii_digit() {
            i += 1;
        }
        if i == start || i - start > 12 {
            return None;
        }
        let n: u64 = std::str::from_utf8(&s[start..i]).ok()?.parse().ok()?;
        let unit: u64 = match &s[i..] {
            [b'm', b's', ..] => {
                i += 2;
                1
            }
            [b's', ..] => {
                i += 1;
                1000
            }
            [b'm', ..] => {
                i += 1;
                60_000
            }
            [b'h', ..] => {
                i += 1;
                3_600_000
            }
            [b'd', ..] => {
                i += 1;
                86_400_000
            }
            [b'w', ..] => {
                i += 1;
                7 * 86_400_000
            }
            [] => 1000,
            _ => return None,
        };
        total = total.checked_add(n.checked_mul(unit)?)?;
    }
    Some(total)
}

/// A JSON value of a write's body.
#[derive(Debug, PartialEq, Eq)]
enum Value {
    Text(String),
    Number(u64),
}

/// A reader of the one JSON shape the API takes: an object whose members
/// are strings or non-negative integers. Errors are the byte offset.
struct Json<'a> {
    s: &'a [u8],
    i: usize,
}

impl<'a> Json<'a> {
    fn new(s: &'a [u8]) -> Json<'a> {
        Json { s, i: 0 }
    }

    fn space(&mut self) {
        while self.s.get(self.i).is_some_and(|b| b" \t\r\n".contains(b)) {
            self.i += 1;
        }
    }

    fn eat(&mut self, b: u8) -> Result<(), usize> {
        self.space();
        if self.s.get(self.i) == Some(&b) {
            self.i += 1;
            Ok(())
        } else {
            Err(self.i)
        }
    }

    fn object(mut self) -> Result<Vec<(String, Value)>, usize> {
        self.eat(b'{')?;
        let mut out = Vec::new();
        self.space();
        if self.s.get(self.i) == Some(&b'}') {
            self.i += 1;
        } else {
            loop {
                let name = self.string()?;
                self.eat(b':')?;
                let value = self.value()?;
                if out.iter().any(|(n, _): &(String, Value)| *n == name) || out.len() >= 8 {
                    return Err(self.i);
                }
                out.push((name, value));
                self.space();
                match self.s.get(self.i) {
                    Some(b',') => self.i += 1,
                    Some(b'}') => {
                        self.i += 1;
                        break;
                    }
                    _ => return Err(self.i),
                }
            }
        }
        self.space();
        if self.i != self.s.len() {
            return Err(self.i);
        }
        Ok(out)
    }

    fn value(&mut self) -> Result<Value, usize> {
        self.space();
        match self.s.get(self.i) {
            Some(b'"') => Ok(Value::Text(self.string()?)),
            Some(b) if b.is_ascii_digit() => {
                let start = self.i;
                while self.s.get(self.i).is_some_and(|b| b.is_ascii_digit()) {
                    self.i += 1;
                }
                let t = std::str::from_utf8(&self.s[start..self.i]).map_err(|_| start)?;
                t.parse().map(Value::Number).map_err(|_| start)
            }
            _ => Err(self.i),
        }
    }

    fn string(&mut self) -> Result<String, usize> {
        self.eat(b'"')?;
        let mut out = String::new();
        loop {
            let at = self.i;
            let Some(&b) = self.s.get(self.i) else {
                return Err(at);
            };
            self.i += 1;
            match b {
                b'"' => return Ok(out),
                b'\\' => {
                    let e = *self.s.get(self.i).ok_or(at)?;
                    self.i += 1;
                    out.push(match e {
                        b'"' => '"',
                        b'\\' => '\\',
                        b'/' => '/',
                        b'n' => '\n',
                        b't' => '\t',
                        b'r' => '\r',
                        b'b' => '\u{8}',
                        b'f' => '\u{c}',
                        b'u' => {
                            let hex = self.s.get(self.i..self.i + 4).ok_or(at)?;
                            let hex = std::str::from_utf8(hex).map_err(|_| at)?;
                            let c = u32::from_str_radix(hex, 16).map_err(|_| at)?;
                            self.i += 4;
                            char::from_u32(c).ok_or(at)?
                        }
                        _ => return Err(at),
                    });
                }
                0..=0x1f => return Err(at),
                _ => {
                    // a UTF-8 sequence, kept whole
                    let len = match b {
                        0xc0..=0xdf => 2,
                        0xe0..=0xef => 3,
                        0xf0..=0xf7 => 4,
                        _ if b < 0x80 => 1,
                        _ => return Err(at),
                    };
                    let seq = self.s.get(at..at + len).ok_or(at)?;
                    out.push_str(std::str::from_utf8(seq).map_err(|_| at)?);
                    self.i = at + len;
                }
            }
            if out.len() > MAX_BODY {
                return Err(at);
            }
        }
    }
}

#[cfg(test)]
#[path = "api_tests.rs"]
mod tests;
