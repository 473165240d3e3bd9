//! Strict links, the thread's part: a worker sends its strict requests'
//! script calls down a connection of its own, on its event loop (no hand-off
//! to this thread and back on the request's path: `src/worker/link/`). The
//! thread makes that connection, because making one blocks: it finds the
//! server (the URL's, or the master the sentinels name), connects within the
//! zone's `timeout=`, authenticates, selects the database and loads the
//! script, then hands the socket over, non-blocking, as `Event::Link`.
//!
//! Only for a zone that a `strict` limit uses, on a single Redis (or one
//! followed through Sentinel) reached over plain TCP or a Unix socket: a
//! cluster (slots, redirections) and TLS stay with the thread, as do error
//! replies and everything after a failure (the worker hands those back).

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use ratelimit_core::resp::{self, Value};
use ratelimit_core::stats::Stats;
use ratelimit_core::strict::{self, sha1_hex, SCRIPT};
use redis::ConnectionAddr;

use super::clock::unix_ms;
use super::event::{Event, ZoneSpec};
use super::io;
use super::server::{error_text, Server};

/// The name a link gives itself (`CLIENT SETNAME`).
pub const LINK_NAME: &str = "ngx_redis_ratelimit_strict";

/// A link try that failed is made again after this, doubling up to
/// `RETRY_MAX` while tries fail.
const RETRY_MIN: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);

/// The worker's wish for a link, and the tries to make it.
pub(super) struct Links {
    /// The worker wants a link.
    wanted: bool,
    /// When one was last tried, and how long after a failed try the next
    /// one waits.
    tried: Option<Instant>,
    backoff: Duration,
}

impl Links {
    /// A zone a `strict` limit uses gets its link as soon as it is up;
    /// another when a small limit first needs one (`want`).
    pub(super) fn new(spec: &ZoneSpec) -> Links {
        Links { wanted: spec.strict && spec.may_link(), tried: None, backoff: RETRY_MIN }
    }

    /// The worker wants a link (after its link failed, or when it could
    /// not take the one it was handed): made as soon as the backend is up
    /// and the last failed try is long enough ago.
    pub(super) fn want(&mut self, spec: &ZoneSpec) {
        self.wanted = spec.may_link();
    }

    /// When the thread must wake to try a link again, if one is wanted.
    pub(super) fn due(&self, server: &Server) -> Option<Instant> {
        (self.wanted && server.is_up())
            .then(|| self.tried.map_or_else(Instant::now, |t| t + self.backoff))
    }

    /// Makes the link the worker wants, if it is due. A try that fails is
    /// logged, the strict calls stay with the thread, and it is tried
    /// again after a backoff.
    pub(super) fn make(&mut self, server: &mut Server, events: &mut Vec<Event>) {
        if !self.wanted || !server.is_up() {
            return;
        }
        let now = Instant::now();
        if self.tried.is_some_and(|t| now < t + self.backoff) {
            return;
        }
        self.tried = Some(now);
        match open(&server.spec) {
            Ok((fd, clock_offset_ms)) => {
                self.wanted = false;
                self.backoff = RETRY_MIN;
                if let Some(st) = server.stats() {
                    Stats::bump(&st.connects);
                }
                events.push(Event::Link { zone: server.spec.index, fd, clock_offset_ms });
            }
            Err(why) => {
                self.backoff = (self.backoff * 2).min(RETRY_MAX);
                let text = format!(
                    "redis_ratelimit: zone \"{}\": a connection for strict requests to Redis {} failed: {}; they go through the background thread",
                    server.spec.name,
                    server.describe(),
                    why
                );
                server.log_error(false, false, text, events);
            }
        }
    }
}

/// Why a link could not be made, for the log line.
#[derive(Debug)]
enum LinkError {
    /// The server (or the master the sentinels name) was not found.
    Resolve(String),
    /// A socket call failed (connect, a read or write, an option).
    Io(std::io::Error),
    /// No address of the host could be reached.
    NoAddress,
    /// The connection closed during the handshake.
    Closed,
    /// A reply that is not the Redis protocol.
    NotRedis,
    /// A command of the handshake was refused (`AUTH`, `SELECT`,
    /// `SCRIPT LOAD`): the command, and Redis's error if it gave one.
    Refused(&'static str, Option<String>),
    /// A TLS or cluster zone (links are plain TCP or Unix sockets).
    NotPlain,
}

impl From<std::io::Error> for LinkError {
    fn from(e: std::io::Error) -> LinkError {
        LinkError::Io(e)
    }
}

impl std::fmt::Display for LinkError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LinkError::Resolve(why) => f.write_str(why),
            LinkError::Io(e) => write!(f, "{e}"),
            LinkError::NoAddress => f.write_str("no address"),
            LinkError::Closed => f.write_str("connection closed"),
            LinkError::NotRedis => f.write_str("not a Redis reply"),
            LinkError::Refused(what, Some(e)) => write!(f, "{what}: {e}"),
            LinkError::Refused(what, None) => write!(f, "{what}: unexpected reply"),
            LinkError::NotPlain => f.write_str("strict links are plain TCP or Unix sockets"),
        }
    }
}

