//! One zone's way to Redis, in the thread: its connection (one server, a
//! master found through Sentinel, or a Redis Cluster with a link per
//! master), whether it works (`Health`, with a backoff while it does not),
//! and the error lines it writes. Everything the thread sends for the zone
//! goes through it.
//!
//! A cluster is served one master at a time: increments are grouped per
//! master (`by_node`, from a copy of the slot map) and each group is its
//! own pipeline, so a master that hangs, refuses or is gone delays only
//! the keys of its slots. A failed master gets its own backoff; its keys
//! wait (bounded, see `Retry`) while the others keep their flush interval.
//! Once its backoff is over the slot map is read again (a failover may
//! have moved its slots: the master is then forgotten), and it is PINGed
//! before what waited is sent to it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ratelimit_core::batch::{Item, ItemId, ItemMap};
use ratelimit_core::counter::RoundTrip;
use ratelimit_core::health::{Health, LogGate};
use ratelimit_core::key::{redis_key_for_tag, show_key};
use ratelimit_core::params::redact;
use ratelimit_core::slots::Topology;
use ratelimit_core::stats::Stats;
use redis::{Cmd, IntoConnectionInfo, Value};

use super::event::{Event, Level, StatsRef, ZoneSpec};
use super::io::{self, Conn, Reply};

/// The name a thread's own connection gives itself (`CLIENT SETNAME`): the
/// node's sender's, or a worker's that sent its own strict calls or resets.
pub const SENDER_NAME: &str = "ngx_redis_ratelimit";

const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// The slot map is read again this often, and every second while a master
/// is failing.
const TOPOLOGY_MAX_AGE: Duration = Duration::from_secs(10);
const TOPOLOGY_AGE_FAILING: Duration = Duration::from_secs(1);

/// Items for one master (`None`: a single Redis, or the slot map unknown).
pub(super) type Group = (Option<String>, Vec<(ItemId, Item)>);

/// Replies to a pipeline, and the failure that broke it, if one did.
pub(super) type Exchanged = (Vec<Reply>, Option<redis::RedisError>);

pub(super) struct Server {
    pub(super) spec: ZoneSpec,
    pub(super) conn: Option<Conn>,
    /// Redis's clock minus ours (ms), learnt when `conn` was made (`None`:
    /// `TIME` refused): strict calls carry deadlines in Redis's clock.
    pub(super) clock_offset_ms: Option<i64>,
    pub(super) health: Health,
    errors: LogGate,
    refusals: LogGate,
    secrets: Vec<String>,
    /// Cluster: a copy of the slot map, and when it was read.
    topo: Option<Topology>,
    topo_at: Option<Instant>,
    /// Cluster: masters that failed, each with its own backoff (the keys of
    /// their slots wait, the others go on).
    nodes: HashMap<String, Health>,
    /// The usual round trip of a flush (`counter::RoundTrip`, slots timed
    /// from `born`): how long the worker may wait for an answer
    /// (`Channel::stale_ms`).
    pub(super) rtt: RoundTrip,
    born: Instant,
}

impl Server {
    pub(super) fn new(spec: ZoneSpec, now: Instant) -> Server {
        let mut secrets: Vec<String> = Vec::new();
        for u in &spec.urls {
            if let Ok(ci) = u.as_str().into_connection_info() {
                if let Some(p) = ci.redis_settings().password() {
                    secrets.push(p.to_string());
                }
            }
            // the password as written (percent-encoded), too
            if let Some(raw) = ratelimit_core::params::url_password(u) {
                secrets.push(raw.to_string());
            }
        }
        if let Some(p) = spec.sentinel.as_ref().and_then(|s| s.password.as_ref()) {
            secrets.push(p.clone());
        }
        secrets.retain(|s| !s.is_empty());
        Server {
            spec,
            conn: None,
            clock_offset_ms: None,
            health: Health::new(now),
            errors: LogGate::new(LOG_INTERVAL),
            refusals: LogGate::new(LOG_INTERVAL),
            secrets,
            topo: None,
            topo_at: None,
            nodes: HashMap::new(),
            rtt: RoundTrip::default(),
            born: now,
        }
    }

    /// The zone's figures in shared memory, if mapped.
    pub(super) fn stats(&self) -> Option<&Stats> {
        self.spec.stats.as_ref().map(StatsRef::get)
    }

