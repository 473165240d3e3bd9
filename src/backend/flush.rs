//! What a flush sends for a zone's pending items (`plan`; one exchange of
//! it: `exchange.rs`), and what each reply means for an increment.
//!
//! What happens to an increment, by the reply to its `INCRBY`:
//! - a count: applied (global counts for the zone, breaker);
//! - an error reply (`WRONGTYPE`, a value that is not a number, `OOM`,
//!   `NOPERM`, `READONLY`, ...): that item alone fails; its increments stay
//!   counted on this node (`Event::KeepLocal`), the key is named in a log
//!   line (at most one a second), nothing is sent again;
//! - lost with the connection (sent, no reply): it may have run, so it is
//!   never sent again; it stays counted on this node, and its key gets an
//!   `EXPIRE` with the next exchange in case it was created;
//! - not sent (backend down or backing off, a cluster that is not serving,
//!   the stop deadline): kept, bounded in bytes, and sent once Redis
//!   answers.
//!
//! Only transport failures take the backend down.

use std::collections::HashMap;
use std::time::Instant;

use ratelimit_core::batch::{Item, ItemId};
use ratelimit_core::key::{redis_key_for_tag, write_key_for_tag};
use redis::{Cmd, Value};

use super::event::{Event, PIPELINE_ITEMS};
use super::io::Reply;
use super::state::{Backend, Prev, TtlFix};

/// Most (key, window) states remembered for reading previous windows, at
/// least; more for a larger zone, up to as many bytes as its shared memory
/// (whose size says how many keys the operator expects). Past it they are
/// all forgotten: each key's next count reads its previous window a flush
/// later than it would have.
const PREV_MAX: usize = 1 << 16;
/// What one remembered state takes: its id and `Prev` in the map's slot,
/// with the map's spare room.
const PREV_BYTES: usize = 80;

/// How long into a window the previous window's count may still grow (late
/// flushes of other workers and nodes): a tenth of the period, at most 2 s.
pub(super) fn prev_settle_ms(period: u32) -> u64 {
    (u64::from(period) * 100).min(2000)
}

/// The commands of one item, by position in the pipeline.
#[derive(Clone, Copy)]
pub(super) struct Slots {
    pub(super) cur: usize,
    pub(super) prev: Option<usize>,
    /// `cur` is a `SET NX EX` that creates a quiet counter with its TTL
    /// (`Item::fresh`), not an `INCRBY`.
    pub(super) create: bool,
}

