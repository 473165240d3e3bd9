//! One backend connection (a single Redis or a cluster) and the only way
//! commands reach it: `exec` sends them as one pipeline and returns one
//! `Reply` per command, so that an error reply to one command fails that
//! command alone, and a connection lost half way tells which replies were
//! read (applied) and which commands may or may not have run (never sent
//! again).

use std::time::{Duration, Instant};

use redis::{Cmd, RedisError, Value};

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
            Value::ServerError(e) => Reply::Refused {
                code: e.code().to_string(),
                text: e.to_string(),
            },
            v => Reply::Value(v),
        }
    }

    fn refused(e: &RedisError) -> Reply {
        Reply::Refused {
            code: e.code().unwrap_or("ERR").to_string(),
            text: e.to_string(),
        }
    }

    /// A cluster reply saying the command went to the wrong node or the
    /// cluster cannot serve it: it did not run.
    fn is_redirect(&self) -> bool {
        matches!(self, Reply::Refused { code, .. }
            if matches!(code.as_str(), "MOVED" | "ASK" | "TRYAGAIN" | "CLUSTERDOWN"))
    }

    /// The cluster (or a master) is down: a transport-level condition.
    pub fn is_cluster_down(&self) -> bool {
        matches!(self, Reply::Refused { code, .. }
            if matches!(code.as_str(), "CLUSTERDOWN" | "TRYAGAIN" | "MASTERDOWN"))
    }
}

/// An error that is the server's answer, not the transport's.
fn is_reply(e: &RedisError) -> bool {
    matches!(
        e.kind(),
        redis::ErrorKind::Server(_) | redis::ErrorKind::Extension
    )
}

pub enum Conn {
    Single(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

/// Opens a connection, bounded by `timeout` for connecting and for every
/// read and write after.
pub fn connect(urls: &[String], cluster: bool, timeout: Duration) -> redis::RedisResult<Conn> {
    if cluster {
        let client = redis::cluster::ClusterClient::builder(urls.to_vec())
            .connection_timeout(timeout)
            .response_timeout(timeout)
            .retries(1)
            .build()?;
        Ok(Conn::Cluster(Box::new(client.get_connection()?)))
    } else {
        let url = urls.first().map(String::as_str).unwrap_or_default();
        let client = redis::Client::open(url)?;
        let con = client.get_connection_with_timeout(timeout)?;
        con.set_read_timeout(Some(timeout))?;
        con.set_write_timeout(Some(timeout))?;
        Ok(Conn::Single(con))
    }
}

impl Conn {
    /// Sends `cmds` as one pipeline and reads a reply per command. The
    /// error, when there is one, is the transport's: the connection is then
    /// unusable. Commands redirected in a cluster (MOVED, ASK) are sent
    /// again one by one, which follows the redirection, until `deadline`.
    /// `readback`: the command that reads again what command `i` left, for
    /// a cluster pipeline that failed in part.
    pub fn exec(
        &mut self,
        cmds: &[Cmd],
        deadline: Instant,
        readback: &dyn Fn(usize) -> Option<Cmd>,
    ) -> (Vec<Reply>, Option<RedisError>) {
        match self {
            Conn::Single(con) => exec_single(con, cmds),
            Conn::Cluster(con) => exec_cluster(con, cmds, deadline, readback),
        }
    }

    /// PING; for a cluster also `CLUSTER INFO`, which must say
    /// `cluster_state:ok` (a cluster that is not serving every slot counts
    /// as down). Returns the commands sent and the outcome.
    pub fn check(&mut self) -> (u32, redis::RedisResult<()>) {
        let ping = redis::cmd("PING");
        match self {
            Conn::Single(con) => (1, ping.query::<Value>(con).map(drop)),
            Conn::Cluster(con) => {
                if let Err(e) = ping.query::<Value>(&mut **con) {
                    return (1, Err(e));
                }
                let info = redis::cmd("CLUSTER")
                    .arg("INFO")
                    .query::<String>(&mut **con);
                match info {
                    Ok(text) if text.contains("cluster_state:ok") => (2, Ok(())),
                    Ok(_) => (
                        2,
                        Err(RedisError::from((
                            redis::ErrorKind::Server(redis::ServerErrorKind::ClusterDown),
                            "cluster_state is not ok",
                        ))),
                    ),
                    Err(e) => (2, Err(e)),
                }
            }
        }
    }
}

fn exec_single(con: &mut redis::Connection, cmds: &[Cmd]) -> (Vec<Reply>, Option<RedisError>) {
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
            *slot = Reply::Refused {
                code: e.code().to_string(),
                text: e.to_string(),
            };
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
    // Redirected commands did not run: send them again, singly (a single
    // command follows MOVED/ASK), while the deadline allows.
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
    (out, broken)
}
