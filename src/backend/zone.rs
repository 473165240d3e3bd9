//! One zone's backend in the thread: what it holds beside its way to Redis
//! (`Server`): increments to send again (`Retry`), keys to refresh
//! (`Watches`), TTLs to set again, what it knows of previous windows, its
//! part in the node's sending (`Lease`), the strict links it makes
//! (`Links`), the zone's nodes (`Fleet`); and its periodic work (idle
//! checks, tries of a down backend, refreshes). What a flush sends and how
//! each reply is read: `send.rs`.

use std::time::{Duration, Instant};

use ratelimit_core::batch::{Batch, Delete, Item, ItemId, ItemMap};
use ratelimit_core::control::Change;
use ratelimit_core::stats::Stats;
use ratelimit_core::sync::FirstCounts;
use redis::Cmd;

use super::clock::unix_ms;
use super::controls::ControlSync;
use super::event::{Event, ZoneSpec, PIPELINE_ITEMS};
use super::fleet::Fleet;
use super::link::Links;
use super::process::{own_pid, process_alive};
use super::refresh::Watches;
use super::retry::Retry;
use super::ring::Lease;
use super::server::Server;

/// Most keys whose TTL is still to be set again after a lost reply.
pub(super) const TTL_FIX_MAX: usize = 4096;

/// What this worker knows of a key's previous window, per current window.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct Prev {
    pub(super) period: u32,
    /// The last count read, if any.
    pub(super) value: Option<u64>,
    /// Read after the settle time: it will not change any more.
    pub(super) settled: bool,
    /// This node made the previous window's count alone: its `SET NX`
    /// created this window's counter (`Item::fresh`). Not read then while
    /// the key stays quiet: the node's own count of it is the count.
    pub(super) own: bool,
}

/// A counter whose TTL is to be set (again): its tag and period.
pub(super) type TtlFix = (Box<[u8]>, u32);

pub struct Backend {
    pub(super) server: Server,
    pub(super) retry: Retry,
    pub(super) watches: Watches,
    /// Counters whose `INCRBY` may have created them without an `EXPIRE`
    /// (reply lost): `EXPIRE` sent with the next exchange.
    pub(super) ttl_fix: ItemMap<TtlFix>,
    pub(super) prev: ItemMap<Prev>,
    /// When `prev` was last rid of windows that are over.
    swept: Instant,
    /// This thread's slot in the zone's waiting gauge, once it has one.
    waiting_slot: Option<usize>,
    pub(super) lease: Lease,
    links: Links,
    /// How this zone's first counts make their counters lately.
    pub(super) first: FirstCounts,
    /// Redis refused `SET` to this user (`NOPERM`): counters are made by
    /// `INCRBY` only.
    pub(super) set_refused: bool,
    /// The nodes counting the zone through this Redis (`on_error=share`).
    fleet: Fleet,
    /// The zone's controls in Redis.
    controls: ControlSync,
}

impl Backend {
    pub fn new(spec: ZoneSpec, now: Instant) -> Backend {
        Backend {
            retry: Retry::new(),
            watches: Watches::new(now),
            ttl_fix: ItemMap::default(),
            prev: ItemMap::default(),
            swept: now,
            waiting_slot: None,
            lease: Lease::new(spec.ring),
            links: Links::new(&spec),
            first: FirstCounts::default(),
            set_refused: false,
            fleet: Fleet::new(now),
            controls: ControlSync::new(now),
            server: Server::new(spec, now),
        }
    }

    pub fn zone(&self) -> u32 {
        self.server.spec.index
    }

    /// The zone's figures in shared memory, if mapped.
    pub(super) fn stats(&self) -> Option<&Stats> {
        self.server.stats()
    }

    /// Whether the backend works: its connection, and every master of a
    /// cluster.
    pub fn is_up(&self) -> bool {
        self.server.is_up()
    }

    /// Whether this thread sends the zone's counts to Redis.
    pub fn sends(&self) -> bool {
        self.lease.sends()
    }

    /// Publishes how many increments of this zone wait in this thread
    /// (`queued` in the worker's queue, plus those kept to send again).
    /// Returns a process found gone with its slot (`Shares::hold`).
    pub(super) fn publish_waiting(&mut self, queued: u64) -> Option<u64> {
        let now = queued + self.retry.count();
        let st = self.server.stats()?;
        st.waiting.set(&mut self.waiting_slot, own_pid(), now, unix_ms(), process_alive)
    }

    /// Takes this thread's slot in the zone's waiting gauge before it holds
    /// any increment, so that the worker's death is seen whenever it
    /// comes. Returns a process found gone with its slot.
    pub(super) fn hold_waiting_slot(&mut self) -> Option<u64> {
        let st = self.server.stats()?;
        st.waiting.hold(&mut self.waiting_slot, own_pid(), process_alive)
    }

    /// Takes this thread's share back from the waiting gauge (it exits).
    pub(super) fn unpublish_waiting(&mut self) {
        if let Some(st) = self.server.stats() {
            st.waiting.release(&mut self.waiting_slot, own_pid());
        }
    }

    /// Takes the zone's sender lease, or keeps it (`Lease::renew`).
    pub(super) fn renew_lease(&mut self, events: &mut Vec<Event>) {
        self.lease.renew(&self.server.spec, events);
    }

