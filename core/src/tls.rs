//! TLS to Redis beyond the URL's `rediss://`: the `ssl_*=` zone parameters
//! (named after nginx's `proxy_ssl_*` directives), what the files hold once
//! read, and the one thing the module checks in a certificate itself: when
//! it stops (and starts) being valid, read from its DER encoding.
//!
//! - `ssl_trusted_certificate=file`: PEM certificates of the CAs the server
//!   is verified against, instead of the system's store.
//! - `ssl_certificate=file` and `ssl_certificate_key=file`: the client's
//!   certificate (chain) and key, for a server that asks for one
//!   (`tls-auth-clients yes`, Redis's default).
//! - `ssl_name=name`: the name verified in the server's certificate, and
//!   sent as SNI, instead of the address connected to (a URL or a
//!   sentinel may give an IP address while the certificate names a host).
//!
//! They apply to every `rediss://` connection of the zone: the server,
//! the sentinels and the master they name, the nodes of a cluster.

/// The `ssl_*=` parameters as written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SslParams {
    pub trusted_certificate: Option<Vec<u8>>,
    pub certificate: Option<Vec<u8>>,
    pub certificate_key: Option<Vec<u8>>,
    pub name: Option<String>,
}

fn show(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

impl SslParams {
    /// Takes `name=value` if it is an `ssl_*` parameter (`Ok(false)`: it is
    /// not one).
    pub fn take(&mut self, name: &[u8], value: &[u8]) -> Result<bool, String> {
        if name == b"ssl_name" {
            if self.name.is_some() {
                return Err("duplicate parameter \"ssl_name\"".to_string());
            }
            if value.is_empty() || !value.iter().all(|b| b.is_ascii_graphic()) {
                return Err(format!("invalid ssl_name \"{}\": a host name expected", show(value)));
            }
            self.name = Some(show(value));
            return Ok(true);
        }
        let slot = match name {
            b"ssl_trusted_certificate" => &mut self.trusted_certificate,
            b"ssl_certificate" => &mut self.certificate,
            b"ssl_certificate_key" => &mut self.certificate_key,
            _ => return Ok(false),
        };
        if slot.is_some() {
            return Err(format!("duplicate parameter \"{}\"", show(name)));
        }
        if value.is_empty() {
            return Err(format!("invalid {} \"\": a file name expected", show(name)));
        }
        *slot = Some(value.to_vec());
        Ok(true)
    }

    pub fn any(&self) -> bool {
        self.trusted_certificate.is_some() || self.certificate.is_some() || self.name.is_some()
    }

    /// The first parameter given, for "needs" messages.
    fn first(&self) -> &'static str {
        if self.trusted_certificate.is_some() {
            "ssl_trusted_certificate="
        } else if self.certificate.is_some() {
            "ssl_certificate="
        } else if self.name.is_some() {
            "ssl_name="
        } else {
            "ssl_certificate_key="
        }
    }

    /// Checks the parameters against each other and against the zone's
    /// URLs (as written, lowercase scheme checked here): a certificate
    /// needs its key and the other way round; they need a `rediss://`
    /// URL; verifying (a CA, a name) contradicts a URL's `#insecure`; a
    /// cluster's nodes are verified by the endpoints they announce.
    pub fn check(&self, urls: Option<&[String]>, cluster: bool) -> Result<(), String> {
        match (&self.certificate, &self.certificate_key) {
            (Some(_), None) => {
                return Err("\"ssl_certificate=\" needs \"ssl_certificate_key=\"".to_string())
            }
            (None, Some(_)) => {
                return Err("\"ssl_certificate_key=\" needs \"ssl_certificate=\"".to_string())
            }
            _ => {}
        }
        if !self.any() {
            return Ok(());
        }
        let Some(urls) = urls else {
            return Err(format!("\"{}\" needs \"redis=URL\"", self.first()));
        };
        let tls = |u: &String| {
            let l = u.to_ascii_lowercase();
            l.starts_with("rediss://") || l.starts_with("valkeys://")
        };
        if !urls.iter().any(tls) {
            return Err(format!("\"{}\" needs a TLS URL (rediss://host:port)", self.first()));
        }
        let verifies = if self.trusted_certificate.is_some() {
            Some("ssl_trusted_certificate=")
        } else {
            self.name.as_ref().map(|_| "ssl_name=")
        };
        if let Some(p) = verifies.filter(|_| urls.iter().any(|u| u.ends_with("#insecure"))) {
            return Err(format!(
                "\"{p}\" verifies the server, and the URL's \"#insecure\" turns \
                 verification off: remove one"
            ));
        }
        if cluster && self.name.is_some() {
            return Err("\"ssl_name=\" does not apply to \"cluster\": each node is verified \
                        by the endpoint it announces (its IP address, or its hostname with \
                        cluster-preferred-endpoint-type hostname)"
                .to_string());
        }
        Ok(())
    }
}

