//! What a flush sends for a zone's pending items (`plan`), one exchange of
//! it (`exchange`: its pipeline sent, each item's replies applied on their
//! own, and what is left to do once all are read, `conclude`), and what
//! each reply means for an increment.
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
use ratelimit_core::key::{redis_key_for_tag, write_key_for_tag};
use redis::{Cmd, Value};

use super::clock::unix_ms;
use super::event::{Event, PIPELINE_ITEMS};
use super::io::Reply;
use super::retry::keep_local;
use super::server::cmds_key;
use super::zone::{Backend, Prev, TtlFix, TTL_FIX_MAX};

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

/// When an exchange's replies were read, in both clocks.
#[derive(Clone, Copy)]
struct Stamp {
    at: Instant,
    ms: u64,
}

/// An exchange's replies, and when they were read.
struct Replies<'a> {
    all: &'a [Reply],
    at: Stamp,
}

/// A window's count from Redis, and its previous window's when read.
#[derive(Clone, Copy)]
struct Counts {
    cur: u64,
    prev: Option<u64>,
}

/// What an exchange leaves to do once every reply is read.
#[derive(Default)]
struct Outcome {
    /// Counters the exchange made: their TTLs are set next.
    created: Vec<(ItemId, Box<[u8]>, u32)>,
    /// Counts a `SET NX` found made already: sent again as `INCRBY`.
    existed: Vec<(ItemId, Item)>,
    /// A reply saying the cluster does not serve a key.
    cluster_down: Option<String>,
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
        if !(self.server.health.is_up() || probe) {
            // down: what came waits with the rest, without walking all of
            // it again (taking every kept increment out and putting it back
            // at each flush of an outage would spend a worker's CPU there)
            self.retry.keep(&items, &self.server, events);
            return;
        }
        let items = self.retry.with(items);
        for (node, group) in self.server.by_node(items) {
            for chunk in group.chunks(PIPELINE_ITEMS) {
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d)
                    || !(self.server.health.is_up() || probe)
                    || !self.server.node_may_send(node.as_deref(), now)
                    || !self.server.ensure_conn(events)
                {
                    self.retry.keep(chunk, &self.server, events);
                    continue;
                }
                self.exchange(chunk, node.as_deref(), deadline, false, events);
            }
        }
        if self.server.health.is_up()
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
        let spec = &self.server.spec;
        if self.prev.len() > (spec.bytes / PREV_BYTES).max(PREV_MAX) {
            self.prev.clear();
        }
        // the counters' names, written into one buffer (each command
        // copies its arguments)
        let (mut cur_key, mut prev_key) = (Vec::with_capacity(64), Vec::with_capacity(64));
        for (id, item) in items {
            let p = u64::from(item.period);
            cur_key.clear();
            write_key_for_tag(&mut cur_key, &spec.prefix, &item.tag, item.period, id.window * p);
            let cur = cmds.len();
            // a counter this node probably creates, of a key far from its
            // limit: with its TTL, in one command (not on a cluster, whose
            // partial failures hide what a command answered)
            let create = !self.set_refused
                && self.first.create(item.fresh)
                && item.far()
                && item.total() > 0
                && !spec.cluster;
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
                    &spec.prefix,
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

    /// `EXPIRE 2P` for counters just created (or that may have been): a
    /// second, small pipeline, only when a key is new.
    pub(super) fn send_ttl_fixes(&mut self, events: &mut Vec<Event>) {
        if !self.server.ensure_conn(events) {
            return;
        }
        let mut groups: HashMap<Option<String>, Vec<(ItemId, TtlFix, Cmd)>> = HashMap::new();
        for (id, (tag, period)) in self.ttl_fix.drain().collect::<Vec<_>>() {
            let p = u64::from(period);
            let key = redis_key_for_tag(&self.server.spec.prefix, &tag, period, id.window * p);
            let node = self.server.node_of(&key);
            let mut c = redis::cmd("EXPIRE");
            c.arg(key).arg(2 * p);
            groups.entry(node).or_default().push((id, (tag, period), c));
        }
        for (node, fixes) in groups {
            let cmds: Vec<Cmd> = fixes.iter().map(|(_, _, c)| c.clone()).collect();
            let sent = if self.server.node_may_send(node.as_deref(), Instant::now()) {
                self.server.exec(&cmds, node.as_deref(), None, &|_| None)
            } else {
                None
            };
            let Some((replies, broken)) = sent else {
                for (id, fix, _) in fixes {
                    self.ttl_fix.insert(id, fix);
                }
                continue;
            };
            for ((id, fix, _), r) in fixes.into_iter().zip(replies) {
                if matches!(r, Reply::Lost | Reply::NotSent) {
                    self.ttl_fix.insert(id, fix);
                }
            }
            self.server.exchanged(node.as_deref(), broken, events);
        }
    }

    /// One exchange of `items` with `node`; `again` as for `plan`. Plans the commands, sends them
    /// (`transmit`), applies each item's replies (`apply`), then ends the
    /// exchange (`conclude`).
    pub(super) fn exchange(
        &mut self,
        items: &[(ItemId, Item)],
        node: Option<&str>,
        deadline: Option<Instant>,
        again: bool,
        events: &mut Vec<Event>,
    ) {
        let now_ms = unix_ms();
        let (cmds, slots) = self.plan(items, now_ms, again);
        let Some((replies, broken, at)) = self.transmit(&cmds, items, &slots, node, deadline)
        else {
            self.retry.keep(items, &self.server, events);
            return;
        };
        let read = Replies { all: &replies, at: Stamp { at, ms: now_ms } };
        let mut out = Outcome::default();
        for (item, s) in items.iter().zip(&slots) {
            self.apply(item, s, &read, &mut out, events);
        }
        self.conclude(out, broken, node, deadline, now_ms, events);
    }

    /// Sends the commands as one pipeline (an `INCRBY` whose sibling failed
    /// in a cluster pipeline has its count read back), learns the round
    /// trip; `None` without a connection.
    fn transmit(
        &mut self,
        cmds: &[Cmd],
        items: &[(ItemId, Item)],
        slots: &[Slots],
        node: Option<&str>,
        deadline: Option<Instant>,
    ) -> Option<(Vec<Reply>, Option<redis::RedisError>, Instant)> {
        // asked only for a cluster pipeline that failed in part: the key
        // whose `INCRBY` command `i` is, found then
        let prefix = self.server.spec.prefix.clone();
        let readback = |i: usize| {
            let ((id, item), _) = items
                .iter()
                .zip(slots)
                .find(|((_, item), s)| s.cur == i && item.total() > 0 && !s.create)?;
            let mut c = redis::cmd("GET");
            c.arg(cmds_key(&prefix, id, item));
            Some(c)
        };
        self.server.exec_timed(cmds, node, deadline, &readback)
    }

    /// One item's replies: its count confirmed, or kept here, or sent
    /// again (a `SET NX` that found the counter made, a cluster that does
    /// not serve the key, a command never sent).
    fn apply(
        &mut self,
        (id, item): &(ItemId, Item),
        s: &Slots,
        read: &Replies<'_>,
        out: &mut Outcome,
        events: &mut Vec<Event>,
    ) {
        let prev = s
            .prev
            .and_then(|i| read.all.get(i))
            .and_then(|r| self.read_prev(id, item, r, read.at.ms));
        let reply = read.all.get(s.cur).unwrap_or(&Reply::NotSent);
        let first = item.fresh == Fresh::Maybe && item.total() > 0;
        if s.create {
            match reply {
                Reply::Value(Value::Okay) => {
                    // the guess held: nobody else counted this window yet;
                    // and for a key this node made the last count of
                    // alone, the previous window's count grew by this
                    // node's counts alone
                    if first {
                        self.first.learn(true);
                    } else if let Some(p) = self.prev.get_mut(id) {
                        p.own = true;
                    }
                    let cur = u64::from(item.total());
                    self.confirmed(*id, item, Counts { cur, prev }, read.at, events);
                    return;
                }
                Reply::Value(Value::Nil) => {
                    if first {
                        self.first.learn(false);
                    }
                    out.existed.push((*id, Item { fresh: Fresh::No, ..item.clone() }));
                    return;
                }
                Reply::Value(_) => {
                    let key = self.server.key_name(id, item);
                    self.server.refused(&key, "unexpected reply to SET", events);
                    keep_local(*id, item, events);
                    return;
                }
                // a user allowed INCRBY but not SET (an ACL that names the
                // counting commands without SET): the count goes as INCRBY,
                // and so do all from now on
                Reply::Refused { code, .. } if code == "NOPERM" => {
                    self.set_refused = true;
                    out.existed.push((*id, Item { fresh: Fresh::No, ..item.clone() }));
                    return;
                }
                _ => {}
            }
        }
        match reply {
            Reply::Value(v) => match count(v) {
                Some(cur) => {
                    let made = cur == u64::from(item.total());
                    if item.total() > 0 && made {
                        out.created.push((*id, item.tag.clone(), item.period));
                    }
                    if first {
                        // what a `SET NX EX` would have found
                        self.first.learn(made);
                    }
                    self.confirmed(*id, item, Counts { cur, prev }, read.at, events);
                }
                None => {
                    let key = self.server.key_name(id, item);
                    self.server.refused(&key, "not a counter", events);
                    keep_local(*id, item, events);
                }
            },
            r @ Reply::Refused { .. } if self.server.master_lost(r) => {
                out.cluster_down = Some(r.to_string());
                self.retry.keep(std::slice::from_ref(&(*id, item.clone())), &self.server, events);
            }
            Reply::Refused { text, .. } => {
                let key = self.server.key_name(id, item);
                self.server.refused(&key, text, events);
                keep_local(*id, item, events);
            }
            Reply::Lost => {
                // (a `SET NX EX` sets its TTL with the count)
                if item.total() > 0 && !s.create && self.ttl_fix.len() < TTL_FIX_MAX {
                    self.ttl_fix.insert(*id, (item.tag.clone(), item.period));
                }
                keep_local(*id, item, events);
            }
            Reply::NotSent => {
                self.retry.keep(std::slice::from_ref(&(*id, item.clone())), &self.server, events)
            }
        }
    }

    /// The end of an exchange: the link failed or not; TTLs for counters
    /// just made; counts a `SET NX` did not make go again (as `INCRBY`),
    /// whatever happens to this link.
    fn conclude(
        &mut self,
        out: Outcome,
        broken: Option<redis::RedisError>,
        node: Option<&str>,
        deadline: Option<Instant>,
        now_ms: u64,
        events: &mut Vec<Event>,
    ) {
        if let Some(e) = broken {
            self.retry.keep(&out.existed, &self.server, events);
            self.server.link_failed(node, &e, events);
            for (id, tag, period) in out.created {
                if self.ttl_fix.len() < TTL_FIX_MAX {
                    self.ttl_fix.insert(id, (tag, period));
                }
            }
            return;
        }
        if let Some(why) = out.cluster_down {
            self.retry.keep(&out.existed, &self.server, events);
            self.server.not_serving(node, why, events);
            return;
        }
        self.server.exchanged(node, None, events);
        if let Some(st) = self.server.stats() {
            st.synced(now_ms);
        }
        for (id, tag, period) in out.created {
            self.ttl_fix.insert(id, (tag, period));
        }
        if !self.ttl_fix.is_empty() {
            self.send_ttl_fixes(events);
        }
        if !out.existed.is_empty() {
            // a wrong guess costs one more exchange, with `INCRBY`s only
            self.exchange(&out.existed, node, deadline, true, events);
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

    /// Redis's counts for an item, for the worker; a key near its limit
    /// is watched for a refresh.
    fn confirmed(
        &mut self,
        id: ItemId,
        item: &Item,
        Counts { cur, prev }: Counts,
        Stamp { at: now, ms: now_ms }: Stamp,
        events: &mut Vec<Event>,
    ) {
        let prev = prev.or_else(|| self.prev.get(&id).and_then(|s| s.value));
        let confirmation =
            Confirmation { window: id.window, sent: item.n, carried: item.carried, cur, prev };
        // a key near its limit is read once more shortly after each flush
        // that counted it, within the zone's budget
        self.watches.counted(id, item, &confirmation, now, now_ms);
        events.push(Event::Confirmed { id, period: item.period, limit: item.limit, confirmation });
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
