//! A Redis Cluster backend, one master at a time: increments are grouped
//! per master (`slots.rs`) and each group is its own pipeline, so a master
//! that hangs, refuses or is gone delays only the keys of its slots. A
//! failed master gets its own backoff; its keys wait (bounded, see
//! `keep_for_retry`) while the others keep their flush interval. Once its
//! backoff is over the slot map is read again (a failover may have moved its
//! slots: the master is then forgotten), and it is PINGed before what
//! waited is sent to it.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ratelimit_core::batch::{Item, ItemId};
use ratelimit_core::health::Health;
use ratelimit_core::slots::Topology;
use ratelimit_core::stats::Stats;
use redis::Value;

use super::event::{Event, Level};
use super::flush::cmds_key;
use super::io::Conn;
use super::state::Backend;

/// The slot map is read again this often, and every second while a master
/// is failing.
const TOPOLOGY_MAX_AGE: Duration = Duration::from_secs(10);
const TOPOLOGY_AGE_FAILING: Duration = Duration::from_secs(1);

type Group = (Option<String>, Vec<(ItemId, Item)>);

impl Backend {
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

    pub(super) fn link_ok(&mut self, node: Option<&str>, events: &mut Vec<Event>) {
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
            super::zone::error_text(err, self.spec.timeout)
        );
        self.log_error(false, first, text, events);
    }

    /// Failed masters whose backoff is over: forgotten if the slot map no
    /// longer has them, else PINGed; one that answers and has nothing
    /// waiting is back, one with keys waiting is back once they went
    /// through (`send`).
    pub(super) fn probe_nodes(&mut self, events: &mut Vec<Event>) {
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
                    let waiting = self.retry.iter().any(|(id, item)| {
                        let key = cmds_key(&self.spec.prefix, id, item);
                        self.topo.as_ref().and_then(|t| t.node(&key)) == Some(n.as_str())
                    });
                    if !waiting {
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
    pub(super) fn check_cluster(&mut self, events: &mut Vec<Event>) -> bool {
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
