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
use super::state::Backend;

/// How often a node says it counts.
pub(super) const EVERY: Duration = Duration::from_secs(2);
/// A node counts as one of the zone's while it said so this recently.
pub(super) const LIVE_MS: u64 = 10_000;

impl Backend {
    /// Says this node counts the zone, and reads how many do, when due.
    pub(super) fn say_counting(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        if !self.spec.share || now < self.fleet.due {
            return;
        }
        self.fleet.due = now + EVERY;
        if !self.ensure_conn(events) {
            return;
        }
        let key = nodes_key(&self.spec.prefix, &self.spec.name);
        let node = self.node_of(&key);
        if !self.node_may_send(node.as_deref(), now) {
            return;
        }
        let now_ms = unix_ms();
        let mut add = redis::cmd("ZADD");
        add.arg(&key).arg(now_ms).arg(&self.fleet.id);
        let mut trim = redis::cmd("ZREMRANGEBYSCORE");
        trim.arg(&key).arg("-inf").arg(format!("({}", now_ms.saturating_sub(LIVE_MS)));
        let mut count = redis::cmd("ZCARD");
        count.arg(&key);
        let mut expire = redis::cmd("PEXPIRE");
        expire.arg(&key).arg(3 * LIVE_MS);
        let cmds = [add, trim, count, expire];
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let (replies, broken) =
            conn.exec(&cmds, node.as_deref(), now + self.spec.timeout, &|_| None);
        if let Some(st) = self.stats() {
            st.pipeline(cmds.len(), now.elapsed().as_micros() as u64);
        }
        if let Some(Reply::Value(Value::Int(n))) = replies.get(2) {
            if let Some(st) = self.stats() {
                st.fleet_nodes.store((*n).max(0) as u64, std::sync::atomic::Ordering::Relaxed);
            }
        }
        match broken {
            Some(e) => self.link_failed(node.as_deref(), &e, events),
            None => self.link_ok(node.as_deref(), events),
        }
    }
}
