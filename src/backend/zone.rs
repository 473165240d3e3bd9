//! One zone's backend in the thread: its state (connection, health,
//! increments to send again, log gates), the periodic work (idle checks,
//! tries of a down backend), and its log lines. What a flush sends and how
//! each reply is read is in `flush.rs`; refreshes of keys near their limit
//! in `refresh.rs`; the masters of a cluster in `cluster.rs`.

use std::time::{Duration, Instant};

use ratelimit_core::batch::{Delete, Item, ItemId, ItemMap};
use ratelimit_core::health::Health;
use ratelimit_core::key::{redis_key_for_tag, show_key};
use ratelimit_core::params::redact;
use ratelimit_core::stats::Stats;
use redis::Cmd;

use super::clock::unix_ms;
use super::event::{Event, Level};
use super::flush::{cmds_key, held_note, keep_local};
use super::io::{self, Conn};
use super::state::{Backend, RETRY_BYTES};

/// The name a thread's own connection gives itself (`CLIENT SETNAME`): the
/// node's sender's, or a worker's that sent its own strict calls or resets.
pub const SENDER_NAME: &str = "ngx_redis_ratelimit";

impl Backend {
    /// When the thread must wake for this backend, with nothing queued.
    pub fn next_wake(&self, now: Instant) -> Instant {
        let sends = self.sends();
        // a thread that does not send checks no idle backend, and what
        // waits for room in the ring goes again soon
        let mut next = if sends || !self.health.is_up() {
            self.health.next_check()
        } else {
            now + Duration::from_millis(ratelimit_core::ring::RENEW_MS)
        };
        if self.health.is_up() {
            if !self.ttl_fix.is_empty() || !self.retry.is_empty() && self.nodes.is_empty() {
                next =
                    if sends || self.retry.is_empty() { now } else { now + super::FORWARD_EVERY };
            }
            if let Some(t) = self.nodes.values().map(Health::next_check).min() {
                next = next.min(t);
            }
            if let Some(due) = self.watch.values().filter_map(|w| w.due).min() {
                next = next.min(due);
            }
            if let Some(due) = self.link_due() {
                next = next.min(due);
            }
            if self.spec.share && sends {
                next = next.min(self.fleet.due);
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
                self.send(Vec::new(), None, true, events);
            }
            return;
        }
        self.probe_nodes(events);
        if !self.retry.is_empty() {
            if self.sends() {
                self.send(Vec::new(), None, false, events);
            } else {
                self.forward(Vec::new(), events);
            }
        } else if !self.ttl_fix.is_empty() {
            self.send_ttl_fixes(events);
        } else if self.sends() && self.health.check_due(now) {
            // (the idle check is the sender's: one PING per node)
            self.check(events);
        }
        if now.saturating_duration_since(self.swept) >= Duration::from_secs(1) {
            self.swept = now;
            let now_ms = unix_ms();
            self.prev.retain(|id, s| {
                let current =
                    ratelimit_core::window::window_index(now_ms, u64::from(s.period) * 1000);
                id.window + 1 >= current
            });
        }
        if self.health.is_up() {
            self.refresh(events);
            if self.sends() {
                self.say_counting(events);
            }
        }
    }

    /// A check now, for an up backend (a worker's strict link broke).
    pub fn check_now(&mut self, events: &mut Vec<Event>) {
        if self.health.is_up() {
            self.check(events);
        }
    }

    /// A worker's strict link got no answer within `timeout=`: the backend
    /// is down, as after a read timeout of the thread's own.
    pub fn link_timed_out(&mut self, events: &mut Vec<Event>) {
        if self.health.is_up() {
            let e = redis::RedisError::from((
                redis::ErrorKind::Io,
                "no answer within timeout= on a strict link",
            ));
            self.transport_failed("sending to", &e, events);
        }
    }

    /// PING (and `CLUSTER INFO` for a cluster). An up backend that answers
    /// has its idle timer reset; a down one stays down until what it holds
    /// went through (`tick`).
    fn check(&mut self, events: &mut Vec<Event>) -> bool {
        if !self.ensure_conn(events) {
            return false;
        }
        let sent_at = Instant::now();
        let ok = if self.spec.cluster {
            self.check_cluster(events)
        } else {
            match self.conn.as_mut().map(Conn::check) {
                Some(r) => self.checked(r, events),
                None => false,
            }
        };
        if let Some(st) = self.stats() {
            st.pipeline(1, sent_at.elapsed().as_micros() as u64);
        }
        if ok && self.health.is_up() {
            self.succeeded(events);
        }
        ok
    }

