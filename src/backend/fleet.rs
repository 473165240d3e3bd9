//! The nodes that count a zone through its Redis, for `on_error=share`:
//! while Redis is up each node says every `EVERY` that it counts (its id
//! in a sorted set under the zone's prefix, scored by its clock) and reads
//! how many said so within `LIVE_MS`. While Redis is down a key this node
//! has no share of gets one node's part of its limit (`1/N`). N lives in
//! the zone's shared memory, so reloads and new workers keep it. One small
//! pipeline per node and zone every few seconds; no node list to
//! configure.

use std::time::{Duration, Instant};

use ratelimit_core::key::nodes_key;
use redis::Value;

use super::clock::unix_ms;
use super::event::Event;
use super::io::Reply;
use super::server::Server;

/// How often a node says it counts.
pub(super) const EVERY: Duration = Duration::from_secs(2);
/// A node counts as one of the zone's while it said so this recently.
pub(super) const LIVE_MS: u64 = 10_000;

/// What the thread knows of the zone's nodes.
pub(super) struct Fleet {
    /// When this node says it counts next.
    pub(super) due: Instant,
    /// This node: its host name and nginx master's pid (its workers are
    /// one node).
    id: String,
}

impl Fleet {
    pub(super) fn new(now: Instant) -> Fleet {
        Fleet { due: now, id: node_id() }
    }

    /// Says this node counts the zone, and reads how many do, when due.
    pub(super) fn say_counting(&mut self, server: &mut Server, events: &mut Vec<Event>) {
        let now = Instant::now();
        if !server.spec.share || now < self.due {
            return;
        }
        self.due = now + EVERY;
        if !server.ensure_conn(events) {
            return;
        }
        let key = nodes_key(&server.spec.prefix, &server.spec.name);
        let node = server.node_of(&key);
        if !server.node_may_send(node.as_deref(), now) {
            return;
        }
        let now_ms = unix_ms();
        let mut add = redis::cmd("ZADD");
        add.arg(&key).arg(now_ms).arg(&self.id);
        let mut trim = redis::cmd("ZREMRANGEBYSCORE");
        trim.arg(&key).arg("-inf").arg(format!("({}", now_ms.saturating_sub(LIVE_MS)));
        let mut count = redis::cmd("ZCARD");
        count.arg(&key);
        let mut expire = redis::cmd("PEXPIRE");
        expire.arg(&key).arg(3 * LIVE_MS);
        let cmds = [add, trim, count, expire];
        let Some((replies, broken)) = server.exec(&cmds, node.as_deref(), None, &|_| None) else {
            return;
        };
        if let Some(Reply::Value(Value::Int(n))) = replies.get(2) {
            if let Some(st) = server.stats() {
                st.fleet_nodes.store((*n).max(0) as u64, std::sync::atomic::Ordering::Relaxed);
            }
        }
        server.exchanged(node.as_deref(), broken, events);
    }
}

/// `<host name>:<pid of nginx's master>`.
fn node_id() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: writes at most `buf.len()` bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let host = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::from("unknown")
    };
    // SAFETY: getppid cannot fail.
    let master = unsafe { libc::getppid() };
    format!("{host}:{master}")
}
