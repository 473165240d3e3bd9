//! One zone's backend in the thread: what it sends for the pending items,
//! how it reads each reply on its own, and its health, retries, refreshes
//! and log lines.
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
use std::time::{Duration, Instant};

use redis::{Cmd, IntoConnectionInfo, Value};

use super::health::{Budget, Health, LogGate};
use super::io::{self, Conn, Reply};
use super::{Event, Level, ZoneSpec};
use crate::batch::{Delete, Item, ItemId};
use crate::counter::Confirmation;
use crate::key::{redis_key_for_tag, show_key};
use crate::params::redact;

/// Items per pipeline.
const PIPELINE_ITEMS: usize = 1024;
/// Bytes the increments kept for sending again may hold, per zone and
/// worker (beyond it they are dropped, and stay counted on this node).
pub const RETRY_BYTES: usize = 4 << 20;
/// A key near its limit is read again this long after its last flush, once
/// per flush, so a node learns what the others counted.
pub const REFRESH_AFTER: Duration = Duration::from_millis(10);
/// Redis commands per second the refreshes of one zone may spend, per
/// worker, whatever the keys.
pub const REFRESH_BUDGET: u32 = 200;
/// Most keys waiting for a refresh, per zone and worker.
const WATCH_MAX: usize = 4096;
/// Most keys whose TTL is still to be set again after a lost reply.
const TTL_FIX_MAX: usize = 4096;
/// Most (key, window) states remembered for reading previous windows.
const PREV_MAX: usize = 1 << 16;
const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// How long into a window the previous window's count may still grow (late
/// flushes of other workers and nodes): a tenth of the period, at most 2 s.
fn prev_settle_ms(period: u32) -> u64 {
    (u64::from(period) * 100).min(2000)
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// What this worker knows of a key's previous window, per current window.
#[derive(Clone, Copy, Debug, Default)]
struct Prev {
    period: u32,
    /// The last count read, if any.
    value: Option<u64>,
    /// Read after the settle time: it will not change any more.
    settled: bool,
}

/// A key near its limit that this worker counts: read again once after
/// each flush that counted it, shortly before its next request is expected
/// (three quarters of the gap between its last two flushes, at least
/// `REFRESH_AFTER`), so that the next decision sees what the other nodes
/// counted meanwhile. At most one refresh per counted flush, within the
/// zone's budget.
struct Watch {
    tag: Box<[u8]>,
    period: u32,
    limit: u32,
    window: u64,
    /// The last flush that counted the key.
    last: Instant,
    /// When to read it again, if a refresh is owed.
    due: Option<Instant>,
}

/// Forgotten after this long without a counted flush.
const WATCH_IDLE: Duration = Duration::from_secs(10);

/// When a key flushed now, after `gap` since its previous flush, is read
/// again.
fn refresh_due(now: Instant, gap: Option<Duration>) -> Instant {
    let wait = gap.map_or(REFRESH_AFTER, |g| {
        (g * 3 / 4).clamp(REFRESH_AFTER, WATCH_IDLE)
    });
    now + wait
}

/// A counter whose TTL is to be set (again): its tag and period.
type TtlFix = (Box<[u8]>, u32);

/// The commands of one item, by position in the pipeline.
#[derive(Clone, Copy)]
struct Slots {
    cur: usize,
    prev: Option<usize>,
}

pub struct Backend {
    pub(super) spec: ZoneSpec,
    pub(super) conn: Option<Conn>,
    pub(super) health: Health,
    pub(super) errors: LogGate,
    refusals: LogGate,
    secrets: Vec<String>,
    /// Increments known not to have run, sent with the next flush.
    pub(super) retry: HashMap<ItemId, Item>,
    retry_bytes: usize,
    /// Keys near their limit, to be read again (by entry, window 0).
    watch: HashMap<ItemId, Watch>,
    budget: Budget,
    /// Counters whose `INCRBY` may have created them without an `EXPIRE`
    /// (reply lost): `EXPIRE` sent with the next exchange.
    ttl_fix: HashMap<ItemId, TtlFix>,
    prev: HashMap<ItemId, Prev>,
    /// When `prev` was last rid of windows that are over.
    swept: Instant,
    /// Sending what waited, as the try of a down backend.
    pub(super) probing: bool,
    /// Cluster: a copy of the slot map, and when it was read.
    pub(super) topo: Option<super::slots::Topology>,
    pub(super) topo_at: Option<Instant>,
    /// Cluster: masters that failed, each with its own backoff (the keys of
    /// their slots wait, the others go on).
    pub(super) nodes: HashMap<String, Health>,
}

impl Backend {
    pub fn new(spec: ZoneSpec, now: Instant) -> Backend {
        let mut secrets: Vec<String> = Vec::new();
        for u in &spec.urls {
            if let Ok(ci) = u.as_str().into_connection_info() {
                if let Some(p) = ci.redis_settings().password() {
                    secrets.push(p.to_string());
                }
            }
            // the password as written (percent-encoded), too
            if let Some(raw) = crate::params::url_password(u) {
                secrets.push(raw.to_string());
            }
        }
        secrets.retain(|s| !s.is_empty());
        Backend {
            spec,
            conn: None,
            health: Health::new(now),
            errors: LogGate::new(LOG_INTERVAL),
            refusals: LogGate::new(LOG_INTERVAL),
            secrets,
            retry: HashMap::new(),
            retry_bytes: 0,
            watch: HashMap::new(),
            budget: Budget::new(REFRESH_BUDGET, now),
            ttl_fix: HashMap::new(),
            prev: HashMap::new(),
            swept: now,
            probing: false,
            topo: None,
            topo_at: None,
            nodes: HashMap::new(),
        }
    }

    pub fn zone(&self) -> u32 {
        self.spec.index
    }

    /// Whether the backend works: its connection, and every master of a
    /// cluster.
    pub fn is_up(&self) -> bool {
        self.health.is_up() && self.nodes.is_empty()
    }

    /// When the thread must wake for this backend, with nothing queued.
    pub fn next_wake(&self, now: Instant) -> Instant {
        let mut next = self.health.next_check();
        if self.health.is_up() {
            if !self.ttl_fix.is_empty() || !self.retry.is_empty() && self.nodes.is_empty() {
                next = now;
            }
            if let Some(t) = self.nodes.values().map(Health::next_check).min() {
                next = next.min(t);
            }
            if let Some(due) = self.watch.values().filter_map(|w| w.due).min() {
                next = next.min(due);
            }
        }
        next
    }

    /// The periodic work: try a down backend once its backoff is over (with
    /// what it holds, or PING), check an idle one, send what waits, refresh.
    pub fn tick(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        if !self.health.is_up() {
            if !self.health.may_send(now) {
                return;
            }
            // A PING first: a backend that still hangs or refuses costs a
            // PING per backoff, and what waits is sent only once it
            // answers (what a timed-out pipeline carried is lost to Redis,
            // never sent twice). Up again once what waits went through.
            if !self.check(events) {
                return;
            }
            if self.retry.is_empty() {
                self.succeeded(events);
            } else {
                self.probing = true;
                self.send(Vec::new(), None, events);
                self.probing = false;
            }
            return;
        }
        self.probe_nodes(events);
        if !self.retry.is_empty() {
            self.send(Vec::new(), None, events);
        } else if !self.ttl_fix.is_empty() {
            self.send_ttl_fixes(events);
        } else if self.health.check_due(now) {
            self.check(events);
        }
        if now.saturating_duration_since(self.swept) >= Duration::from_secs(1) {
            self.swept = now;
            let now_ms = unix_ms();
            self.prev.retain(|id, s| {
                let current = crate::window::window_index(now_ms, u64::from(s.period) * 1000);
                id.window + 1 >= current
            });
        }
        if self.health.is_up() {
            self.refresh(events);
        }
    }

    /// PING (and `CLUSTER INFO` for a cluster). An up backend that answers
    /// has its idle timer reset; a down one stays down until what it holds
    /// went through (`tick`).
    fn check(&mut self, events: &mut Vec<Event>) -> bool {
        if !self.ensure_conn(events) {
            return false;
        }
        if self.spec.cluster {
            let ok = self.check_cluster(events);
            if ok && self.health.is_up() {
                self.succeeded(events);
            }
            return ok;
        }
        let Some(conn) = self.conn.as_mut() else {
            return false;
        };
        match conn.check().1 {
            Ok(()) => {
                if self.health.is_up() {
                    self.succeeded(events);
                }
                true
            }
            Err(e) => {
                self.transport_failed("sending to", &e, events);
                false
            }
        }
    }

    /// Sends `items` plus what waits to be sent again, in pipelines. While
    /// the backend is down and backing off, everything is kept for later.
    pub fn send(
        &mut self,
        items: Vec<(ItemId, Item)>,
        deadline: Option<Instant>,
        events: &mut Vec<Event>,
    ) {
        let items = self.with_retry(items);
        for (node, group) in self.by_node(items) {
            for chunk in group.chunks(PIPELINE_ITEMS) {
                let now = Instant::now();
                if deadline.is_some_and(|d| now >= d)
                    || !(self.health.is_up() || self.probing)
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
    fn plan(&mut self, items: &[(ItemId, Item)], now_ms: u64) -> (Vec<Cmd>, Vec<Slots>) {
        let mut cmds = Vec::with_capacity(items.len() * 2);
        let mut slots = Vec::with_capacity(items.len());
        if self.prev.len() > PREV_MAX {
            self.prev.clear();
        }
        for (id, item) in items {
            let p = u64::from(item.period);
            let cur_key =
                redis_key_for_tag(&self.spec.prefix, &item.tag, item.period, id.window * p);
            let cur = cmds.len();
            if item.n > 0 {
                let mut c = redis::cmd("INCRBY");
                c.arg(&cur_key).arg(item.n);
                cmds.push(c);
            } else {
                let mut c = redis::cmd("GET");
                c.arg(&cur_key);
                cmds.push(c);
            }
            // The previous window is read from a key's second flush in a
            // window (a key seen once costs one command), again once its
            // count is final, and by refreshes until then.
            let settled = now_ms >= id.window * p * 1000 + prev_settle_ms(item.period);
            let want_prev = match self.prev.get(id) {
                None => {
                    self.prev.insert(
                        *id,
                        Prev {
                            period: item.period,
                            ..Prev::default()
                        },
                    );
                    item.n == 0
                }
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
            slots.push(Slots { cur, prev });
        }
        (cmds, slots)
    }

    fn send_chunk(
        &mut self,
        items: &[(ItemId, Item)],
        node: Option<&str>,
        deadline: Option<Instant>,
        events: &mut Vec<Event>,
    ) {
        let now_ms = unix_ms();
        let (cmds, slots) = self.plan(items, now_ms);
        let Some(conn) = self.conn.as_mut() else {
            self.keep_for_retry(items);
            return;
        };
        let stop_at = deadline.unwrap_or_else(|| Instant::now() + self.spec.timeout);
        // an INCRBY whose sibling failed in a cluster pipeline: read its count
        let incr_at: HashMap<usize, Vec<u8>> = items
            .iter()
            .zip(&slots)
            .filter(|((_, item), _)| item.n > 0)
            .map(|((id, item), s)| (s.cur, cmds_key(&self.spec.prefix, id, item)))
            .collect();
        let readback = |i: usize| {
            incr_at.get(&i).map(|k| {
                let mut c = redis::cmd("GET");
                c.arg(k);
                c
            })
        };
        let (replies, broken) = conn.exec(&cmds, node, stop_at, &readback);
        let now = Instant::now();
        let mut created: Vec<(ItemId, Box<[u8]>, u32)> = Vec::new();
        let mut cluster_down = None;
        for ((id, item), s) in items.iter().zip(&slots) {
            let prev = s
                .prev
                .and_then(|i| replies.get(i))
                .and_then(|r| self.read_prev(id, item, r, now_ms));
            match replies.get(s.cur).unwrap_or(&Reply::NotSent) {
                Reply::Value(v) => match count(v) {
                    Some(cur) => {
                        if item.n > 0 && cur == u64::from(item.n) {
                            created.push((*id, item.tag.clone(), item.period));
                        }
                        self.confirmed(*id, item, cur, prev, now, now_ms, events);
                    }
                    None => {
                        let key = self.key_name(id, item);
                        self.refused(&key, "not a counter", events);
                        keep_local(*id, item, events);
                    }
                },
                r @ Reply::Refused { .. } if r.is_cluster_down() => {
                    cluster_down = Some(r.to_string());
                    self.keep_for_retry(std::slice::from_ref(&(*id, item.clone())));
                }
                Reply::Refused { text, .. } => {
                    let key = self.key_name(id, item);
                    self.refused(&key, text, events);
                    keep_local(*id, item, events);
                }
                Reply::Lost => {
                    if item.n > 0 && self.ttl_fix.len() < TTL_FIX_MAX {
                        self.ttl_fix.insert(*id, (item.tag.clone(), item.period));
                    }
                    keep_local(*id, item, events);
                }
                Reply::NotSent => self.keep_for_retry(std::slice::from_ref(&(*id, item.clone()))),
            }
        }
        if let Some(e) = broken {
            self.link_failed(node, &e, events);
            for (id, tag, period) in created {
                if self.ttl_fix.len() < TTL_FIX_MAX {
                    self.ttl_fix.insert(id, (tag, period));
                }
            }
            return;
        }
        if let Some(why) = cluster_down {
            let e = redis::RedisError::from((redis::ErrorKind::Io, "cluster not serving", why));
            self.link_failed(node, &e, events);
            return;
        }
        self.link_ok(node, events);
        for (id, tag, period) in created {
            self.ttl_fix.insert(id, (tag, period));
        }
        if !self.ttl_fix.is_empty() {
            self.send_ttl_fixes(events);
        }
    }

    /// `EXPIRE 2P` for counters just created (or that may have been): a
    /// second, small pipeline, only when a key is new.
    fn send_ttl_fixes(&mut self, events: &mut Vec<Event>) {
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
        self.prev.insert(
            *id,
            Prev {
                period: item.period,
                value: Some(value),
                settled,
            },
        );
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
        let confirmation = Confirmation {
            window: id.window,
            sent: item.n,
            cur,
            prev,
        };
        // A key near its limit is read once more shortly after each flush
        // that counted it: a refresh per allowed flush at most, within the
        // zone's budget.
        let mut wid = id;
        wid.window = 0;
        if item.n > 0 && near_limit(&confirmation, item.period, item.limit, now_ms) {
            if let Some(w) = self.watch.get_mut(&wid) {
                w.due = Some(refresh_due(
                    now,
                    Some(now.saturating_duration_since(w.last)),
                ));
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
        events.push(Event::Confirmed {
            id,
            period: item.period,
            limit: item.limit,
            confirmation,
        });
    }

    /// Reads the keys whose refresh is due (once each), within the budget.
    fn refresh(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        self.watch
            .retain(|_, w| w.due.is_some() || now.saturating_duration_since(w.last) < WATCH_IDLE);
        let mut items = Vec::new();
        for (wid, w) in self.watch.iter_mut() {
            if w.due.is_none_or(|d| d > now) {
                continue;
            }
            w.due = None;
            let mut id = *wid;
            id.window = w.window;
            let cost = if self.prev.get(&id).is_some_and(|s| s.settled) {
                1
            } else {
                2
            };
            if !self.budget.take(cost, now) {
                continue;
            }
            items.push((
                id,
                Item {
                    tag: w.tag.clone(),
                    period: w.period,
                    limit: w.limit,
                    n: 0,
                },
            ));
        }
        for chunk in items.chunks(PIPELINE_ITEMS) {
            if !self.health.is_up() {
                break;
            }
            self.send_chunk(chunk, None, None, events);
        }
    }

    /// Deletes both windows of a key (Lua's `reset`). Best effort.
    pub fn delete(&mut self, d: &Delete, events: &mut Vec<Event>) {
        // counted before the reset: forget them too
        let mut freed = 0;
        self.retry.retain(|id, item| {
            let keep = id.entry != d.entry;
            if !keep {
                freed += item.bytes();
            }
            keep
        });
        self.retry_bytes -= freed;
        self.prev.retain(|id, _| id.entry != d.entry);
        self.watch.retain(|id, _| id.entry != d.entry);
        self.ttl_fix.retain(|id, _| id.entry != d.entry);
        if !self.health.is_up() || !self.ensure_conn(events) {
            return;
        }
        let p = u64::from(d.period);
        let node = self.node_of(&redis_key_for_tag(
            &self.spec.prefix,
            &d.tag,
            d.period,
            d.window * p,
        ));
        let cmds: Vec<Cmd> = [d.window, d.window.saturating_sub(1)]
            .iter()
            .map(|w| {
                let mut c = redis::cmd("DEL");
                c.arg(redis_key_for_tag(
                    &self.spec.prefix,
                    &d.tag,
                    d.period,
                    w * p,
                ));
                c
            })
            .collect();
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let deadline = Instant::now() + self.spec.timeout;
        match conn.exec(&cmds, node.as_deref(), deadline, &|_| None).1 {
            Some(e) => self.link_failed(node.as_deref(), &e, events),
            None => self.link_ok(node.as_deref(), events),
        }
    }

    /// Keeps increments known not to have run for the next flush (bounded
    /// in bytes; beyond it they stay counted on this node only).
    pub(super) fn keep_for_retry(&mut self, items: &[(ItemId, Item)]) {
        for (id, item) in items.iter().filter(|(_, i)| i.n > 0) {
            if let Some(r) = self.retry.get_mut(id) {
                r.n = r.n.saturating_add(item.n);
                r.limit = r.limit.min(item.limit);
            } else if self.retry_bytes + item.bytes() <= RETRY_BYTES {
                self.retry_bytes += item.bytes();
                self.retry.insert(*id, item.clone());
            }
        }
    }

    /// New items plus those waiting to be sent again (merged per key and
    /// window); increments for windows that no longer matter are dropped.
    fn with_retry(&mut self, items: Vec<(ItemId, Item)>) -> Vec<(ItemId, Item)> {
        if self.retry.is_empty() {
            return items;
        }
        let now_ms = unix_ms();
        self.retry_bytes = 0;
        let mut merged: HashMap<ItemId, Item> = self
            .retry
            .drain()
            .filter(|(id, item)| {
                let current = crate::window::window_index(now_ms, u64::from(item.period) * 1000);
                id.window + 1 >= current
            })
            .collect();
        for (id, item) in items {
            match merged.get_mut(&id) {
                Some(m) => {
                    m.n = m.n.saturating_add(item.n);
                    m.limit = m.limit.min(item.limit);
                }
                None => {
                    merged.insert(id, item);
                }
            }
        }
        merged.into_iter().collect()
    }

    pub(super) fn ensure_conn(&mut self, events: &mut Vec<Event>) -> bool {
        if self.conn.is_some() {
            return true;
        }
        match io::connect(&self.spec.urls, self.spec.cluster, self.spec.timeout) {
            Ok(c) => {
                self.conn = Some(c);
                true
            }
            Err(e) => {
                self.transport_failed("connecting to", &e, events);
                false
            }
        }
    }

    pub(super) fn succeeded(&mut self, events: &mut Vec<Event>) {
        if self.health.succeeded(Instant::now()) {
            events.push(Event::Log {
                zone: self.spec.index,
                level: Level::Notice,
                message: format!(
                    "redis_ratelimit: zone \"{}\": Redis {} is reachable again",
                    self.spec.name,
                    self.describe()
                ),
            });
        }
    }

    /// A transport failure: the connection is dropped and the backend is
    /// down until a try after its backoff works.
    pub(super) fn transport_failed(
        &mut self,
        what: &str,
        err: &redis::RedisError,
        events: &mut Vec<Event>,
    ) {
        self.conn = None;
        let first = self.health.failed(Instant::now());
        let text = format!(
            "redis_ratelimit: zone \"{}\": {} {} failed: {}",
            self.spec.name,
            what,
            self.describe(),
            err
        );
        self.log_error(false, first, text, events);
    }

    /// An error line through its gate (`refusal`: the one for error
    /// replies, else the one for transport failures; `force`: the first of
    /// an outage), with the count of lines held back and no secret in it.
    pub(super) fn log_error(
        &mut self,
        refusal: bool,
        force: bool,
        text: String,
        events: &mut Vec<Event>,
    ) {
        let gate = if refusal {
            &mut self.refusals
        } else {
            &mut self.errors
        };
        if let Some(held) = gate.pass(Instant::now(), force) {
            let message = self.scrub(format!("{text}{}", held_note(held)));
            events.push(Event::Log {
                zone: self.spec.index,
                level: Level::Error,
                message,
            });
        }
    }

    /// An error reply for one key: logged (at most once a second, key
    /// named), the backend stays up.
    fn refused(&mut self, key: &[u8], why: &str, events: &mut Vec<Event>) {
        let text = format!(
            "redis_ratelimit: zone \"{}\": Redis refused the counter \"{}\": {}; counted on this node only",
            self.spec.name,
            show_key(key),
            why
        );
        self.log_error(true, false, text, events);
    }

    fn key_name(&self, id: &ItemId, item: &Item) -> Vec<u8> {
        cmds_key(&self.spec.prefix, id, item)
    }

    pub(super) fn describe(&self) -> String {
        self.spec
            .urls
            .iter()
            .map(|u| redact(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    pub(super) fn scrub(&self, mut text: String) -> String {
        for s in &self.secrets {
            text = text.replace(s.as_str(), "***");
        }
        text
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

fn keep_local(id: ItemId, item: &Item, events: &mut Vec<Event>) {
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
fn count(v: &Value) -> Option<u64> {
    match v {
        Value::Int(n) => Some((*n).max(0) as u64),
        Value::Nil => Some(0),
        Value::BulkString(b) => std::str::from_utf8(b)
            .ok()?
            .parse::<i64>()
            .ok()
            .map(|n| n.max(0) as u64),
        _ => None,
    }
}

/// Whether counts put a key at or above half its limit.
fn near_limit(c: &Confirmation, period: u32, limit: u32, now_ms: u64) -> bool {
    let p = u64::from(period) * 1000;
    let idx = crate::window::window_index(now_ms, p);
    let prev = c.prev.unwrap_or(0);
    let (prev, cur) = if idx == c.window {
        (prev, c.cur)
    } else if idx == c.window + 1 {
        (c.cur, 0)
    } else {
        return false;
    };
    let clamp = |v: u64| v.min(u64::from(u32::MAX)) as u32;
    let est =
        crate::window::Estimate::new(clamp(prev), clamp(cur), now_ms.saturating_sub(idx * p), p);
    !est.below(limit.div_ceil(2))
}