    /// The sender: takes what the other workers forwarded into `batch`
    /// (`Lease::take_forwarded`).
    pub(super) fn take_forwarded(&mut self, batch: &mut Batch, events: &mut Vec<Event>) -> bool {
        self.lease.take_forwarded(batch, &mut self.retry, &self.server, events)
    }

    /// Not the sender: hands `items` to the node's sender (`Lease::forward`).
    pub(super) fn forward(&mut self, items: Vec<(ItemId, Item)>, events: &mut Vec<Event>) {
        self.lease.forward(items, &mut self.retry, &self.server, events);
    }

    /// The thread stops (the worker exits): what Redis has not taken stays
    /// counted on this node (`Retry::abandon`).
    pub(super) fn abandon(&mut self, events: &mut Vec<Event>) {
        self.retry.abandon(&self.server, events);
    }

    /// The worker wants a strict link (`Links::want`).
    pub(super) fn want_link(&mut self) {
        self.links.want(&self.server.spec);
    }

    /// Makes the strict link the worker wants, if it is due (`Links::make`).
    pub(super) fn make_link(&mut self, events: &mut Vec<Event>) {
        self.links.make(&mut self.server, events);
    }

    /// When the thread must wake for this backend, with nothing queued.
    pub fn next_wake(&self, now: Instant) -> Instant {
        let sends = self.sends();
        let s = &self.server;
        // a thread that does not send checks no idle backend, and what
        // waits for room in the ring goes again soon
        let mut next = if sends || !s.health.is_up() {
            s.health.next_check()
        } else {
            now + Duration::from_millis(ratelimit_core::ring::RENEW_MS)
        };
        if s.health.is_up() {
            if !self.ttl_fix.is_empty() || !self.retry.is_empty() && s.all_masters_up() {
                next =
                    if sends || self.retry.is_empty() { now } else { now + super::FORWARD_EVERY };
            }
            if let Some(t) = s.next_node_check() {
                next = next.min(t);
            }
            if let Some(due) = self.watches.next_due() {
                next = next.min(due);
            }
            if let Some(due) = self.links.due(s) {
                next = next.min(due);
            }
            if s.spec.share && sends {
                next = next.min(self.fleet.due);
            }
            if sends {
                next = next.min(self.controls.due);
            }
        }
        next
    }

    /// The periodic work: try a down backend once its backoff is over (with
    /// what it holds, or PING), check an idle one, send what waits, refresh.
    pub fn tick(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        if !self.server.health.is_up() {
            if !self.server.health.may_send(now) {
                return;
            }
            // A PING first: a backend that still hangs or refuses costs a
            // PING per backoff, and what waits is sent only once it
            // answers (what a timed-out pipeline carried is lost to Redis,
            // never sent twice). Up again once what waits went through.
            if !self.server.check(events) {
                return;
            }
            if self.retry.is_empty() {
                self.server.succeeded(events);
            } else {
                self.send(Vec::new(), None, true, events);
            }
            return;
        }
        self.server.probe_nodes(self.retry.items(), events);
        if !self.retry.is_empty() {
            if self.sends() {
                self.send(Vec::new(), None, false, events);
            } else {
                self.forward(Vec::new(), events);
            }
        } else if !self.ttl_fix.is_empty() {
            self.send_ttl_fixes(events);
        } else if self.sends() && self.server.health.check_due(now) {
            // (the idle check is the sender's: one PING per node)
            self.server.check(events);
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
        if self.server.health.is_up() {
            self.refresh(events);
            if self.sends() {
                self.fleet.say_counting(&mut self.server, events);
                self.controls.read(&mut self.server, events);
            } else {
                self.controls.forget();
            }
        }
    }

    /// Writes a change of the zone's controls the worker made.
    pub(super) fn write_control(&mut self, change: &Change, events: &mut Vec<Event>) {
        self.controls.write(&mut self.server, change, events);
    }

    /// Reads the keys whose refresh is due (once each), within the budget.
    fn refresh(&mut self, events: &mut Vec<Event>) {
        let prev = &self.prev;
        let items = self.watches.due(|id| prev.get(id).is_some_and(|s| s.settled));
        for chunk in items.chunks(PIPELINE_ITEMS) {
            if !self.server.health.is_up() {
                break;
            }
            self.exchange(chunk, None, None, false, events);
        }
    }

    /// Deletes both windows of a key, or its bucket (Lua's `reset`), unless a worker's
    /// strict link did (`Delete::command`). Best effort.
    pub fn delete(&mut self, d: &Delete, events: &mut Vec<Event>) {
        // counted before the reset: forget them too
        self.retry.forget(d.entry);
        self.prev.retain(|id, _| id.entry != d.entry);
        self.watches.forget(d.entry);
        self.ttl_fix.retain(|id, _| id.entry != d.entry);
        let s = &mut self.server;
        if !d.command || !s.health.is_up() || !s.ensure_conn(events) {
            return;
        }
        let keys = d.keys(&s.spec.prefix);
        let node = keys.first().and_then(|k| s.node_of(k));
        let cmds: Vec<Cmd> = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("DEL");
                c.arg(k);
                c
            })
            .collect();
        if let Some((_, broken)) = s.exec(&cmds, node.as_deref(), None, &|_| None) {
            s.exchanged(node.as_deref(), broken, events);
        }
    }
}
