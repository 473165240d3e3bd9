//! Parsing of the `redis_ratelimit_zone` parameters, apart from nginx so that
//! every accepted and refused form is unit-tested. Messages name the bad
//! value; the caller prefixes the directive name.

use redis::IntoConnectionInfo;

use crate::tls::{SslParams, TlsFiles};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OnError {
    /// Keep limiting from this node's own counts.
    Local,
    /// Let every request through.
    Allow,
    /// Reject every request.
    Deny,
    /// Keep limiting from this node's own counts, each key at this node's
    /// share of what Redis last left of its limit: the share learnt from
    /// Redis's replies, or one node's part (`1/N`, `N` the nodes that
    /// counted through this Redis lately) for a key it has none of.
    Share,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Backend {
    /// As written (they may hold a password: never log them, see `redact`).
    pub urls: Vec<String>,
    pub cluster: bool,
    /// `sentinel=name`: the URLs are Redis Sentinels, and the master they
    /// name `name` is the backend (followed through failovers).
    pub sentinel: Option<Sentinel>,
    /// What the `ssl_*=` files hold (the module reads them; `None`: no
    /// such parameter).
    pub tls: Option<TlsFiles>,
}

/// `sentinel=name [sentinel_user=u] [sentinel_password=p]`.
#[derive(Clone, PartialEq, Eq)]
pub struct Sentinel {
    /// The master's name.
    pub master: String,
    /// What the sentinels are asked with (`AUTH`), when they require a
    /// password of their own. Without it, a sentinel that answers
    /// `NOAUTH` is asked again with the URL's credentials (often the same
    /// as the master's).
    pub user: Option<String>,
    pub password: Option<String>,
}

impl std::fmt::Debug for Sentinel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sentinel")
            .field("master", &self.master)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ZoneParams {
    pub name: String,
    pub size: usize,
    pub backend: Option<Backend>,
    pub prefix: Vec<u8>,
    pub timeout_ms: u64,
    pub on_error: OnError,
    /// `hold=`: the longest a key far from its limit keeps its increments
    /// on this node before they go to Redis (0: the next flush). See `sync`.
    pub hold_ms: u64,
    /// `nodes=`: how many nodes `on_error=share` assumes at least (a node
    /// that has not heard how many count through Redis: started while it
    /// is down). 1 when not given.
    pub nodes: u32,
    /// `password_file=` as written (the module reads it, relative to
    /// nginx's configuration prefix, and `with_password_file` puts what it
    /// holds into the URLs).
    pub password_file: Option<Vec<u8>>,
    /// `ssl_trusted_certificate=`, `ssl_certificate=`,
    /// `ssl_certificate_key=` as written (the module reads the files into
    /// `Backend::tls`).
    pub ssl: SslParams,
}

pub const DEFAULT_PREFIX: &[u8] = b"rl:";
pub const DEFAULT_TIMEOUT_MS: u64 = 500;
pub const DEFAULT_HOLD_MS: u64 = 5_000;
/// The longest `hold=`.
pub const MAX_HOLD_MS: u64 = 60_000;
/// The most nodes `nodes=` may name.
pub const MAX_NODES: u32 = 100_000;
/// The longest `timeout=`: a strict request waits at most this long, and
/// so does a worker that shuts down while Redis is silent.
pub const MAX_TIMEOUT_MS: u64 = 60_000;

fn show(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// How sizes and times are read. The module passes nginx's own parsers
/// (`ngx_parse_size`, `ngx_parse_time`), so that `zone=a:10m` and
/// `timeout=1m30s` mean what they mean everywhere in nginx; unit tests pass
/// stand-ins.
#[derive(Clone, Copy)]
pub struct Units {
    /// Bytes, or `None` when not a size.
    pub size: fn(&[u8]) -> Option<usize>,
    /// Milliseconds (a bare number is seconds), or `None` when not a time.
    pub time_ms: fn(&[u8]) -> Option<u64>,
}

/// Where a URL's user information ends: at its last `@` (a password may
/// hold `/`, `?`, `#` and `@` as typed; a host never holds `@`).
fn userinfo(url: &str) -> Option<(usize, usize)> {
    let start = url.find("://")? + 3;
    let at = url[start..].rfind('@')? + start;
    Some((start, at))
}

/// The password part of a URL as written (percent-encoded or not), if any.
pub fn url_password(url: &str) -> Option<&str> {
    let (start, at) = userinfo(url)?;
    let info = &url[start..at];
    Some(info.split_once(':').map_or(info, |(_, pass)| pass))
}

/// The URL with its password replaced by `***`, for messages: nothing of
/// the password is shown, whatever bytes it holds.
pub fn redact(url: &str) -> String {
    let Some((start, at)) = userinfo(url) else {
        return url.to_string();
    };
    let info = &url[start..at];
    let user = match info.split_once(':') {
        Some((user, _)) => format!("{user}:***"),
        None => "***".to_string(),
    };
    format!("{}{}{}", &url[..start], user, &url[at..])
}

fn check_url(url: &str) -> Result<(), String> {
    let shown = redact(url);
    let lower = url.to_ascii_lowercase();
    if !["redis://", "rediss://", "redis+unix://", "unix://", "valkey://", "valkeys://"]
        .iter()
        .any(|s| lower.starts_with(s))
    {
        return Err(format!(
            "invalid Redis URL \"{shown}\": expected redis://[user:pass@]host:port[/db], rediss://... or redis+unix:///path"
        ));
    }
    // the Redis client takes a bad escape as the three characters, and the
    // server then refuses the password at every connection
    if let Some((start, at)) = userinfo(url) {
        if !percent_escapes_ok(&url.as_bytes()[start..at]) {
            return Err(format!(
                "invalid Redis URL \"{shown}\": the user or password holds a \"%\" that is not \
                 followed by two hex digits (write \"%\" as %25)"
            ));
        }
    }
    match url.into_connection_info() {
        Ok(_) => Ok(()),
        Err(_) => Err(format!(
            "invalid Redis URL \"{shown}\": expected redis://[user:pass@]host:port[/db], rediss://... or redis+unix:///path"
        )),
    }
}

/// Whether every `%` in `b` starts an escape of two hex digits.
fn percent_escapes_ok(b: &[u8]) -> bool {
    b.iter().enumerate().all(|(i, &c)| {
        c != b'%' || b.get(i + 1..i + 3).is_some_and(|h| h.iter().all(u8::is_ascii_hexdigit))
    })
}

/// An unknown parameter whose value is not shown in the message: its name
/// looks like a misspelt secret's (`sentinel_pasword=`, `passwd=`).
fn may_be_secret(name: &[u8]) -> bool {
    let name = name.to_ascii_lowercase();
    name.starts_with(b"sentinel_")
        || [&b"pas"[..], b"pw", b"secret", b"auth", b"token", b"cred"]
            .iter()
            .any(|w| name.windows(w.len()).any(|x| x == *w))
}

/// Parses the parameters after the key: `zone=name:size` (required),
/// `redis=URL[,URL...]`, `cluster`, `sentinel=`, `prefix=str`,
/// `timeout=time`, `on_error=allow|deny|local|share`, `hold=`, `nodes=`,
/// `password_file=` and the `ssl_*=` ones. `min_size` is the smallest
/// zone accepted. Each parameter is read on its own (`Given::take`), then
/// checked against the others (`Given::into_params`).
pub fn parse_zone_params(
    args: &[&[u8]],
    min_size: usize,
    units: Units,
) -> Result<ZoneParams, String> {
    let mut given = Given::default();
    for &arg in args {
        given.take(arg, min_size, &units)?;
    }
    given.into_params()
}

/// The parameters of one `redis_ratelimit_zone` line, as given.
#[derive(Default)]
struct Given {
    zone: Option<(String, usize)>,
    urls: Option<Vec<String>>,
    cluster: Option<()>,
    sentinel: Option<String>,
    sentinel_user: Option<String>,
    sentinel_password: Option<String>,
    prefix: Option<Vec<u8>>,
    timeout_ms: Option<u64>,
    on_error: Option<OnError>,
    hold_ms: Option<u64>,
    nodes: Option<u32>,
    password_file: Option<Vec<u8>>,
    ssl: SslParams,
}

/// Sets a parameter given once: a second one is an error, whatever its
/// value (checked before the value is read).
fn once<T>(
    slot: &mut Option<T>,
    name: &[u8],
    read: impl FnOnce() -> Result<T, String>,
) -> Result<(), String> {
    if slot.is_some() {
        return Err(format!("duplicate parameter \"{}\"", show(name)));
    }
    *slot = Some(read()?);
    Ok(())
}

impl Given {
    /// Reads one parameter.
    fn take(&mut self, arg: &[u8], min_size: usize, units: &Units) -> Result<(), String> {
        let (name, value) = match arg.iter().position(|&b| b == b'=') {
            Some(eq) => (&arg[..eq], Some(&arg[eq + 1..])),
            None => (arg, None),
        };
        match (name, value) {
            (b"zone", Some(v)) => once(&mut self.zone, name, || zone(arg, v, min_size, units)),
            (b"redis", Some(v)) => once(&mut self.urls, name, || redis_urls(v)),
            (b"cluster", None) => once(&mut self.cluster, name, || Ok(())),
            (b"sentinel", Some(v)) => once(&mut self.sentinel, name, || sentinel_name(v)),
            (b"password_file", Some(v)) => once(&mut self.password_file, name, || {
                if v.is_empty() {
                    return Err("invalid password_file \"\": a file name expected".to_string());
                }
                Ok(v.to_vec())
            }),
            (b"sentinel_user", Some(v)) => once(&mut self.sentinel_user, name, || user(v)),
            (b"sentinel_password", Some(v)) => {
                once(&mut self.sentinel_password, name, || password(v))
            }
            (b"prefix", Some(v)) => once(&mut self.prefix, name, || prefix(v)),
            (b"timeout", Some(v)) => once(&mut self.timeout_ms, name, || timeout(v, units)),
            (b"hold", Some(v)) => once(&mut self.hold_ms, name, || hold(v, units)),
            (b"nodes", Some(v)) => once(&mut self.nodes, name, || nodes(v)),
            (b"on_error", Some(v)) => once(&mut self.on_error, name, || on_error(v)),
            (n, Some(v)) if self.ssl.take(n, v)? => Ok(()),
            // a misspelt secret parameter must not show its value
            _ if value.is_some() && may_be_secret(name) => {
                Err(format!("invalid parameter \"{}=***\"", show(name)))
            }
            _ => Err(format!("invalid parameter \"{}\"", show(arg))),
        }
    }

    /// The zone's parameters, once the ones given are checked against each
    /// other.
    fn into_params(self) -> Result<ZoneParams, String> {
        let (name, size) =
            self.zone.clone().ok_or_else(|| "no \"zone=name:size\" parameter".to_string())?;
        let cluster = self.cluster.is_some();
        self.ssl.check(self.urls.as_deref(), cluster)?;
        let backend = match &self.urls {
            Some(urls) => Some(self.backend(urls.clone())?),
            None => {
                self.without_backend()?;
                None
            }
        };
        if self.nodes.is_some() && self.on_error != Some(OnError::Share) {
            return Err("\"nodes=\" needs \"on_error=share\"".to_string());
        }
        Ok(ZoneParams {
            name,
            size,
            backend,
            prefix: self.prefix.unwrap_or_else(|| DEFAULT_PREFIX.to_vec()),
            timeout_ms: self.timeout_ms.unwrap_or(DEFAULT_TIMEOUT_MS),
            on_error: self.on_error.unwrap_or(OnError::Local),
            hold_ms: self.hold_ms.unwrap_or(DEFAULT_HOLD_MS),
            nodes: self.nodes.unwrap_or(1),
            password_file: self.password_file,
            ssl: self.ssl,
        })
    }

    /// The backend the URLs name: one Redis, a cluster, or the sentinels
    /// of a master.
    fn backend(&self, urls: Vec<String>) -> Result<Backend, String> {
        let cluster = self.cluster.is_some();
        if cluster && self.sentinel.is_some() {
            return Err("\"cluster\" and \"sentinel=\" exclude each other".to_string());
        }
        if urls.len() > 1 && !cluster && self.sentinel.is_none() {
            return Err(
                "several Redis URLs need the \"cluster\" or \"sentinel=\" parameter".to_string()
            );
        }
        let sentinel = match &self.sentinel {
            Some(master) => Some(Sentinel {
                master: master.clone(),
                user: self.sentinel_user.clone(),
                password: self.sentinel_password.clone(),
            }),
            None if self.sentinel_user.is_some() || self.sentinel_password.is_some() => {
                return Err(
                    "\"sentinel_user=\" and \"sentinel_password=\" need \"sentinel=\"".to_string()
                )
            }
            None => None,
        };
        if sentinel.as_ref().is_some_and(|s| s.user.is_some() && s.password.is_none()) {
            return Err("\"sentinel_user=\" needs \"sentinel_password=\"".to_string());
        }
        Ok(Backend { urls, cluster, sentinel, tls: None })
    }

    /// A zone without `redis=`: none of the backend's parameters.
    fn without_backend(&self) -> Result<(), String> {
        if self.cluster.is_some() {
            return Err("\"cluster\" needs \"redis=URL,...\"".to_string());
        }
        if self.sentinel.is_some()
            || self.sentinel_user.is_some()
            || self.sentinel_password.is_some()
        {
            return Err("\"sentinel=\" needs \"redis=URL,...\" (the sentinels)".to_string());
        }
        for (set, what) in [
            (self.timeout_ms.is_some(), "timeout="),
            (self.on_error.is_some(), "on_error="),
            (self.prefix.is_some(), "prefix="),
            (self.hold_ms.is_some(), "hold="),
            (self.nodes.is_some(), "nodes="),
            (self.password_file.is_some(), "password_file="),
        ] {
            if set {
                return Err(format!("\"{what}\" needs \"redis=URL\""));
            }
        }
        Ok(())
    }
}

/// `zone=name:size`.
fn zone(arg: &[u8], v: &[u8], min_size: usize, units: &Units) -> Result<(String, usize), String> {
    let colon = v
        .iter()
        .rposition(|&b| b == b':')
        .ok_or_else(|| format!("invalid zone \"{}\": expected zone=name:size", show(arg)))?;
    let (n, sz) = (&v[..colon], &v[colon + 1..]);
    // a colon would make two zones' Redis keys meet: zone `a:b` key `c`
    // and zone `a` key `b:c`
    if n.is_empty() || !n.iter().all(|&b| b.is_ascii_graphic() && !b"{}:".contains(&b)) {
        return Err(format!(
            "invalid zone name \"{}\": printable ASCII without braces or colons expected",
            show(n)
        ));
    }
    let size = (units.size)(sz).ok_or_else(|| format!("invalid zone size \"{}\"", show(sz)))?;
    if size < min_size {
        return Err(format!(
            "zone \"{}\" is too small: {} bytes, at least {} (8 pages) needed",
            show(n),
            size,
            min_size
        ));
    }
    Ok((show(n), size))
}

/// `redis=URL[,URL...]`.
fn redis_urls(v: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(v).map_err(|_| "invalid Redis URL: not UTF-8".to_string())?;
    let list: Vec<String> = text.split(',').map(str::to_string).collect();
    for u in &list {
        check_url(u)?;
    }
    Ok(list)
}

/// `sentinel=`: the master's name.
fn sentinel_name(v: &[u8]) -> Result<String, String> {
    if v.is_empty() || !v.iter().all(|&b| b.is_ascii_graphic()) {
        return Err(format!(
            "invalid sentinel \"{}\": the master's name expected (sentinel=mymaster)",
            show(v)
        ));
    }
    Ok(show(v))
}

/// `sentinel_user=`.
fn user(v: &[u8]) -> Result<String, String> {
    if v.is_empty() || !v.iter().all(|&b| b.is_ascii_graphic()) {
        return Err(format!("invalid sentinel_user \"{}\": a user name expected", show(v)));
    }
    Ok(show(v))
}

/// `sentinel_password=`: never shown, not even in a message about itself.
fn password(v: &[u8]) -> Result<String, String> {
    match std::str::from_utf8(v) {
        Ok(p) if !p.is_empty() => Ok(p.to_string()),
        _ => Err("invalid sentinel_password: a non-empty UTF-8 password expected".to_string()),
    }
}

/// `prefix=`.
fn prefix(v: &[u8]) -> Result<Vec<u8>, String> {
    if v.contains(&b'{') || v.contains(&b'}') {
        return Err(format!(
            "invalid prefix \"{}\": braces would change the cluster hash tag",
            show(v)
        ));
    }
    Ok(v.to_vec())
}

/// `timeout=`.
fn timeout(v: &[u8], units: &Units) -> Result<u64, String> {
    match (units.time_ms)(v) {
        Some(ms) if ms > 0 && ms <= MAX_TIMEOUT_MS => Ok(ms),
        _ => Err(format!(
            "invalid timeout \"{}\": a time from 1ms to 60s expected (100ms, 1s)",
            show(v)
        )),
    }
}

/// `hold=`.
fn hold(v: &[u8], units: &Units) -> Result<u64, String> {
    match (units.time_ms)(v) {
        Some(ms) if ms <= MAX_HOLD_MS => Ok(ms),
        _ => Err(format!(
            "invalid hold \"{}\": a time from 0 to 60s expected (0, 500ms, 5s)",
            show(v)
        )),
    }
}

/// `nodes=`.
fn nodes(v: &[u8]) -> Result<u32, String> {
    match std::str::from_utf8(v).ok().and_then(|t| t.parse::<u32>().ok()) {
        Some(n) if (1..=MAX_NODES).contains(&n) && v[0].is_ascii_digit() => Ok(n),
        _ => Err(format!(
            "invalid nodes \"{}\": a number of nodes from 1 to {} expected",
            show(v),
            MAX_NODES
        )),
    }
}

/// `on_error=`.
fn on_error(v: &[u8]) -> Result<OnError, String> {
    match v {
        b"local" => Ok(OnError::Local),
        b"allow" => Ok(OnError::Allow),
        b"deny" => Ok(OnError::Deny),
        b"share" => Ok(OnError::Share),
        _ => Err(format!("invalid on_error \"{}\": allow, deny, local or share expected", show(v))),
    }
}

/// Puts the credentials a `password_file=` holds into the zone's URLs:
/// one line (the password, for the default user) or two (the user, then
/// the password); a final newline is fine. A URL that holds credentials of
/// its own is an error (which one would count?). With `sentinel=` the
/// credentials are the master's, as a URL's are. Messages never show the
/// file's contents.
pub fn with_password_file(p: &mut ZoneParams, contents: &[u8]) -> Result<(), String> {
    let text = std::str::from_utf8(contents)
        .map_err(|_| "the password file is not UTF-8 text".to_string())?;
    let mut lines: Vec<&str> =
        text.split('\n').map(|l| l.strip_suffix('\r').unwrap_or(l)).collect();
    while lines.last().is_some_and(|l| l.is_empty()) {
        lines.pop();
    }
    let (user, password) = match lines.as_slice() {
        [pass] => (None, *pass),
        [user, pass] if !user.is_empty() => (Some(*user), *pass),
        _ => {
            return Err("the password file must hold one line (the password) or two (the user, \
                        then the password)"
                .to_string())
        }
    };
    if password.is_empty() {
        return Err("the password file holds an empty password".to_string());
    }
    let Some(backend) = p.backend.as_mut() else {
        return Err("\"password_file=\" needs \"redis=URL\"".to_string());
    };
    for url in backend.urls.iter_mut() {
        if userinfo(url).is_some() || url.contains("pass=") {
            return Err(format!(
                "the URL \"{}\" has credentials of its own beside \"password_file=\"",
                redact(url)
            ));
        }
        *url = with_credentials(url, user, password);
    }
    Ok(())
}

/// `url` with `user` and `password` in it, percent-encoded: after the
/// scheme for a TCP URL, as `user=` and `pass=` for a Unix socket's.
fn with_credentials(url: &str, user: Option<&str>, password: &str) -> String {
    let enc = |s: &str| {
        s.bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect::<String>()
    };
    let lower = url.to_ascii_lowercase();
    if lower.starts_with("redis+unix:") || lower.starts_with("unix:") {
        let sep = if url.contains('?') { '&' } else { '?' };
        let user = user.map(|u| format!("user={}&", enc(u))).unwrap_or_default();
        return format!("{url}{sep}{user}pass={}", enc(password));
    }
    let Some(start) = url.find("://").map(|i| i + 3) else {
        return url.to_string();
    };
    let user = user.map(enc).unwrap_or_default();
    format!("{}{}:{}@{}", &url[..start], user, enc(password), &url[start..])
}

#[cfg(test)]
#[path = "params_tests.rs"]
mod tests;
