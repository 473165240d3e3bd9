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
use super::server::Server;
use super::zone::Backend;

/// Sends every waiting strict ask to its zone's backend.
pub(super) fn send_all(backends: &mut [Backend], asks: Vec<StrictAsk>, events: &mut Vec<Event>) {
    let groups = StrictGroup::group(&asks);
    let mut by_zone: HashMap<u32, Vec<StrictGroup>> = HashMap::new();
    for g in groups {
        by_zone.entry(g.id.zone).or_default().push(g);
    }
    for (zone, groups) in by_zone {
        match backends.iter_mut().find(|b| b.zone() == zone) {
            Some(b) => send(&mut b.server, groups, events),
            None => groups.into_iter().for_each(|g| events.push(g.answered(None))),
        }
    }
}

/// Pauses before a script call that got `TRYAGAIN` is made again.
const TRYAGAIN_PAUSES_MS: [u64; 3] = [10, 20, 40];

fn send(s: &mut Server, groups: Vec<StrictGroup>, events: &mut Vec<Event>) {
    if !s.health.is_up() || !s.ensure_conn(events) {
        groups.into_iter().for_each(|g| events.push(g.answered(None)));
        return;
    }
    if s.spec.cluster {
        s.read_topology(false);
    }
    let mut by_node: HashMap<Option<String>, Vec<StrictGroup>> = HashMap::new();
    for g in groups {
        let key = cur_key(s, &g);
        by_node.entry(s.node_of(&key)).or_default().push(g);
    }
    for (node, mut groups) in by_node {
        while !groups.is_empty() {
            let rest = groups.split_off(groups.len().min(PIPELINE_ITEMS));
            let chunk = std::mem::replace(&mut groups, rest);
            let now = Instant::now();
            if !s.health.is_up() || !s.node_may_send(node.as_deref(), now) {
                chunk.into_iter().for_each(|g| events.push(g.answered(None)));
                continue;
            }
            strict_chunk(s, chunk, node.as_deref(), events);
        }
    }
}

fn cur_key(s: &Server, g: &StrictGroup) -> Vec<u8> {
    let p = u64::from(g.period);
    redis_key_for_tag(&s.spec.prefix, &g.tag, g.period, g.id.window * p)
}

/// The `EVALSHA` for one group (a call of its own: in a cluster, keys
/// of one call would have to share a slot), or with `text` the `EVAL` of the
/// script itself (for a server that does not know it: routed by the
/// key like any call, it also leaves the script in that server's cache).
fn strict_cmd(s: &Server, g: &StrictGroup, now_ms: u64, text: bool) -> Cmd {
    let call = strict::Call {
        prefix: &s.spec.prefix,
        now_ms,
        clock_offset_ms: s.clock_offset_ms,
        holder: super::holder(),
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
    s: &mut Server,
    groups: Vec<StrictGroup>,
    node: Option<&str>,
    events: &mut Vec<Event>,
) {
    let now_ms = unix_ms();
    let cmds: Vec<Cmd> = groups.iter().map(|g| strict_cmd(s, g, now_ms, false)).collect();
    let Some((mut replies, broken)) = s.exec(&cmds, node, None, &|_| None) else {
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
            missing.iter().map(|&i| strict_cmd(s, &groups[i], now_ms, true)).collect();
        match s.exec(&again, node, None, &|_| None) {
            Some((r, None)) => {
                for (&i, reply) in missing.iter().zip(r) {
                    replies[i] = reply;
                }
            }
            Some((_, Some(e))) => {
                for &i in &missing {
                    replies[i] = Reply::Lost;
                }
                s.link_failed(node, &e, events);
                answer(s, groups, replies, events);
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
            .filter(|&i| matches!(&replies[i], Reply::Refused { code, .. } if code == "TRYAGAIN"))
            .collect();
        if broken.is_some() || again.is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(pause_ms));
        let cmds: Vec<Cmd> = again.iter().map(|&i| cmds[i].clone()).collect();
        match s.exec(&cmds, node, None, &|_| None) {
            Some((r, None)) => {
                for (&i, reply) in again.iter().zip(r) {
                    replies[i] = reply;
                }
            }
            _ => break,
        }
    }
    let down = replies.iter().find(|r| s.master_lost(r)).map(ToString::to_string);
    answer(s, groups, replies, events);
    match (broken, down) {
        (None, Some(why)) => s.not_serving(node, why, events),
        (broken, _) => {
            let worked = broken.is_none();
            s.exchanged(node, broken, events);
            if let (true, Some(st)) = (worked, s.stats()) {
                st.synced(now_ms);
            }
        }
    }
}

/// Turns each group's reply into its answer.
fn answer(s: &mut Server, groups: Vec<StrictGroup>, replies: Vec<Reply>, events: &mut Vec<Event>) {
    let mut replies = replies.into_iter();
    for g in groups {
        let answer = match replies.next().unwrap_or(Reply::NotSent) {
            Reply::Value(v) => {
                let a = read_answer(&v, g.requests.len());
                if a.is_none() {
                    let key = cur_key(s, &g);
                    s.refused(&key, "the script's answer is not what it should be", events);
                }
                a
            }
            r @ Reply::Refused { .. } if s.master_lost(&r) => None,
            Reply::Refused { text, .. } => {
                let key = cur_key(s, &g);
                s.refused(&key, &text, events);
                None
            }
            Reply::Lost | Reply::NotSent => None,
        };
        events.push(g.answered(answer));
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
