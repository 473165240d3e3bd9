//! Strict requests in the thread: the limits that wait for Redis's decision
//! are grouped per key (one script call answers every request of the key
//! that waits on this worker), sent at once as `EVALSHA` pipelines (per
//! master in a cluster), and answered to the worker as `Event::Strict`.
//!
//! A `NOSCRIPT` reply (a Redis that restarted, a failover, a master that
//! never saw the script) loads the script with `SCRIPT LOAD` and sends those
//! calls again in the same pipeline. An error reply fails its key alone; a
//! transport failure fails what was in flight and takes the backend down, as
//! for increments. A group that gets no answer is answered `None`: its
//! requests are decided by the zone's `on_error`, at once.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ratelimit_core::key::redis_key_for_tag;
use ratelimit_core::strict::{self, Answer, SCRIPT};
use redis::{Cmd, Value};

use super::clock::unix_ms;
use super::event::{Event, StrictAsk, StrictGroup, PIPELINE_ITEMS};
use super::io::Reply;
use super::state::Backend;

/// Sends every waiting strict ask to its zone's backend.
pub(super) fn send_all(backends: &mut [Backend], asks: Vec<StrictAsk>, events: &mut Vec<Event>) {
    let groups = StrictGroup::group(&asks);
    let mut by_zone: HashMap<u32, Vec<StrictGroup>> = HashMap::new();
    for g in groups {
        by_zone.entry(g.id.zone).or_default().push(g);
    }
    for (zone, groups) in by_zone {
        match backends.iter_mut().find(|b| b.zone() == zone) {
            Some(b) => b.send_strict(groups, events),
            None => groups.into_iter().for_each(|g| events.push(g.answered(None))),
        }
    }
}

/// Pauses before a script call that got `TRYAGAIN` is made again.
const TRYAGAIN_PAUSES_MS: [u64; 3] = [10, 20, 40];

impl Backend {
    fn send_strict(&mut self, groups: Vec<StrictGroup>, events: &mut Vec<Event>) {
        if !self.health.is_up() || !self.ensure_conn(events) {
            groups.into_iter().for_each(|g| events.push(g.answered(None)));
            return;
        }
        if self.spec.cluster {
            self.read_topology(false);
        }
        let mut by_node: HashMap<Option<String>, Vec<StrictGroup>> = HashMap::new();
        for g in groups {
            let key = self.cur_key(&g);
            by_node.entry(self.node_of(&key)).or_default().push(g);
        }
        for (node, mut groups) in by_node {
            while !groups.is_empty() {
                let rest = groups.split_off(groups.len().min(PIPELINE_ITEMS));
                let chunk = std::mem::replace(&mut groups, rest);
                let now = Instant::now();
                if !self.health.is_up() || !self.node_may_send(node.as_deref(), now) {
                    chunk.into_iter().for_each(|g| events.push(g.answered(None)));
                    continue;
                }
                self.strict_chunk(chunk, node.as_deref(), events);
            }
        }
    }

    fn cur_key(&self, g: &StrictGroup) -> Vec<u8> {
        let p = u64::from(g.period);
        redis_key_for_tag(&self.spec.prefix, &g.tag, g.period, g.id.window * p)
    }

    /// The `EVALSHA` for one group (a call of its own: in a cluster, keys
    /// of one call would have to share a slot), or with `text` the `EVAL` of the
    /// script itself (for a server that does not know it: routed by the
    /// key like any call, it also leaves the script in that server's cache).
    fn strict_cmd(&self, g: &StrictGroup, now_ms: u64, text: bool) -> Cmd {
        let call = strict::Call {
            prefix: &self.spec.prefix,
            now_ms,
            clock_offset_ms: self.clock_offset_ms,
            groups: std::iter::once(g.call_group()),
        };
        let mut c = redis::cmd(if text { "EVAL" } else { "EVALSHA" });
        for (i, w) in call.words().iter().enumerate().skip(1) {
            if i == 1 && text {
                c.arg(SCRIPT);
            } else {
                c.arg(w);
            }
        }
        c
    }