impl Backend {
    /// Sends `items` plus what waits to be sent again, in pipelines. While
    /// the backend is down everything is kept for later, unless this is the
    /// try that brings it back (`probe`: it answered a PING).
    pub fn send(
        &mut self,
        items: Vec<(ItemId, Item)>,
        deadline: Option<Instant>,
        probe: bool,
        events: &mut Vec<Event>,
    ) {
        if !(self.health.is_up() || probe) {
            // down: what came waits with the rest, without walking all of
            // it again (taking every kept increment out and putting it back
            // at each flush of an outage would spend a worker's CPU there)
            self.keep_for_retry(&items, events);
            return;
        }
        let items = self.with_retry(items);
        for (node, group) in self.by_node(items) {
            for chunk in group.chunks(PIPELINE_ITEMS) {
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d)
                    || !(self.health.is_up() || probe)
                    || !self.node_may_send(node.as_deref(), now)
                    || !self.ensure_conn(events)
                {
                    self.keep_for_retry(chunk, events);
                    continue;
                }
                self.send_chunk(chunk, node.as_deref(), deadline, events);
            }
        }
        if self.health.is_up()
            && !self.ttl_fix.is_empty()
            && deadline.is_none_or(|d| Instant::now() < d)
        {
            self.send_ttl_fixes(events);
        }
    }

    /// The commands for `items`, and where each item's replies will be.
    /// `again`: the second try of counts a `SET NX` found made, whose
    /// previous windows were read (or not) with the first.
    pub(super) fn plan(
        &mut self,
        items: &[(ItemId, Item)],
        now_ms: u64,
        again: bool,
    ) -> (Vec<Cmd>, Vec<Slots>) {
        let mut cmds = Vec::with_capacity(items.len() * 2);
        let mut slots = Vec::with_capacity(items.len());
        if self.prev.len() > (self.spec.bytes / PREV_BYTES).max(PREV_MAX) {
            self.prev.clear();
        }
        // the counters' names, written into one buffer (each command
        // copies its arguments)
        let (mut cur_key, mut prev_key) = (Vec::with_capacity(64), Vec::with_capacity(64));
        for (id, item) in items {
            let p = u64::from(item.period);
            cur_key.clear();
            write_key_for_tag(
                &mut cur_key,
                &self.spec.prefix,
                &item.tag,
                item.period,
                id.window * p,
            );
            let cur = cmds.len();
            // a counter this node probably creates, of a key far from its
            // limit: with its TTL, in one command (not on a cluster, whose
            // partial failures hide what a command answered)
            let create = !self.set_refused
                && self.first.create(item.fresh)
                && item.far()
                && item.total() > 0
                && !self.spec.cluster;
            if create {
                let mut c = redis::cmd("SET");
                c.arg(&cur_key).arg(item.total()).arg("EX").arg(2 * p).arg("NX");
                cmds.push(c);
            } else if item.total() > 0 {
                let mut c = redis::cmd("INCRBY");
                c.arg(&cur_key).arg(item.total());
                cmds.push(c);
            } else {
                let mut c = redis::cmd("GET");
                c.arg(&cur_key);
                cmds.push(c);
            }
            // The previous window is read from a key's second flush in a
            // window (a key seen once costs one command), again once its
            // count is final, and by refreshes until then; not while a
            // quiet key's previous count is this node's own.
            let settled = now_ms >= id.window * p * 1000 + prev_settle_ms(item.period);
            let want_prev = !again
                && match self.prev.get(id) {
                    None => {
                        self.prev.insert(*id, Prev { period: item.period, ..Prev::default() });
                        item.total() == 0
                    }
                    Some(s) if s.own && item.quiet => false,
                    Some(s) => s.value.is_none() || (!s.settled && settled),
                };
            let prev = want_prev.then(|| {
                prev_key.clear();
                write_key_for_tag(
                    &mut prev_key,
                    &self.spec.prefix,
                    &item.tag,
                    item.period,
                    id.window.saturating_sub(1) * p,
                );
                let mut c = redis::cmd("GET");
                c.arg(&prev_key);
                cmds.push(c);
                cmds.len() - 1
            });
            slots.push(Slots { cur, prev, create });
        }
        (cmds, slots)
    }

    pub(super) fn send_chunk(
        &mut self,
        items: &[(ItemId, Item)],
        node: Option<&str>,
        deadline: Option<Instant>,
        events: &mut Vec<Event>,
    ) {
        self.exchange(items, node, deadline, false, events);
    }

    /// `EXPIRE 2P` for counters just created (or that may have been): a
    /// second, small pipeline, only when a key is new.
    pub(super) fn send_ttl_fixes(&mut self, events: &mut Vec<Event>) {
        if !self.ensure_conn(events) {
            return;
        }
        let mut groups: HashMap<Option<String>, Vec<(ItemId, TtlFix, Cmd)>> = HashMap::new();
        for (id, (tag, period)) in self.ttl_fix.drain().collect::<Vec<_>>() {
            let p = u64::from(period);
            let key = redis_key_for_tag(&self.spec.prefix, &tag, period, id.window * p);
            let node = self.node_of(&key);
            let mut c = redis::cmd("EXPIRE");
            c.arg(key).arg(2 * p);
            groups.entry(node).or_default().push((id, (tag, period), c));
        }
        for (node, fixes) in groups {
            let now = Instant::now();
            let may = self.node_may_send(node.as_deref(), now);
            let Some(conn) = self.conn.as_mut().filter(|_| may) else {
                for (id, fix, _) in fixes {
                    self.ttl_fix.insert(id, fix);
                }
                continue;
            };
            let cmds: Vec<Cmd> = fixes.iter().map(|(_, _, c)| c.clone()).collect();
            let (replies, broken) =
                conn.exec(&cmds, node.as_deref(), now + self.spec.timeout, &|_| None);
            if let Some(st) = self.stats() {
                st.pipeline(cmds.len(), now.elapsed().as_micros() as u64);
            }
            for ((id, fix, _), r) in fixes.into_iter().zip(replies) {
                if matches!(r, Reply::Lost | Reply::NotSent) {
                    self.ttl_fix.insert(id, fix);
                }
            }
            match broken {
                Some(e) => self.link_failed(node.as_deref(), &e, events),
                None => self.link_ok(node.as_deref(), events),
            }
        }
    }
}

pub(super) fn cmds_key(prefix: &[u8], id: &ItemId, item: &Item) -> Vec<u8> {
    let p = u64::from(item.period);
    redis_key_for_tag(prefix, &item.tag, item.period, id.window * p)
}

pub(super) fn held_note(held: u64) -> String {
    if held > 0 {
        format!(" ({held} more since the last report)")
    } else {
        String::new()
    }
}

pub(super) fn keep_local(id: ItemId, item: &Item, events: &mut Vec<Event>) {
    if item.n > 0 {
        events.push(Event::KeepLocal { id, sent: item.n });
    }
}

impl std::fmt::Display for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Reply::Value(_) => f.write_str("value"),
            Reply::Refused { text, .. } => f.write_str(text),
            Reply::Lost => f.write_str("lost"),
            Reply::NotSent => f.write_str("not sent"),
        }
    }
}

/// An `INCRBY` reply or a `GET` of a counter (`Nil`: 0); `None` for
/// anything that is not a count (a value someone else wrote there).
pub(super) fn count(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => Some((*n).max(0) as u64),
        Value::Nil => Some(0),
        Value::BulkString(b) => {
            std::str::from_utf8(b).ok()?.parse::<i64>().ok().map(|n| n.max(0) as u64)
        }
        _ => None,
    }
}
