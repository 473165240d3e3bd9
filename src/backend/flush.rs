//! What a flush sends for a zone's pending items, and how each reply is
//! read on its own.
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
use ratelimit_core::counter::{Confirmation, Fresh};
use ratelimit_core::key::redis_key_for_tag;
use redis::{Cmd, Value};

use super::clock::unix_ms;
use super::event::{Event, PIPELINE_ITEMS};
use super::io::Reply;
use super::refresh::{near_limit, refresh_due};
use super::state::{Backend, Prev, TtlFix, Watch, TTL_FIX_MAX, WATCH_MAX};

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
            self.keep_for_retry(&items);
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
                    self.keep_for_retry(chunk);
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
    fn plan(
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
        for (id, item) in items {
            let p = u64::from(item.period);
            let cur_key =
                redis_key_for_tag(&self.spec.prefix, &item.tag, item.period, id.window * p);
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
                let key = redis_key_for_tag(
                    &self.spec.prefix,
                    &item.tag,
                    item.period,
                    id.window.saturating_sub(1) * p,
                );
                let mut c = redis::cmd("GET");
                c.arg(key);
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

    /// `send_chunk`; `again` as for `plan`.
    fn exchange(
        &mut self,
        items: &[(ItemId, Item)],
        node: Option<&str>,
        deadline: Option<Instant>,
        again: bool,
        events: &mut Vec<Event>,
    ) {
        let now_ms = unix_ms();
        let (cmds, slots) = self.plan(items, now_ms, again);
        let Some(conn) = self.conn.as_mut() else {
            self.keep_for_retry(items);
            return;
        };
        let stop_at = deadline.unwrap_or_else(|| Instant::now() + self.spec.timeout);
        // an INCRBY whose sibling failed in a cluster pipeline: read its count
        let incr_at: HashMap<usize, Vec<u8>> = items
            .iter()
            .zip(&slots)
            .filter(|((_, item), s)| item.total() > 0 && !s.create)
            .map(|((id, item), s)| (s.cur, cmds_key(&self.spec.prefix, id, item)))
            .collect();
        let readback = |i: usize| {
            incr_at.get(&i).map(|k| {
                let mut c = redis::cmd("GET");
                c.arg(k);
                c
            })
        };
        let sent_at = Instant::now();
        let (replies, broken) = conn.exec(&cmds, node, stop_at, &readback);
        let now = Instant::now();
        let rtt_us = now.saturating_duration_since(sent_at).as_micros() as u64;
        // slow to rise, quick to fall: a stall is what the worker must
        // notice (`Channel::stale_ms`), not part of the round trip
        self.rtt_us = match self.rtt_us {
            0 => rtt_us,
            old if rtt_us > old => old + (rtt_us - old) / 16,
            old => (old + rtt_us) / 2,
        };
        if let Some(st) = self.stats() {
            st.pipeline(cmds.len(), rtt_us);
        }
        let mut created: Vec<(ItemId, Box<[u8]>, u32)> = Vec::new();
        let mut cluster_down = None;
        // counters a `SET NX` found already there: an `INCRBY` after all
        let mut existed: Vec<(ItemId, Item)> = Vec::new();
        for ((id, item), s) in items.iter().zip(&slots) {
            let prev = s
                .prev
                .and_then(|i| replies.get(i))
                .and_then(|r| self.read_prev(id, item, r, now_ms));
            let reply = replies.get(s.cur).unwrap_or(&Reply::NotSent);
            let first = item.fresh == Fresh::Maybe && item.total() > 0;
            if s.create {
                match reply {
                    Reply::Value(Value::Okay) => {
                        // the guess held: nobody else counted this window
                        // yet; and for a key this node made the last count
                        // of alone, the previous window's count grew by
                        // this node's counts alone
                        if first {
                            self.first.learn(true);
                        } else if let Some(p) = self.prev.get_mut(id) {
                            p.own = true;
                        }
                        let cur = u64::from(item.total());
                        self.confirmed(*id, item, cur, prev, now, now_ms, events);
                        continue;
                    }
                    Reply::Value(Value::Nil) => {
                        if first {
                            self.first.learn(false);
                        }
                        existed.push((*id, Item { fresh: Fresh::No, ..item.clone() }));
                        continue;
                    }
                    Reply::Value(_) => {
                        let key = self.key_name(id, item);
                        self.refused(&key, "unexpected reply to SET", events);
                        keep_local(*id, item, events);
                        continue;
                    }
                    // a user allowed INCRBY but not SET (an ACL written for
                    // the counting commands of older versions): the count
                    // goes as INCRBY, and so do all from now on
                    Reply::Refused { code, .. } if code == "NOPERM" => {
                        self.set_refused = true;
                        existed.push((*id, Item { fresh: Fresh::No, ..item.clone() }));
                        continue;
                    }
                    _ => {}
                }
            }
            match reply {
                Reply::Value(v) => match count(v) {
                    Some(cur) => {
                        let made = cur == u64::from(item.total());
                        if item.total() > 0 && made {
                            created.push((*id, item.tag.clone(), item.period));
                        }
                        if first {
                            // what a `SET NX EX` would have found
                            self.first.learn(made);
                        }
                        self.confirmed(*id, item, cur, prev, now, now_ms, events);
                    }
                    None => {
                        let key = self.key_name(id, item);
                        self.refused(&key, "not a counter", events);
                        keep_local(*id, item, events);
                    }
                },
                r @ Reply::Refused { .. } if self.master_lost(r) => {
                    cluster_down = Some(r.to_string());
                    self.keep_for_retry(std::slice::from_ref(&(*id, item.clone())));
                }
                Reply::Refused { text, .. } => {
                    let key = self.key_name(id, item);
                    self.refused(&key, text, events);
                    keep_local(*id, item, events);
                }
                Reply::Lost => {
                    // (a `SET NX EX` sets its TTL with the count)
                    if item.total() > 0 && !s.create && self.ttl_fix.len() < TTL_FIX_MAX {
                        self.ttl_fix.insert(*id, (item.tag.clone(), item.period));
                    }
                    keep_local(*id, item, events);
                }
                Reply::NotSent => self.keep_for_retry(std::slice::from_ref(&(*id, item.clone()))),
            }
        }
        // what a `SET NX` did not count goes again (as `INCRBY`), whatever
        // happens to this link
        if let Some(e) = broken {
            self.keep_for_retry(&existed);
            self.link_failed(node, &e, events);
            for (id, tag, period) in created {
                if self.ttl_fix.len() < TTL_FIX_MAX {
                    self.ttl_fix.insert(id, (tag, period));
                }
            }
            return;
        }
        if let Some(why) = cluster_down {
            self.keep_for_retry(&existed);
            let e = redis::RedisError::from((redis::ErrorKind::Io, self.not_serving(), why));
            self.link_failed(node, &e, events);
            return;
        }
        self.link_ok(node, events);
        if let Some(st) = self.stats() {
            st.synced(now_ms);
        }
        for (id, tag, period) in created {
            self.ttl_fix.insert(id, (tag, period));
        }
        if !self.ttl_fix.is_empty() {
            self.send_ttl_fixes(events);
        }
        if !existed.is_empty() {
            // a wrong guess costs one more exchange, with `INCRBY`s only
            self.exchange(&existed, node, deadline, true, events);
        }
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

    /// The count a previous-window `GET` read, if it is one.
    fn read_prev(&mut self, id: &ItemId, item: &Item, r: &Reply, now_ms: u64) -> Option<u64> {
        let Reply::Value(v) = r else {
            return None;
        };
        let value = count(v)?;
        let p = u64::from(item.period);
        let settled = now_ms >= id.window * p * 1000 + prev_settle_ms(item.period);
        self.prev
            .insert(*id, Prev { period: item.period, value: Some(value), settled, own: false });
        Some(value)
    }

    #[allow(clippy::too_many_arguments)]
    fn confirmed(
        &mut self,
        id: ItemId,
        item: &Item,
        cur: u64,
        prev: Option<u64>,
        now: Instant,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) {
        let prev = prev.or_else(|| self.prev.get(&id).and_then(|s| s.value));
        let confirmation =
            Confirmation { window: id.window, sent: item.n, carried: item.carried, cur, prev };
        // A key near its limit is read once more shortly after each flush
        // that counted it: a refresh per allowed flush at most, within the
        // zone's budget.
        let mut wid = id;
        wid.window = 0;
        if item.total() > 0 && near_limit(&confirmation, item.period, item.limit, now_ms) {
            if let Some(w) = self.watch.get_mut(&wid) {
                w.due = Some(refresh_due(now, Some(now.saturating_duration_since(w.last))));
                w.last = now;
                w.window = id.window;
                w.limit = item.limit;
            } else if self.watch.len() < WATCH_MAX {
                self.watch.insert(
                    wid,
                    Watch {
                        tag: item.tag.clone(),
                        period: item.period,
                        limit: item.limit,
                        window: id.window,
                        last: now,
                        due: Some(refresh_due(now, None)),
                    },
                );
            }
        }
        events.push(Event::Confirmed { id, period: item.period, limit: item.limit, confirmation });
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