    /// Whether the backend works: its connection, and every master of a
    /// cluster.
    pub(super) fn is_up(&self) -> bool {
        self.health.is_up() && self.nodes.is_empty()
    }

    /// When a failed master is to be tried again, the earliest.
    pub(super) fn next_node_check(&self) -> Option<Instant> {
        self.nodes.values().map(Health::next_check).min()
    }

    /// Whether every master works (a cluster with one failing holds the
    /// keys of its slots back).
    pub(super) fn all_masters_up(&self) -> bool {
        self.nodes.is_empty()
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

    /// `cmds` as one pipeline on `node`, within `deadline` (the zone's
    /// `timeout=` from now without one), counted in the zone's figures;
    /// `readback` as for `Conn::exec`. `None` without a connection.
    pub(super) fn exec(
        &mut self,
        cmds: &[Cmd],
        node: Option<&str>,
        deadline: Option<Instant>,
        readback: &dyn Fn(usize) -> Option<Cmd>,
    ) -> Option<Exchanged> {
        let sent_at = Instant::now();
        let stop_at = deadline.unwrap_or(sent_at + self.spec.timeout);
        let out = self.conn.as_mut()?.exec(cmds, node, stop_at, readback);
        if let Some(st) = self.stats() {
            st.pipeline(cmds.len(), sent_at.elapsed().as_micros() as u64);
        }
        Some(out)
    }

    /// `exec` of a flush, whose round trip is learnt: the shortest of the
    /// last seconds (a stall is what the worker must notice,
    /// `Channel::stale_ms`, not part of the round trip).
    pub(super) fn exec_timed(
        &mut self,
        cmds: &[Cmd],
        node: Option<&str>,
        deadline: Option<Instant>,
        readback: &dyn Fn(usize) -> Option<Cmd>,
    ) -> Option<(Vec<Reply>, Option<redis::RedisError>, Instant)> {
        let sent_at = Instant::now();
        let (replies, broken) = self.exec(cmds, node, deadline, readback)?;
        let now = Instant::now();
        let rtt_us = now.saturating_duration_since(sent_at).as_micros() as u64;
        let at_ms = now.saturating_duration_since(self.born).as_millis() as u64;
        self.rtt.add(rtt_us, at_ms);
        Some((replies, broken, now))
    }

    /// The end of an exchange with `node`: it failed or it worked.
    pub(super) fn exchanged(
        &mut self,
        node: Option<&str>,
        broken: Option<redis::RedisError>,
        events: &mut Vec<Event>,
    ) {
        match broken {
            Some(e) => self.link_failed(node, &e, events),
            None => self.link_ok(node, events),
        }
    }

    /// PING (and `CLUSTER INFO` for a cluster). An up backend that answers
    /// has its idle timer reset; a down one stays down until what it holds
    /// went through (`Backend::tick`).
    pub(super) fn check(&mut self, events: &mut Vec<Event>) -> bool {
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

    /// A check now, for an up backend (a worker's strict link broke).
    pub(super) fn check_now(&mut self, events: &mut Vec<Event>) {
        if self.health.is_up() {
            self.check(events);
        }
    }

    /// A worker's strict link got no answer within `timeout=`: the backend
    /// is down, as after a read timeout of the thread's own.
    pub(super) fn link_timed_out(&mut self, events: &mut Vec<Event>) {
        if self.health.is_up() {
            let e = redis::RedisError::from((
                redis::ErrorKind::Io,
                "no answer within timeout= on a strict link",
            ));
            self.transport_failed("sending to", &e, events);
        }
    }

    /// The outcome of a check: a failure takes the backend down.
    fn checked(&mut self, r: redis::RedisResult<()>, events: &mut Vec<Event>) -> bool {
        match r {
            Ok(()) => true,
            Err(e) => {
                self.transport_failed("sending to", &e, events);
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

    /// The Redis name of an item's counter.
    pub(super) fn key_name(&self, id: &ItemId, item: &Item) -> Vec<u8> {
        cmds_key(&self.spec.prefix, id, item)
    }

    /// The zone's URLs, without passwords.
    pub(super) fn describe(&self) -> String {
        self.spec.urls.iter().map(|u| redact(u)).collect::<Vec<_>>().join(",")
    }

    fn scrub(&self, mut text: String) -> String {
        for s in &self.secrets {
            text = text.replace(s.as_str(), "***");
        }
        text
    }

    /// A reply that says this is not a master that serves the key: a
    /// cluster that is down, or a master that became a replica (followed
    /// through Sentinel, or a plain URL whose address now leads to a
    /// replica: a failover by DNS or a virtual IP). The backend (or that
    /// master) is then down, and is looked up (resolved) again.
    pub(super) fn master_lost(&self, r: &Reply) -> bool {
        r.is_cluster_down()
            || !self.spec.cluster && matches!(r, Reply::Refused { code, .. } if code == "READONLY")
    }

    /// A `master_lost` reply as a failure of `node`: said in the log, the
    /// backend (or that master) down.
    pub(super) fn not_serving(&mut self, node: Option<&str>, why: String, events: &mut Vec<Event>) {
        let what =
            if self.spec.cluster { "cluster not serving" } else { "not a master (any more)" };
        let e = redis::RedisError::from((redis::ErrorKind::Io, what, why));
        self.link_failed(node, &e, events);
    }

    /// Items grouped per master, the masters that answer first. One group
    /// (`None`) for a single Redis, or while the slot map is unknown.
    pub(super) fn by_node(&mut self, items: Vec<(ItemId, Item)>) -> Vec<Group> {
        if !self.spec.cluster || items.is_empty() {
            return vec![(None, items)];
        }
        self.read_topology(false);
        let Some(topo) = &self.topo else {
            return vec![(None, items)];
        };
        let mut groups: HashMap<Option<String>, Vec<(ItemId, Item)>> = HashMap::new();
        for (id, item) in items {
            let key = cmds_key(&self.spec.prefix, &id, &item);
            let node = topo.node(&key).map(str::to_string);
            groups.entry(node).or_default().push((id, item));
        }
        let mut out: Vec<Group> = groups.into_iter().collect();
        out.sort_by_key(|(n, _)| n.as_ref().is_some_and(|n| self.nodes.contains_key(n)));
        out
    }

    /// Whether a group for `node` may be sent now: always for a master that
    /// works, once its backoff is over for one that failed.
    pub(super) fn node_may_send(&self, node: Option<&str>, now: Instant) -> bool {
        node.and_then(|n| self.nodes.get(n)).is_none_or(|h| h.may_send(now))
    }

    fn link_ok(&mut self, node: Option<&str>, events: &mut Vec<Event>) {
        if let Some(n) = node {
            if self.nodes.remove(n).is_some() {
                events.push(Event::Log {
                    zone: self.spec.index,
                    level: Level::Recovery,
                    message: format!(
                        "redis_ratelimit: zone \"{}\": Redis Cluster master {} is reachable again",
                        self.spec.name, n
                    ),
                });
            }
        }
        self.succeeded(events);
    }

    /// A transport failure of one master's pipeline (or of the connection,
    /// with no master named). The cluster connection is made anew before
    /// the next exchange (fresh links and slot map), and the other masters
    /// go on.
    pub(super) fn link_failed(
        &mut self,
        node: Option<&str>,
        err: &redis::RedisError,
        events: &mut Vec<Event>,
    ) {
        let Some(n) = node else {
            self.transport_failed("sending to", err, events);
            return;
        };
        self.topo_at = None;
        if let Some(st) = self.stats() {
            Stats::bump(&st.errors_transport);
        }
        let now = Instant::now();
        let first = self.nodes.entry(n.to_string()).or_insert_with(|| Health::new(now)).failed(now);
        let text = format!(
            "redis_ratelimit: zone \"{}\": sending to Redis Cluster master {} of {} failed: {}; the keys of its slots wait",
            self.spec.name,
            n,
            self.describe(),
            error_text(err, self.spec.timeout)
        );
        self.log_error(false, first, text, events);
    }

    /// Failed masters whose backoff is over: forgotten if the slot map no
    /// longer has them, else PINGed; one that answers and has nothing
    /// `waiting` is back, one with keys waiting is back once they went
    /// through (`Backend::send`).
    pub(super) fn probe_nodes(&mut self, waiting: &ItemMap<Item>, events: &mut Vec<Event>) {
        let now = Instant::now();
        let due: Vec<String> =
            self.nodes.iter().filter(|(_, h)| h.may_send(now)).map(|(n, _)| n.clone()).collect();
        if due.is_empty() || !self.ensure_conn(events) {
            return;
        }
        self.read_topology(true);
        for n in due {
            if self.topo.as_ref().is_some_and(|t| !t.nodes().any(|m| m == n)) {
                self.nodes.remove(&n);
                continue;
            }
            let Some(Conn::Cluster(c)) = self.conn.as_mut() else {
                return;
            };
            match c.ping(&n) {
                Ok(()) => {
                    let waits = waiting.iter().any(|(id, item)| {
                        let key = cmds_key(&self.spec.prefix, id, item);
                        self.topo.as_ref().and_then(|t| t.node(&key)) == Some(n.as_str())
                    });
                    if !waits {
                        self.link_ok(Some(&n), events);
                    }
                }
                Err(e) => self.link_failed(Some(&n), &e, events),
            }
        }
    }

    /// The master serving `key`, if the slot map is known (a cluster only).
    pub(super) fn node_of(&self, key: &[u8]) -> Option<String> {
        if !self.spec.cluster {
            return None;
        }
        self.topo.as_ref()?.node(key).map(str::to_string)
    }

    /// The idle check of a cluster: PING every master on its own
    /// connection (a master that fails is held alone), and `CLUSTER INFO`
    /// on one that answered, which must say `cluster_state:ok`.
    fn check_cluster(&mut self, events: &mut Vec<Event>) -> bool {
        self.read_topology(false);
        let masters: Vec<String> =
            self.topo.as_ref().map(|t| t.nodes().map(str::to_string).collect()).unwrap_or_default();
        let Some(Conn::Cluster(c)) = self.conn.as_mut() else {
            return false;
        };
        if masters.is_empty() {
            let r = c.check();
            return self.checked(r, events);
        }
        let mut answered = None;
        let mut failed = Vec::new();
        for n in &masters {
            match c.ping(n) {
                Ok(()) => {
                    answered.get_or_insert(n.clone());
                }
                Err(e) => failed.push((n.clone(), e)),
            }
        }
        let state = match &answered {
            Some(n) => c.state_on(n),
            None => Err(redis::RedisError::from((redis::ErrorKind::Io, "no master answers"))),
        };
        for (n, e) in failed {
            self.link_failed(Some(&n), &e, events);
        }
        self.checked(state, events)
    }

    /// Reads `CLUSTER SLOTS` when the copy is old (or `force`). A failed
    /// read keeps the old copy.
    pub(super) fn read_topology(&mut self, force: bool) {
        let max_age = if self.nodes.is_empty() { TOPOLOGY_MAX_AGE } else { TOPOLOGY_AGE_FAILING };
        if !force && self.topo_at.is_some_and(|t| t.elapsed() < max_age) {
            return;
        }
        let Some(Conn::Cluster(c)) = self.conn.as_mut() else {
            return;
        };
        self.topo_at = Some(Instant::now());
        // from a master that works, on its own connection, if one is known
        let healthy = self
            .topo
            .as_ref()
            .and_then(|t| t.nodes().find(|n| !self.nodes.contains_key(*n)).map(str::to_string));
        let slots = redis::cmd("CLUSTER").arg("SLOTS").clone();
        // the host asked, for the endpoints a node leaves empty
        let (reply, asked) = match healthy {
            Some(n) => {
                let host = n.rsplit_once(':').map_or(n.as_str(), |(h, _)| h).to_string();
                (c.query_on(&n, &slots), host)
            }
            None => (slots.query::<Value>(&mut c.router), c.seed_host()),
        };
        if let Some(t) = reply.ok().as_ref().and_then(|v| Topology::parse(v, &asked)) {
            self.topo = Some(t);
        }
    }
}

/// The Redis name of an item's counter.
pub(super) fn cmds_key(prefix: &[u8], id: &ItemId, item: &Item) -> Vec<u8> {
    let p = u64::from(item.period);
    redis_key_for_tag(prefix, &item.tag, item.period, id.window * p)
}

/// How many lines a gate held back, said at the end of the next one.
pub(super) fn held_note(held: u64) -> String {
    if held > 0 {
        format!(" ({held} more since the last report)")
    } else {
        String::new()
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