/// What the `ssl_*=` files hold, read by the module at configuration time
/// (the key is kept as PKCS#8 or however it was written: PEM). Never shown.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificates to verify the server against.
    pub trusted: Option<Vec<u8>>,
    /// PEM certificate chain and key of the client.
    pub certificate: Option<Vec<u8>>,
    pub key: Option<Vec<u8>>,
    /// `ssl_name=`.
    pub name: Option<String>,
}

impl std::fmt::Debug for TlsFiles {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let set = |v: &Option<Vec<u8>>| if v.is_some() { "set" } else { "-" };
        f.debug_struct("TlsFiles")
            .field("trusted", &set(&self.trusted))
            .field("certificate", &set(&self.certificate))
            .field("key", &set(&self.key))
            .field("name", &self.name)
            .finish()
    }
}

/// A certificate's validity (`notBefore`, `notAfter`), as seconds since
/// the Unix epoch, from its DER encoding; `None` when the encoding is not
/// an X.509 certificate's.
pub fn validity(der: &[u8]) -> Option<(i64, i64)> {
    let (cert, _) = element(der, 0x30)?;
    let (mut tbs, _) = element(cert, 0x30)?;
    // [0] version (optional), serialNumber, signature, issuer, validity
    if tbs.first() == Some(&0xa0) {
        tbs = element(tbs, 0xa0)?.1;
    }
    for tag in [0x02, 0x30, 0x30] {
        tbs = element(tbs, tag)?.1;
    }
    let (validity, _) = element(tbs, 0x30)?;
    let (from, rest) = time(validity)?;
    let (until, _) = time(rest)?;
    Some((from, until))
}

/// A certificate's X.509 version (1, 2 or 3) from its DER encoding: the
/// `[0] version` of its body, 1 when absent; `None` when the encoding is
/// not an X.509 certificate's. TLS libraries refuse a v1 certificate in a
/// client's chain (no extensions: nothing says what it may be used for).
pub fn version(der: &[u8]) -> Option<u8> {
    let (cert, _) = element(der, 0x30)?;
    let (tbs, _) = element(cert, 0x30)?;
    if tbs.first() != Some(&0xa0) {
        return Some(1);
    }
    let (explicit, _) = element(tbs, 0xa0)?;
    match element(explicit, 0x02)?.0 {
        [v @ 0..=2] => Some(v + 1),
        _ => None,
    }
}

/// The contents of the DER element at the start of `b` if its tag is
/// `tag`, and what follows it.
fn element(b: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    if *b.first()? != tag {
        return None;
    }
    let first = *b.get(1)?;
    let (len, head) = if first < 0x80 {
        (first as usize, 2)
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 {
            return None;
        }
        let mut len = 0usize;
        for &x in b.get(2..2 + n)? {
            len = (len << 8) | x as usize;
        }
        (len, 2 + n)
    };
    let end = head.checked_add(len)?;
    Some((b.get(head..end)?, b.get(end..)?))
}

/// A UTCTime (`YYMMDDHHMMSSZ`) or GeneralizedTime (`YYYYMMDDHHMMSSZ`) at
/// the start of `b`, as Unix seconds, and what follows it.
fn time(b: &[u8]) -> Option<(i64, &[u8])> {
    let (text, year_digits) = match b.first()? {
        0x17 => (element(b, 0x17)?, 2),
        0x18 => (element(b, 0x18)?, 4),
        _ => return None,
    };
    let (t, rest) = text;
    if t.len() != year_digits + 11 || t.last() != Some(&b'Z') {
        return None;
    }
    let num = |s: &[u8]| -> Option<i64> {
        s.iter().try_fold(0i64, |n, &c| c.is_ascii_digit().then(|| n * 10 + i64::from(c - b'0')))
    };
    let mut year = num(&t[..year_digits])?;
    if year_digits == 2 {
        // RFC 5280: 50..99 is 19xx, 00..49 is 20xx
        year += if year >= 50 { 1900 } else { 2000 };
    }
    let f = |i: usize| num(&t[year_digits + i..year_digits + i + 2]);
    let (month, day, h, m, s) = (f(0)?, f(2)?, f(4)?, f(6)?, f(8)?);
    if !(1..=12).contains(&month) || !(1..=31).contains(&day) || h > 23 || m > 59 || s > 60 {
        return None;
    }
    Some((days_from_civil(year, month, day) * 86_400 + h * 3600 + m * 60 + s, rest))
}

/// Days since 1970-01-01 of a proleptic Gregorian date.
fn days_from_civil(y: i64, m: i64, d: i64) -> i64 {
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// Unix seconds as `YYYY-MM-DD HH:MM:SS UTC`, for messages.
pub fn utc(secs: i64) -> String {
    let days = secs.div_euclid(86_400);
    let rem = secs.rem_euclid(86_400);
    // civil_from_days
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02} UTC", rem / 3600, rem % 3600 / 60, rem % 60)
}

#[cfg(test)]
#[path = "tls_tests.rs"]
mod tests;