    /// The outcome of a check: a failure takes the backend down.
    pub(super) fn checked(&mut self, r: redis::RedisResult<()>, events: &mut Vec<Event>) -> bool {
        match r {
            Ok(()) => true,
            Err(e) => {
                self.transport_failed("sending to", &e, events);
                false
            }
        }
    }

    /// Deletes both windows of a key (Lua's `reset`), unless a worker's
    /// strict link did (`Delete::command`). Best effort.
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
        if !d.command || !self.health.is_up() || !self.ensure_conn(events) {
            return;
        }
        let p = u64::from(d.period);
        let node =
            self.node_of(&redis_key_for_tag(&self.spec.prefix, &d.tag, d.period, d.window * p));
        let cmds: Vec<Cmd> = [d.window, d.window.saturating_sub(1)]
            .iter()
            .map(|w| {
                let mut c = redis::cmd("DEL");
                c.arg(redis_key_for_tag(&self.spec.prefix, &d.tag, d.period, w * p));
                c
            })
            .collect();
        let Some(conn) = self.conn.as_mut() else {
            return;
        };
        let sent_at = Instant::now();
        let broken = conn.exec(&cmds, node.as_deref(), sent_at + self.spec.timeout, &|_| None).1;
        if let Some(st) = self.stats() {
            st.pipeline(cmds.len(), sent_at.elapsed().as_micros() as u64);
        }
        match broken {
            Some(e) => self.link_failed(node.as_deref(), &e, events),
            None => self.link_ok(node.as_deref(), events),
        }
    }

    /// Keeps increments known not to have run for the next flush (bounded
    /// in bytes; beyond it they stay counted on this node only, as
    /// dropped).
    pub(super) fn keep_for_retry(&mut self, items: &[(ItemId, Item)], events: &mut Vec<Event>) {
        for (id, item) in items.iter().filter(|(_, i)| i.total() > 0) {
            if let Some(r) = self.retry.get_mut(id) {
                r.n = r.n.saturating_add(item.n);
                r.carried = r.carried.saturating_add(item.carried);
                r.limit = r.limit.min(item.limit);
            } else if self.retry_bytes + item.bytes() <= RETRY_BYTES {
                self.retry_bytes += item.bytes();
                self.retry.insert(*id, item.clone());
            } else {
                self.undelivered(*id, item, events);
            }
        }
        if self.unsent > 0 {
            let text = format!(
                "redis_ratelimit: zone \"{}\": {} increments could not wait for Redis (more than {} MiB held for it); counted on this node only",
                self.spec.name,
                self.unsent,
                RETRY_BYTES >> 20
            );
            if self.drops.pass(Instant::now(), false).is_some() {
                self.unsent = 0;
                events.push(Event::Log {
                    zone: self.spec.index,
                    level: Level::Loss,
                    message: text,
                });
            }
        }
    }

    /// Increments that will never reach Redis: the worker counts them on
    /// this node alone (no answer is waited for), and they are counted as
    /// dropped.
    pub(super) fn undelivered(&mut self, id: ItemId, item: &Item, events: &mut Vec<Event>) {
        keep_local(id, item, events);
        self.unsent += u64::from(item.n);
        if let Some(st) = self.stats() {
            st.dropped.fetch_add(u64::from(item.n), std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The thread stops (the worker exits) with increments Redis has not
    /// taken: they stay counted on this node, and the line says so.
    pub(super) fn abandon(&mut self, events: &mut Vec<Event>) {
        let kept: Vec<(ItemId, Item)> = self.retry.drain().collect();
        self.retry_bytes = 0;
        for (id, item) in &kept {
            self.undelivered(*id, item, events);
        }
        if self.unsent > 0 {
            events.push(Event::Log {
                zone: self.spec.index,
                level: Level::Loss,
                message: format!(
                    "redis_ratelimit: zone \"{}\": {} increments not sent before the worker exited (Redis {} not answering); counted on this node only",
                    self.spec.name,
                    self.unsent,
                    self.describe()
                ),
            });
            self.unsent = 0;
        }
    }

    /// New items plus those waiting to be sent again (merged per key and
    /// window); increments for windows that no longer matter are dropped.
    pub(super) fn with_retry(&mut self, items: Vec<(ItemId, Item)>) -> Vec<(ItemId, Item)> {
        if self.retry.is_empty() {
            return items;
        }
        let now_ms = unix_ms();
        self.retry_bytes = 0;
        let mut merged: ItemMap<Item> = self
            .retry
            .drain()
            .filter(|(id, item)| {
                let current =
                    ratelimit_core::window::window_index(now_ms, u64::from(item.period) * 1000);
                id.window + 1 >= current
            })
            .collect();
        for (id, item) in items {
            match merged.get_mut(&id) {
                Some(m) => {
                    m.n = m.n.saturating_add(item.n);
                    m.carried = m.carried.saturating_add(item.carried);
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
        let sentinel = self.spec.sentinel.as_ref();
        match io::connect(
            &self.spec.urls,
            self.spec.cluster,
            sentinel,
            &self.spec.tls,
            self.spec.timeout,
        ) {
            Ok(mut c) => {
                self.clock_offset_ms = c.clock_offset();
                if !self.spec.cluster {
                    // named for CLIENT LIST, beside the workers' strict
                    // links (a server that refuses the name is fine)
                    let mut name = redis::cmd("CLIENT");
                    name.arg("SETNAME").arg(SENDER_NAME);
                    let _ = c.exec(&[name], None, Instant::now() + self.spec.timeout, &|_| None);
                }
                self.conn = Some(c);
                if let Some(st) = self.stats() {
                    Stats::bump(&st.connects);
                }
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
                level: Level::Recovery,
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
        if let Some(st) = self.stats() {
            Stats::bump(&st.errors_transport);
        }
        let first = self.health.failed(Instant::now());
        let text = format!(
            "redis_ratelimit: zone \"{}\": {} {} failed: {}",
            self.spec.name,
            what,
            self.describe(),
            error_text(err, self.spec.timeout)
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
        let gate = if refusal { &mut self.refusals } else { &mut self.errors };
        if let Some(held) = gate.pass(Instant::now(), force) {
            let message = self.scrub(format!("{text}{}", held_note(held)));
            events.push(Event::Log { zone: self.spec.index, level: Level::Error, message });
        }
    }

    /// An error reply for one key: logged (at most once a second, key
    /// named), the backend stays up.
    pub(super) fn refused(&mut self, key: &[u8], why: &str, events: &mut Vec<Event>) {
        if let Some(st) = self.stats() {
            Stats::bump(&st.errors_reply);
        }
        let text = format!(
            "redis_ratelimit: zone \"{}\": Redis refused the counter \"{}\": {}; counted on this node only",
            self.spec.name,
            show_key(key),
            why
        );
        self.log_error(true, false, text, events);
    }

    pub(super) fn key_name(&self, id: &ItemId, item: &Item) -> Vec<u8> {
        cmds_key(&self.spec.prefix, id, item)
    }

    pub(super) fn describe(&self) -> String {
        self.spec.urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(",")
    }

    pub(super) fn scrub(&self, mut text: String) -> String {
        for s in &self.secrets {
            text = text.replace(s.as_str(), "***");
        }
        text
    }
}

/// A Redis client error in our words where the library's would mislead or
/// run over several lines (its parser reports every unexpected byte on a
/// line of its own); the log line is made one line in any case when it is
/// written (`zone_log`).
pub(super) fn error_text(err: &redis::RedisError, timeout: Duration) -> String {
    // a socket timeout reads as EAGAIN ("Resource temporarily unavailable")
    if err.is_timeout() {
        return format!("no answer within timeout={}ms", timeout.as_millis());
    }
    match err.kind() {
        redis::ErrorKind::Parse => {
            "the server's answer is not the Redis protocol (is it a Redis server?)".to_string()
        }
        // our own errors carry the kind after the words: not for operators
        _ => {
            let text = err.to_string();
            match text.strip_suffix(" - Io") {
                Some(words) => words.to_string(),
                None => text,
            }
        }
    }
}