    fn strict_chunk(
        &mut self,
        groups: Vec<StrictGroup>,
        node: Option<&str>,
        events: &mut Vec<Event>,
    ) {
        let now_ms = unix_ms();
        let cmds: Vec<Cmd> = groups.iter().map(|g| self.strict_cmd(g, now_ms, false)).collect();
        let Some((mut replies, broken)) = self.exec_counted(&cmds, node) else {
            groups.into_iter().for_each(|g| events.push(g.answered(None)));
            return;
        };
        // calls the server did not know the script for (a restart, a
        // SCRIPT FLUSH, a cluster master that never ran it): called again
        // with the script's text, which the server then keeps
        let missing: Vec<usize> = (0..replies.len())
            .filter(|&i| matches!(&replies[i], Reply::Refused { code, .. } if code == "NOSCRIPT"))
            .collect();
        if broken.is_none() && !missing.is_empty() {
            let again: Vec<Cmd> =
                missing.iter().map(|&i| self.strict_cmd(&groups[i], now_ms, true)).collect();
            match self.exec_counted(&again, node) {
                Some((r, None)) => {
                    for (&i, reply) in missing.iter().zip(r) {
                        replies[i] = reply;
                    }
                }
                Some((_, Some(e))) => {
                    for &i in &missing {
                        replies[i] = Reply::Lost;
                    }
                    self.link_failed(node, &e, events);
                    self.answer(groups, replies, events);
                    return;
                }
                None => {}
            }
        }
        // a key's two windows split between two nodes while its slot
        // migrates (a reshard): the call did nothing; it is called again
        // once the slot has moved on, a few times, within the deadline its
        // requests carry
        for pause_ms in TRYAGAIN_PAUSES_MS {
            let again: Vec<usize> = (0..replies.len())
                .filter(
                    |&i| matches!(&replies[i], Reply::Refused { code, .. } if code == "TRYAGAIN"),
                )
                .collect();
            if broken.is_some() || again.is_empty() {
                break;
            }
            std::thread::sleep(Duration::from_millis(pause_ms));
            let cmds: Vec<Cmd> = again.iter().map(|&i| cmds[i].clone()).collect();
            match self.exec_counted(&cmds, node) {
                Some((r, None)) => {
                    for (&i, reply) in again.iter().zip(r) {
                        replies[i] = reply;
                    }
                }
                _ => break,
            }
        }
        let down = replies.iter().find(|r| self.master_lost(r)).map(ToString::to_string);
        self.answer(groups, replies, events);
        if let Some(e) = broken {
            self.link_failed(node, &e, events);
        } else if let Some(why) = down {
            let e = redis::RedisError::from((redis::ErrorKind::Io, self.not_serving(), why));
            self.link_failed(node, &e, events);
        } else {
            self.link_ok(node, events);
            if let Some(st) = self.stats() {
                st.synced(now_ms);
            }
        }
    }

    /// `cmds` as one pipeline on `node`, counted in the zone's figures;
    /// `None` without a connection.
    fn exec_counted(
        &mut self,
        cmds: &[Cmd],
        node: Option<&str>,
    ) -> Option<(Vec<Reply>, Option<redis::RedisError>)> {
        let sent_at = Instant::now();
        let deadline = sent_at + self.spec.timeout;
        let out = self.conn.as_mut()?.exec(cmds, node, deadline, &|_| None);
        if let Some(st) = self.stats() {
            st.pipeline(cmds.len(), sent_at.elapsed().as_micros() as u64);
        }
        Some(out)
    }

    /// Turns each group's reply into its answer.
    fn answer(&mut self, groups: Vec<StrictGroup>, replies: Vec<Reply>, events: &mut Vec<Event>) {
        let mut replies = replies.into_iter();
        for g in groups {
            let answer = match replies.next().unwrap_or(Reply::NotSent) {
                Reply::Value(v) => {
                    let a = read_answer(&v, g.requests.len());
                    if a.is_none() {
                        let key = self.cur_key(&g);
                        self.refused(&key, "the script's answer is not what it should be", events);
                    }
                    a
                }
                r @ Reply::Refused { .. } if self.master_lost(&r) => None,
                Reply::Refused { text, .. } => {
                    let key = self.cur_key(&g);
                    self.refused(&key, &text, events);
                    None
                }
                Reply::Lost | Reply::NotSent => None,
            };
            events.push(g.answered(answer));
        }
    }

    /// A reply that says this is not a master that serves the key: a
    /// cluster that is down, or a master that became a replica (followed
    /// through Sentinel, or a plain URL whose address now leads to a
    /// replica: a failover by DNS or a virtual IP). The backend (or that
    /// master) is then down, and is looked up (resolved) again.
    /// How a `master_lost` reply is said in the log.
    pub(super) fn not_serving(&self) -> &'static str {
        if self.spec.cluster {
            "cluster not serving"
        } else {
            "not a master (any more)"
        }
    }

    pub(super) fn master_lost(&self, r: &Reply) -> bool {
        r.is_cluster_down()
            || !self.spec.cluster && matches!(r, Reply::Refused { code, .. } if code == "READONLY")
    }
}

/// The script's array of integers.
fn read_answer(v: &Value, requests: usize) -> Option<Answer> {
    let Value::Array(items) = v else {
        return None;
    };
    let ints: Option<Vec<i64>> = items
        .iter()
        .map(|x| match x {
            Value::Int(n) => Some(*n),
            _ => None,
        })
        .collect();
    strict::parse_answer(&ints?, requests)
}