/// Connects and prepares a link (blocking, each step within the zone's
/// `timeout=`), and learns Redis's clock (`TIME`) for the deadlines.
fn open(spec: &ZoneSpec) -> Result<(OwnedFd, Option<i64>), LinkError> {
    let info = io::master_info(&spec.urls, spec.sentinel.as_ref(), &spec.tls, spec.timeout)
        .map_err(|e| LinkError::Resolve(error_text(&e, spec.timeout)))?;
    let settings = info.redis_settings();
    let mut hello = Vec::new();
    let mut expect = Vec::new();
    if let Some(pass) = settings.password() {
        match settings.username() {
            Some(user) => resp::command(&mut hello, &["AUTH", user, pass]),
            None => resp::command(&mut hello, &["AUTH", pass]),
        }
        expect.push("AUTH");
    }
    if settings.db() != 0 {
        resp::command(&mut hello, &["SELECT", &settings.db().to_string()]);
        expect.push("SELECT");
    }
    // named, for CLIENT LIST (a server that refuses the name is fine)
    resp::command(&mut hello, &["CLIENT", "SETNAME", LINK_NAME]);
    expect.push("CLIENT SETNAME");
    resp::command(&mut hello, &["SCRIPT", "LOAD", SCRIPT]);
    expect.push("SCRIPT LOAD");
    let t = spec.timeout;
    match info.addr() {
        ConnectionAddr::Tcp(host, port) => {
            let s = tcp(host, *port, t)?;
            s.set_nodelay(true)?;
            handshake(&s, &hello, &expect, t)?;
            let offset = clock(&s);
            s.set_nonblocking(true)?;
            Ok((s.into(), offset))
        }
        ConnectionAddr::Unix(path) => {
            let s = UnixStream::connect(path)?;
            handshake(&s, &hello, &expect, t)?;
            let offset = clock(&s);
            s.set_nonblocking(true)?;
            Ok((s.into(), offset))
        }
        _ => Err(LinkError::NotPlain),
    }
}

/// Redis's clock minus ours, from `TIME` (`None`: refused, or not
/// understood).
fn clock<S: Timed>(mut s: S) -> Option<i64> {
    let mut cmd = Vec::new();
    resp::command(&mut cmd, &["TIME"]);
    let before = unix_ms();
    s.write_all(&cmd).ok()?;
    let mut input = Vec::new();
    let mut buf = [0u8; 128];
    let v = loop {
        if let Ok(Some((v, _))) = resp::parse(&input) {
            break v;
        }
        let n = s.read(&mut buf).ok().filter(|&n| n > 0)?;
        input.extend_from_slice(&buf[..n]);
    };
    let after = unix_ms();
    let Value::Array(Some(parts)) = v else {
        return None;
    };
    let num = |v: &Value| match v {
        Value::Bulk(Some(b)) => std::str::from_utf8(b).ok()?.parse::<u64>().ok(),
        _ => None,
    };
    Some(strict::clock_offset(num(parts.first()?)?, num(parts.get(1)?)?, before, after))
}

fn tcp(host: &str, port: u16, timeout: Duration) -> Result<TcpStream, LinkError> {
    let mut last = LinkError::NoAddress;
    for a in (host, port).to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = LinkError::Io(e),
        }
    }
    Err(last)
}

/// A blocking stream with timeouts on both directions.
trait Timed: Read + Write {
    fn timeouts(&self, t: Duration) -> std::io::Result<()>;
}

impl Timed for &TcpStream {
    fn timeouts(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

impl Timed for &UnixStream {
    fn timeouts(&self, t: Duration) -> std::io::Result<()> {
        self.set_read_timeout(Some(t))?;
        self.set_write_timeout(Some(t))
    }
}

/// Sends the commands that prepare the link and checks each reply: `+OK`
/// for `AUTH` and `SELECT`, the script's SHA for `SCRIPT LOAD`.
fn handshake<S>(
    mut s: S,
    hello: &[u8],
    expect: &[&'static str],
    timeout: Duration,
) -> Result<(), LinkError>
where
    S: Timed,
{
    s.timeouts(timeout)?;
    s.write_all(hello)?;
    let mut input = Vec::new();
    let mut buf = [0u8; 512];
    for what in expect {
        let v = loop {
            match resp::parse(&input) {
                Ok(Some((v, n))) => {
                    input.drain(..n);
                    break v;
                }
                Ok(None) => {}
                Err(_) => return Err(LinkError::NotRedis),
            }
            let n = s.read(&mut buf)?;
            if n == 0 {
                return Err(LinkError::Closed);
            }
            input.extend_from_slice(&buf[..n]);
        };
        let ok = match (&v, *what) {
            (_, "CLIENT SETNAME") => true,
            (Value::Bulk(Some(sha)), "SCRIPT LOAD") => sha.as_slice() == sha1_hex().as_bytes(),
            (Value::Status(s), _) => s == "OK",
            _ => false,
        };
        if !ok {
            let said = match v {
                Value::Error(e) => Some(e.to_string()),
                _ => None,
            };
            return Err(LinkError::Refused(what, said));
        }
    }
    Ok(())
}
