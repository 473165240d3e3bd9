//! One backend connection (a single Redis or a cluster) and the only way
//! commands reach it: `exec` sends them as one pipeline and returns one
//! `Reply` per command, so that an error reply to one command fails that
//! command alone, and a connection lost half way tells which replies were
//! read (applied) and which commands may or may not have run (never sent
//! again).

mod masters;
mod named;

pub use named::Tls;
use named::Wire;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ratelimit_core::params::Sentinel;
use redis::{Cmd, ConnectionAddr, IntoConnectionInfo, RedisError, Value};

/// What became of one command of a pipeline.
#[derive(Debug)]
pub enum Reply {
    /// Its reply (never an error reply).
    Value(Value),
    /// An error reply: Redis did not run it. `code` is the error's first
    /// word (`WRONGTYPE`, `OOM`, `NOPERM`, `READONLY`, `ERR`, ...).
    Refused { code: String, text: String },
    /// Sent, but the connection failed before its reply: it may have run.
    Lost,
    /// Never sent (the pipeline stopped before it): it did not run.
    NotSent,
}

impl Reply {
    fn from_value(v: Value) -> Reply {
        match v {
            Value::ServerError(e) => {
                Reply::Refused { code: e.code().to_string(), text: e.to_string() }
            }
            v => Reply::Value(v),
        }
    }

    fn refused(e: &RedisError) -> Reply {
        Reply::Refused { code: e.code().unwrap_or("ERR").to_string(), text: e.to_string() }
    }

    /// A cluster reply saying the command went to the wrong node: it did
    /// not run, and is sent again where the cluster says.
    fn is_redirect(&self) -> bool {
        matches!(self, Reply::Refused { code, .. } if matches!(code.as_str(), "MOVED" | "ASK"))
    }

    /// The cluster (or a master) is down: a transport-level condition.
    pub fn is_cluster_down(&self) -> bool {
        matches!(self, Reply::Refused { code, .. }
            if matches!(code.as_str(), "CLUSTERDOWN" | "TRYAGAIN" | "MASTERDOWN"))
    }
}

/// An error that is the server's answer, not the transport's.
fn is_reply(e: &RedisError) -> bool {
    matches!(e.kind(), redis::ErrorKind::Server(_) | redis::ErrorKind::Extension)
}

pub enum Conn {
    Single(Wire),
    Cluster(Box<Cluster>),
}

/// A cluster: one plain connection per master for the pipelines (so that a
/// master that hangs holds up only its own keys, and a connection that
/// failed is dropped alone), and the `redis` crate's cluster connection for
/// the slot map and for commands a master redirected (MOVED, ASK).
pub struct Cluster {
    pub router: redis::cluster::ClusterConnection,
    /// The first URL's settings (credentials, TLS, database): every master
    /// is reached with them, at its own address.
    base: redis::ConnectionInfo,
    tls: Tls,
    masters: HashMap<String, Wire>,
    timeout: Duration,
}

/// Opens a connection, bounded by `timeout` for connecting and for every
/// read and write after. With `sentinel`, the URLs are sentinels: the
/// connection is to the master they name.
pub fn connect(
    urls: &[String],
    cluster: bool,
    sentinel: Option<&Sentinel>,
    tls: &Tls,
    timeout: Duration,
) -> redis::RedisResult<Conn> {
    if let Some(s) = sentinel {
        return Ok(Conn::Single(sentinel_master(urls, s, tls, timeout)?.0));
    }
    let first = urls.first().map(String::as_str).unwrap_or_default();
    if cluster {
        let mut builder = redis::cluster::ClusterClient::builder(urls.to_vec())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(1);
        if let Some(t) = &tls.certs {
            // `certs` alone would also turn the first URL's `#insecure` off
            if let ConnectionAddr::TcpTls { insecure: true, .. } =
                first.into_connection_info()?.addr()
            {
                builder = builder.tls(redis::TlsMode::Insecure);
            }
            builder = builder.certs(t.clone());
        }
        let client = builder.build()?;
        let base = info(first, tls)?;
        Ok(Conn::Cluster(Box::new(Cluster {
            router: client.get_connection()?,
            base,
            tls: tls.clone(),
            masters: HashMap::new(),
            timeout,
        })))
    } else {
        let mut con = Wire::open(info(first, tls)?, tls, timeout)?;
        writable(&mut con)?;
        Ok(Conn::Single(con))
    }
}

