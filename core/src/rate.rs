//! Rates as written in the configuration: `N r/s`, `r/m`, `r/h` or `r/d`,
//! without spaces (`10r/s`, `1000r/m`).

use std::cell::Cell;
use std::fmt;

/// A limit of `limit` requests per `period` seconds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Rate {
    pub limit: u32,
    pub period: u32,
}

#[derive(Debug, PartialEq, Eq)]
pub struct RateError;

impl fmt::Display for RateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a rate is N r/s, r/m, r/h or r/d with N >= 1, written without spaces (10r/s)")
    }
}

impl Rate {
    /// Also per request, for a rate from variables: plain byte arithmetic.
    #[inline]
    pub fn parse(s: &[u8]) -> Result<Rate, RateError> {
        let digits = s.iter().take_while(|b| b.is_ascii_digit()).count();
        if digits == 0 || digits > 10 {
            return Err(RateError);
        }
        let limit = s[..digits].iter().fold(0u64, |n, d| n * 10 + u64::from(d - b'0'));
        if limit == 0 || limit > u64::from(u32::MAX) {
            return Err(RateError);
        }
        let period = match &s[digits..] {
            b"r/s" => 1,
            b"r/m" => 60,
            b"r/h" => 3600,
            b"r/d" => 86400,
            _ => return Err(RateError),
        };
        Ok(Rate { limit: limit as u32, period })
    }

    #[inline]
    pub fn period_ms(&self) -> u64 {
        u64::from(self.period) * 1000
    }

    fn unit(&self) -> &'static str {
        match self.period {
            1 => "s",
            60 => "m",
            3600 => "h",
            86400 => "d",
            _ => "?",
        }
    }
}

impl fmt::Display for Rate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}r/{}", self.limit, self.unit())
    }
}

/// One rate value and its text, to skip parsing it again: a rate from a
/// `map` comes back as the same few values (single-threaded: a `Cell`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RateCache {
    text: Cell<[u8; RateCache::MAX]>,
    /// 0: empty.
    len: Cell<u8>,
    rate: Cell<Option<Rate>>,
}

impl RateCache {
    /// Longer texts are parsed every time; every valid rate is shorter
    /// (`4294967295r/s` has 13 bytes).
    const MAX: usize = 15;

    /// The rate of `text`, parsed by `parse` unless it is the cached one.
    #[inline]
    pub fn get<E>(
        &self,
        text: &[u8],
        parse: impl FnOnce(&[u8]) -> Result<Rate, E>,
    ) -> Result<Rate, E> {
        let len = text.len();
        if len == usize::from(self.len.get()) {
            if let Some(rate) = self.rate.get() {
                if text == &self.text.get()[..len] {
                    return Ok(rate);
                }
            }
        }
        let rate = parse(text)?;
        if len <= Self::MAX && len > 0 {
            let mut buf = [0; Self::MAX];
            buf[..len].copy_from_slice(text);
            self.text.set(buf);
            self.len.set(len as u8);
            self.rate.set(Some(rate));
        }
        Ok(rate)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit() {
        assert_eq!(Rate::parse(b"10r/s"), Ok(Rate { limit: 10, period: 1 }));
        assert_eq!(Rate::parse(b"1r/m"), Ok(Rate { limit: 1, period: 60 }));
        assert_eq!(Rate::parse(b"100r/h"), Ok(Rate { limit: 100, period: 3600 }));
        assert_eq!(Rate::parse(b"7r/d"), Ok(Rate { limit: 7, period: 86400 }));
        assert_eq!(Rate::parse(b"4294967295r/s").map(|r| r.limit), Ok(u32::MAX));
    }

    #[test]
    fn rejects_bad_rates() {
        for bad in [
            &b""[..],
            b"r/s",
            b"0r/s",
            b"-1r/s",
            b"10",
            b"10r",
            b"10r/",
            b"10r/x",
            b"10 r/s",
            b"10r/sec",
            b"10R/s",
            b"4294967296r/s",
            b"99999999999r/s",
            b"1.5r/s",
        ] {
            assert_eq!(Rate::parse(bad), Err(RateError), "{:?}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn displays_as_written() {
        for s in ["10r/s", "1r/m", "100r/h", "7r/d"] {
            assert_eq!(Rate::parse(s.as_bytes()).unwrap().to_string(), s);
        }
    }

    #[test]
    fn cache_parses_once_per_text_and_never_keeps_errors() {
        let cache = RateCache::default();
        let calls = Cell::new(0);
        let parse = |t: &[u8]| {
            calls.set(calls.get() + 1);
            Rate::parse(t)
        };
        assert_eq!(cache.get(b"100r/m", parse), Ok(Rate { limit: 100, period: 60 }));
        assert_eq!(cache.get(b"100r/m", parse), Ok(Rate { limit: 100, period: 60 }));
        assert_eq!(calls.get(), 1);
        // same length, other text
        assert_eq!(cache.get(b"100r/h", parse), Ok(Rate { limit: 100, period: 3600 }));
        assert_eq!(cache.get(b"100r/m", parse), Ok(Rate { limit: 100, period: 60 }));
        assert_eq!(calls.get(), 3);
        // an error is not cached, and leaves the last good value
        assert_eq!(cache.get(b"ten", parse), Err(RateError));
        assert_eq!(cache.get(b"ten", parse), Err(RateError));
        assert_eq!(cache.get(b"100r/m", parse), Ok(Rate { limit: 100, period: 60 }));
        assert_eq!(calls.get(), 5);
        let empty = RateCache::default();
        assert_eq!(empty.get(b"", Rate::parse), Err(RateError));
    }
}
