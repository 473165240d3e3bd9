//! One exchange of a flush: its pipeline sent (`transmit`), each item's
//! replies applied on their own (`apply`: a count confirmed, or kept here,
//! or sent again), and what is left to do once all are read (`conclude`).
//! What each reply means for an increment: `flush.rs`.

use std::time::Instant;

use ratelimit_core::batch::{Item, ItemId};
use ratelimit_core::counter::{Confirmation, Fresh};
use redis::{Cmd, Value};

use super::clock::unix_ms;
use super::event::Event;
use super::flush::{cmds_key, count, keep_local, prev_settle_ms, Slots};
use super::io::Reply;
use super::refresh::{near_limit, refresh_due};
use super::state::{Backend, Prev, Watch, TTL_FIX_MAX, WATCH_MAX};

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
    /// `send_chunk`; `again` as for `plan`. Plans the commands, sends them
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
            self.keep_for_retry(items, events);
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
        let stop_at = deadline.unwrap_or_else(|| Instant::now() + self.spec.timeout);
        // asked only for a cluster pipeline that failed in part: the key
        // whose `INCRBY` command `i` is, found then
        let prefix = &self.spec.prefix;
        let readback = |i: usize| {
            let ((id, item), _) = items
                .iter()
                .zip(slots)
                .find(|((_, item), s)| s.cur == i && item.total() > 0 && !s.create)?;
            let mut c = redis::cmd("GET");
            c.arg(cmds_key(prefix, id, item));
            Some(c)
        };
        let conn = self.conn.as_mut()?;
        let sent_at = Instant::now();
        let (replies, broken) = conn.exec(cmds, node, stop_at, &readback);
        let now = Instant::now();
        let rtt_us = now.saturating_duration_since(sent_at).as_micros() as u64;
        // the shortest of the last seconds: a stall is what the worker
        // must notice (`Channel::stale_ms`), not part of the round trip
        let at_ms = now.saturating_duration_since(self.born).as_millis() as u64;
        self.rtt.add(rtt_us, at_ms);
        if let Some(st) = self.stats() {
            st.pipeline(cmds.len(), rtt_us);
        }
        Some((replies, broken, now))
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
                    let key = self.key_name(id, item);
                    self.refused(&key, "unexpected reply to SET", events);
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
                    let key = self.key_name(id, item);
                    self.refused(&key, "not a counter", events);
                    keep_local(*id, item, events);
                }
            },
            r @ Reply::Refused { .. } if self.master_lost(r) => {
                out.cluster_down = Some(r.to_string());
                self.keep_for_retry(std::slice::from_ref(&(*id, item.clone())), events);
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
            Reply::NotSent => {
                self.keep_for_retry(std::slice::from_ref(&(*id, item.clone())), events)
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
            self.keep_for_retry(&out.existed, events);
            self.link_failed(node, &e, events);
            for (id, tag, period) in out.created {
                if self.ttl_fix.len() < TTL_FIX_MAX {
                    self.ttl_fix.insert(id, (tag, period));
                }
            }
            return;
        }
        if let Some(why) = out.cluster_down {
            self.keep_for_retry(&out.existed, events);
            let e = redis::RedisError::from((redis::ErrorKind::Io, self.not_serving(), why));
            self.link_failed(node, &e, events);
            return;
        }
        self.link_ok(node, events);
        if let Some(st) = self.stats() {
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