/// A plain URL's server must take writes: after a failover done by DNS or
/// a virtual IP, the address may lead to the old master, now a replica,
/// which refuses every count (`READONLY`); the backend stays down until
/// the address leads to a master again. A user whose ACL refuses `ROLE`
/// is taken at its word (a `READONLY` reply takes the backend down again).
fn writable(con: &mut Wire) -> redis::RedisResult<()> {
    match redis::cmd("ROLE").query::<Vec<Value>>(con) {
        Ok(role) => match role.first() {
            Some(Value::BulkString(r)) if r == b"master" => Ok(()),
            _ => Err(RedisError::from((
                redis::ErrorKind::Io,
                "the server is a replica (read-only): waiting for a master at this address",
            ))),
        },
        Err(e) if e.code() == Some("NOPERM") => Ok(()),
        Err(e) => Err(e),
    }
}

/// Where a single Redis is, with its settings: the URL's, or the master
/// the sentinels name now (which is checked to be one).
pub fn master_info(
    urls: &[String],
    sentinel: Option<&Sentinel>,
    tls: &Tls,
    timeout: Duration,
) -> redis::RedisResult<redis::ConnectionInfo> {
    match sentinel {
        Some(s) => Ok(sentinel_master(urls, s, tls, timeout)?.1),
        None => info(urls.first().map(String::as_str).unwrap_or_default(), tls),
    }
}

/// A URL's connection settings, with the zone's `ssl_*=` certificates
/// when it is a `rediss://` one.
fn info(url: &str, tls: &Tls) -> redis::RedisResult<redis::ConnectionInfo> {
    let ci = url.into_connection_info()?;
    match &tls.certs {
        Some(t) if matches!(ci.addr(), ConnectionAddr::TcpTls { .. }) => {
            Ok(redis::Client::build_with_tls(ci, t.clone())?.get_connection_info().clone())
        }
        _ => Ok(ci),
    }
}

/// `base`'s settings (credentials, database, TLS) at another address: a
/// cluster's master, or the master a sentinel names.
fn at(base: &redis::ConnectionInfo, host: String, port: u16) -> redis::ConnectionInfo {
    let addr = match base.addr() {
        ConnectionAddr::TcpTls { insecure, tls_params, .. } => ConnectionAddr::TcpTls {
            host,
            port,
            insecure: *insecure,
            tls_params: tls_params.clone(),
        },
        _ => ConnectionAddr::Tcp(host, port),
    };
    base.clone().set_addr(addr)
}

/// Asks the sentinels, in order, where master `s.master` is, and connects
/// to it with the first URL's credentials, database and TLS settings. A
/// sentinel is asked with `sentinel_user=`/`sentinel_password=` when they
/// are given; else without credentials, and again with its URL's when it
/// answers `NOAUTH` (a sentinel protected with the same password as the
/// master). The master must say it is one (`ROLE`): a sentinel that has
/// not seen a failover yet may still name the old master, now a replica.
fn sentinel_master(
    urls: &[String],
    s: &Sentinel,
    tls: &Tls,
    timeout: Duration,
) -> redis::RedisResult<(Wire, redis::ConnectionInfo)> {
    let base = info(urls.first().map(String::as_str).unwrap_or_default(), tls)?;
    let mut last = RedisError::from((redis::ErrorKind::Io, "no sentinel answered"));
    for url in urls {
        let asked = info(url, tls).and_then(|ci| ask_sentinel(&ci, s, tls, timeout));
        let (host, port) = match asked {
            Ok(a) => a,
            Err(e) => {
                last = e;
                continue;
            }
        };
        let info = at(&base, host, port);
        let opened = Wire::open(info.clone(), tls, timeout).and_then(|mut con| {
            let role: Vec<Value> = redis::cmd("ROLE").query(&mut con)?;
            match role.first() {
                Some(Value::BulkString(r)) if r == b"master" => Ok((con, info)),
                _ => Err(RedisError::from((
                    redis::ErrorKind::Io,
                    "the server the sentinel named is not a master (yet)",
                ))),
            }
        });
        match opened {
            Ok(con) => return Ok(con),
            Err(e) => last = e,
        }
    }
    Err(last)
}

/// One sentinel's answer to where the master is (see `sentinel_master`).
fn ask_sentinel(
    url: &redis::ConnectionInfo,
    s: &Sentinel,
    tls: &Tls,
    timeout: Duration,
) -> redis::RedisResult<(String, u16)> {
    // the sentinel's address and TLS settings, none of the master's
    let bare = url.addr().clone().into_connection_info()?;
    let with = |user: Option<&str>, password: &str| {
        let mut settings = bare.redis_settings().clone().set_password(password);
        if let Some(u) = user {
            settings = settings.set_username(u);
        }
        bare.clone().set_redis_settings(settings)
    };
    let ask = |ci: redis::ConnectionInfo| {
        let mut con = Wire::open(ci, tls, timeout)?;
        let addr: Option<(String, u16)> =
            redis::cmd("SENTINEL").arg("get-master-addr-by-name").arg(&s.master).query(&mut con)?;
        addr.ok_or_else(|| {
            RedisError::from((redis::ErrorKind::Io, "the sentinel does not know the master"))
        })
    };
    if let Some(p) = &s.password {
        return ask(with(s.user.as_deref(), p));
    }
    match ask(bare.clone()) {
        Err(e) if e.code() == Some("NOAUTH") => match url.redis_settings().password() {
            Some(p) => ask(with(url.redis_settings().username(), p)),
            None => Err(e),
        },
        other => other,
    }
}

impl Conn {
    /// Sends `cmds` as one pipeline and reads a reply per command. The
    /// error, when there is one, is the transport's: the connection is then
    /// unusable. Commands redirected in a cluster (MOVED, ASK) are sent
    /// again one by one, which follows the redirection, until `deadline`.
    /// `readback`: the command that reads again what command `i` left, for
    /// a cluster pipeline that failed in part.
    /// In a cluster, `node` is the master serving every command's key:
    /// they go down its own connection (redirected ones are sent again
    /// through the cluster connection); without it they go as one cluster
    /// pipeline.
    pub fn exec(
        &mut self,
        cmds: &[Cmd],
        node: Option<&str>,
        deadline: Instant,
        readback: &dyn Fn(usize) -> Option<Cmd>,
    ) -> (Vec<Reply>, Option<RedisError>) {
        match self {
            Conn::Single(con) => exec_single(con, cmds),
            Conn::Cluster(c) => match node {
                None => exec_cluster(&mut c.router, cmds, deadline, readback),
                Some(n) => {
                    let (mut out, broken) = match c.master(n) {
                        Ok(con) => exec_single(con, cmds),
                        Err(e) => {
                            let mut out = Vec::new();
                            out.resize_with(cmds.len(), || Reply::NotSent);
                            (out, Some(e))
                        }
                    };
                    if broken.is_some() {
                        c.drop_master(n);
                        return (out, broken);
                    }
                    let broken = resend_redirected(&mut c.router, cmds, &mut out, deadline);
                    (out, broken)
                }
            },
        }
    }

    /// Redis's clock minus ours (ms), from `TIME` (a cluster: the node the
    /// router picks; `None`: refused, an ACL without `TIME`).
    pub fn clock_offset(&mut self) -> Option<i64> {
        let time = redis::cmd("TIME");
        let before = super::clock::unix_ms();
        let t: (u64, u64) = match self {
            Conn::Single(con) => time.query(con).ok()?,
            Conn::Cluster(c) => time.query(&mut c.router).ok()?,
        };
        Some(ratelimit_core::strict::clock_offset(t.0, t.1, before, super::clock::unix_ms()))
    }

    /// PING; for a cluster also `CLUSTER INFO`, which must say
    /// `cluster_state:ok` (a cluster that is not serving every slot counts
    /// as down).
    pub fn check(&mut self) -> redis::RedisResult<()> {
        let ping = redis::cmd("PING");
        match self {
            Conn::Single(con) => ping.query::<Value>(con).map(drop),
            Conn::Cluster(c) => c.check(),
        }
    }
}

/// `CLUSTER INFO` on `con`: an error unless it says `cluster_state:ok`.
fn cluster_state_ok(con: &mut dyn redis::ConnectionLike) -> redis::RedisResult<()> {
    let info = redis::cmd("CLUSTER").arg("INFO").query::<String>(con)?;
    if info.contains("cluster_state:ok") {
        Ok(())
    } else {
        Err(RedisError::from((
            redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
            "cluster_state is not ok",
        )))
    }
}

fn exec_single(con: &mut Wire, cmds: &[Cmd]) -> (Vec<Reply>, Option<RedisError>) {
    let mut packed = Vec::new();
    for c in cmds {
        c.write_packed_command(&mut packed);
    }
    let mut out = Vec::with_capacity(cmds.len());
    if let Err(e) = con.send_packed_command(&packed) {
        // part of it may have gone out: nothing is known
        out.resize_with(cmds.len(), || Reply::Lost);
        return (out, Some(e));
    }
    for _ in cmds {
        match con.recv_response() {
            Ok(v) => out.push(Reply::from_value(v)),
            Err(e) if is_reply(&e) => out.push(Reply::refused(&e)),
            Err(e) => {
                out.resize_with(cmds.len(), || Reply::Lost);
                return (out, Some(e));
            }
        }
    }
    (out, None)
}

/// A cluster pipeline answers all or nothing: with an error reply anywhere
/// it returns only the error replies, by position. Every other command did
/// run then; the counts their `INCRBY`s left are read back with `GET`
/// (`readback` gives the `GET` for a command, if it needs one).
fn exec_cluster(
    con: &mut redis::cluster::ClusterConnection,
    cmds: &[Cmd],
    deadline: Instant,
    readback: &dyn Fn(usize) -> Option<Cmd>,
) -> (Vec<Reply>, Option<RedisError>) {
    let mut p = redis::cluster::cluster_pipe();
    for c in cmds {
        p.add_command(c.clone());
    }
    let lost = |n: usize| {
        let mut out = Vec::with_capacity(n);
        out.resize_with(n, || Reply::Lost);
        out
    };
    let errors = match p.query::<Vec<Value>>(con) {
        Ok(values) => {
            let mut out: Vec<Reply> = values.into_iter().map(Reply::from_value).collect();
            out.resize_with(cmds.len(), || Reply::NotSent);
            return (out, None);
        }
        Err(e) => match e.clone().into_server_errors() {
            Some(errs) if !errs.is_empty() => errs,
            _ => return (lost(cmds.len()), Some(e)),
        },
    };
    let mut out: Vec<Reply> = Vec::with_capacity(cmds.len());
    out.resize_with(cmds.len(), || Reply::Value(Value::Okay));
    for (i, e) in errors.iter() {
        if let Some(slot) = out.get_mut(*i) {
            *slot = Reply::Refused { code: e.code().to_string(), text: e.to_string() };
        }
    }
    // Commands that ran and whose value matters: read it back.
    let mut broken = None;
    let mut back = redis::cluster::cluster_pipe();
    let mut back_at = Vec::new();
    for (i, r) in out.iter().enumerate() {
        if matches!(r, Reply::Value(_)) {
            if let Some(get) = readback(i) {
                back.add_command(get);
                back_at.push(i);
            }
        }
    }
    if !back_at.is_empty() {
        match back.query::<Vec<Value>>(con) {
            Ok(values) => {
                for (i, v) in back_at.iter().zip(values) {
                    out[*i] = Reply::from_value(v);
                }
            }
            Err(e) => {
                // they ran; only their counts are unknown
                for i in &back_at {
                    out[*i] = Reply::Lost;
                }
                if e.clone().into_server_errors().is_none() {
                    broken = Some(e);
                }
            }
        }
    }
    if broken.is_some() {
        for r in out.iter_mut().filter(|r| r.is_redirect()) {
            *r = Reply::NotSent;
        }
        return (out, broken);
    }
    let broken = resend_redirected(con, cmds, &mut out, deadline);
    (out, broken)
}

/// Redirected commands did not run: sends them again, singly (a single
/// command follows MOVED/ASK), while the deadline allows; the others are
/// marked not sent.
fn resend_redirected(
    con: &mut redis::cluster::ClusterConnection,
    cmds: &[Cmd],
    out: &mut [Reply],
    deadline: Instant,
) -> Option<RedisError> {
    let mut broken = None;
    for (i, cmd) in cmds.iter().enumerate() {
        if !out[i].is_redirect() {
            continue;
        }
        if broken.is_some() || Instant::now() >= deadline {
            out[i] = Reply::NotSent;
            continue;
        }
        out[i] = match cmd.query::<Value>(con) {
            Ok(v) => Reply::from_value(v),
            Err(e) if is_reply(&e) => Reply::refused(&e),
            Err(e) => {
                broken = Some(e);
                Reply::Lost
            }
        };
    }
    broken
}
