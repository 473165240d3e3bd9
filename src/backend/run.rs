//! The thread's loop, in its steps: wait for work (increments due, strict
//! calls, a link to make, a backend's own timers); send strict calls first
//! (requests wait for them; keys reset before them are reset first); apply
//! deletes and flush what is due, per zone; run each backend's timers; make
//! the strict links the workers asked for; say when increments were
//! dropped; hand the events to the worker; now and then publish what waits
//! (metrics).

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;
use ratelimit_core::batch::{Delete, Item, ItemId};
use ratelimit_core::health;
use ratelimit_core::params;

use super::process::{own_pid, process_alive};
use super::{
    clock, show_health, strict, Backend, Channel, Event, Level, LinkLoss, ZoneSpec,
    DROP_LOG_INTERVAL, DUE_CHUNK, DUE_SLACK_MS, FLUSH_INTERVAL, FORWARD_EVERY, STOP_FLUSH,
    WAITING_EVERY,
};

/// A thread that sends several zones sleeps on the first one's ring; it
/// looks at the others' every `SENDER_IDLE_POLL` when nothing was forwarded
/// into them for this long, else every flush interval.
const FORWARDS_LATELY_MS: u64 = 10_000;
const SENDER_IDLE_POLL: Duration = Duration::from_millis(20);

/// What the thread is woken for.
struct Work {
    items: Vec<(ItemId, Item)>,
    deletes: Vec<Delete>,
    /// The worker asked the thread to stop: send what it holds, then end.
    stopping: bool,
}

impl Work {
    fn none() -> Work {
        Work { items: Vec::new(), deletes: Vec::new(), stopping: false }
    }
}

/// The thread's state between turns.
struct Thread {
    backends: Vec<Backend>,
    last_flush: Option<Instant>,
    drops_reported: u64,
    drops_logged: Option<Instant>,
    /// The zone drops are reported under (any: they are the worker's).
    any_zone: u32,
    waiting_at: Instant,
    /// When this thread last forwarded its counts to the node's senders.
    forwarded_at: Instant,
    /// Events of the turn made while waiting (forwarded counts the batch
    /// had no room for).
    events: Vec<Event>,
}

pub(super) fn run(ch: &Channel, zones: Vec<ZoneSpec>) {
    let now = Instant::now();
    let mut backends: Vec<Backend> = zones.into_iter().map(|z| Backend::new(z, now)).collect();
    let any_zone = backends.first().map_or(0, Backend::zone);
    let orphans: Vec<Event> = backends
        .iter_mut()
        .filter_map(|b| Some(Event::Orphaned { zone: b.zone(), pid: b.hold_waiting_slot()? }))
        .collect();
    ch.publish(orphans);
    let mut t = Thread {
        backends,
        last_flush: None,
        drops_reported: 0,
        drops_logged: None,
        any_zone,
        waiting_at: now,
        forwarded_at: now,
        events: Vec::new(),
    };
    loop {
        let mut events = std::mem::take(&mut t.events);
        for b in t.backends.iter_mut() {
            b.renew_lease(&mut events);
        }
        let work = t.wait(ch);
        events.append(&mut t.events);
        let deadline = work.stopping.then(|| Instant::now() + STOP_FLUSH);
        t.strict(ch, &mut events);
        t.controls(ch, &mut events);
        t.flush(work.items, work.deletes, deadline, &mut events);
        t.timers(ch, work.stopping, deadline, &mut events);
        t.links(ch, &mut events);
        t.report_drops(ch, &mut events);
        ch.publish(events);
        if work.stopping {
            let mut events = Vec::new();
            for b in t.backends.iter_mut() {
                b.abandon(&mut events);
                b.lease.release();
            }
            ch.publish(events);
            for b in t.backends.iter_mut() {
                b.unpublish_waiting();
            }
            return;
        }
        t.publish_waiting(ch);
    }
}

impl Thread {
    /// Writes the changes of controls the worker made, each to its zone's
    /// Redis.
    fn controls(&mut self, ch: &Channel, events: &mut Vec<Event>) {
        if !ch.controls.pending.swap(false, Ordering::AcqRel) {
            return;
        }
        let changes = std::mem::take(&mut *ch.controls.changes.lock());
        for (zone, change) in changes {
            if let Some(b) = self.backends.iter_mut().find(|b| b.zone() == zone) {
                b.write_control(&change, events);
            }
        }
    }

    /// Sleeps until there is work: increments due (or too many bytes
    /// waiting), strict calls or links, a backend's timer, or a stop.
    fn wait(&mut self, ch: &Channel) -> Work {
        let mut b = ch.counts.batch.lock();
        loop {
            if ch.stop.load(Ordering::Acquire) {
                // a sender that stops sends what was forwarded to it too,
                // and frees the lease at once: what is forwarded from now
                // on goes to the next sender, not into a ring nobody reads
                // while this one sends its last counts
                for be in self.backends.iter_mut() {
                    be.take_forwarded(&mut b, &mut self.events);
                    be.lease.release();
                }
                let (items, deletes) = b.drain();
                return Work { items, deletes, stopping: true };
            }
            if ch.strict.pending.load(Ordering::Acquire)
                || ch.links.pending.load(Ordering::Acquire)
                || ch.controls.pending.load(Ordering::Acquire)
            {
                return Work::none();
            }
            // what the other workers forwarded, for the zones this thread
            // sends
            let mut forwarded_now = false;
            for be in self.backends.iter_mut() {
                forwarded_now |= be.take_forwarded(&mut b, &mut self.events);
            }
            // the counts of the zones another worker sends go to it
            // promptly (it holds them until they are due)
            let forwarded: Vec<u32> = self
                .backends
                .iter()
                .filter(|be| !be.sends() && b.has_zone(be.zone()))
                .map(Backend::zone)
                .collect();
            let forward_at = (!forwarded.is_empty()).then(|| self.forwarded_at + FORWARD_EVERY);
            if forward_at.is_some_and(|at| Instant::now() >= at) {
                self.forwarded_at = Instant::now();
                // what is taken now includes what was urgent: the next
                // urgent push must wake the thread again
                ch.counts.urgent.store(false, Ordering::Release);
                let now_ms = clock::unix_ms();
                let (mut items, mut deletes) =
                    b.drain_due(now_ms + DUE_SLACK_MS, DUE_CHUNK, ch.counts.bounds.hold);
                for z in forwarded {
                    let (i, d) = b.drain_zone(z);
                    items.extend(i);
                    deletes.extend(d);
                }
                b.wake_at = 0;
                return Work { items, deletes, stopping: false };
            }
            // what is due now (within the slack), or everything when what
            // waits holds too many bytes
            let now_ms = clock::unix_ms();
            let due = b.next_due();
            // due later than any item can be: the clock stepped back
            let stepped = due.is_some_and(|d| d > now_ms.saturating_add(params::MAX_HOLD_MS));
            let over = stepped || b.bytes() > ch.counts.bounds.hold;
            if over || due.is_some_and(|d| d <= now_ms) {
                b.wake_at = 0;
                let ready = self.last_flush.map_or(Duration::MAX, |t| t.elapsed());
                let urgent = ch.counts.urgent.swap(false, Ordering::AcqRel) | forwarded_now;
                if over || urgent || ready >= FLUSH_INTERVAL {
                    let (items, deletes) = if stepped {
                        b.drain()
                    } else {
                        b.drain_due(now_ms + DUE_SLACK_MS, DUE_CHUNK, ch.counts.bounds.hold)
                    };
                    return Work { items, deletes, stopping: false };
                }
                // paced: an increment that must go at once still wakes the
                // thread (due 0 < 1)
                b.wake_at = 1;
                ch.counts.wake.wait_for(&mut b, FLUSH_INTERVAL - ready);
                b.wake_at = 0;
                continue;
            }
            // Nothing due: sleep until woken, the next item is due, or a
            // backend needs its idle check, its next try, or a refresh.
            let now = Instant::now();
            let mut next = self
                .backends
                .iter()
                .map(|be| be.next_wake(now))
                .min()
                .unwrap_or(now + health::IDLE_CHECK);
            if let Some(d) = due {
                next = next.min(now + Duration::from_millis(d - now_ms));
            }
            if let Some(at) = forward_at {
                next = next.min(at);
            }
            // the lease is renewed (or taken over) every turn
            let mut rings = Vec::new();
            for be in &self.backends {
                if be.lease.ring().is_some() {
                    next = next.min(now + Duration::from_millis(ratelimit_core::ring::RENEW_MS));
                }
                rings.extend(be.lease.sender_ring());
            }
            // a sender sleeps on its zone's ring, where the other workers
            // wake it; one that sends several zones wakes on the first and
            // looks at the others often while workers forward into them
            if rings.len() > 1 {
                for ring in &rings[1..] {
                    let quiet = now_ms.saturating_sub(ring.forwarded_ms()) > FORWARDS_LATELY_MS;
                    next = next.min(now + if quiet { SENDER_IDLE_POLL } else { FLUSH_INTERVAL });
                }
            }
            let next = next.max(now);
            b.wake_at = now_ms.saturating_add(next.duration_since(now).as_millis() as u64).max(1);
            let timed_out = match rings.first() {
                Some(&ring) => {
                    *ch.counts.sleeps_on.lock() = Some(ring);
                    let seen = ring.seq().load(Ordering::Acquire);
                    // forwarded before `seen` was read: not slept over
                    if ring.with(own_pid() as u32, process_alive, |r| r.is_empty()) {
                        let left = next.saturating_duration_since(Instant::now());
                        MutexGuard::unlocked(&mut b, || ring.sleep(seen, left));
                    }
                    *ch.counts.sleeps_on.lock() = None;
                    Instant::now() >= next
                }
                None => ch.counts.wake.wait_until(&mut b, next).timed_out(),
            };
            b.wake_at = 0;
            if timed_out && b.next_due().is_none_or(|d| d > clock::unix_ms()) {
                return Work::none();
            }
        }
    }

    /// Strict calls waiting: sent at once, their answers handed over
    /// before anything else (requests wait for them).
    fn strict(&mut self, ch: &Channel, events: &mut Vec<Event>) {
        if !ch.strict.pending.swap(false, Ordering::AcqRel) {
            return;
        }
        // a key reset before these calls were made is reset before they
        // run (Lua's `reset`, then a count of the key)
        let deletes = ch.counts.batch.lock().take_deletes();
        self.delete(deletes, events);
        let asks = std::mem::take(&mut *ch.strict.asks.lock());
        strict::send_all(&mut self.backends, asks, events);
        // a backend that failed is known down before its answers land: a
        // strict request after them must not wait for it
        for b in self.backends.iter() {
            show_health(ch, b);
        }
        ch.publish(std::mem::take(events));
    }

    /// Deletes, then what is due, per zone.
    fn flush(
        &mut self,
        items: Vec<(ItemId, Item)>,
        deletes: Vec<Delete>,
        deadline: Option<Instant>,
        events: &mut Vec<Event>,
    ) {
        self.delete(deletes, events);
        if items.is_empty() {
            return;
        }
        self.last_flush = Some(Instant::now());
        let mut by_zone: HashMap<u32, Vec<_>> = HashMap::new();
        for (id, item) in items {
            by_zone.entry(id.zone).or_default().push((id, item));
        }
        for b in self.backends.iter_mut() {
            if let Some(items) = by_zone.remove(&b.zone()) {
                // a worker that stops sends its own counts (the sender
                // may be stopping too); one that does not send the zone
                // forwards them to the sender, which wakes for them (a
                // count near its limit goes on at once)
                if b.sends() || deadline.is_some() {
                    b.send(items, deadline, false, events);
                } else {
                    b.forward(items, events);
                }
            }
        }
    }

    /// Keys reset (Lua's `reset`), each by its zone's backend.
    fn delete(&mut self, deletes: Vec<Delete>, events: &mut Vec<Event>) {
        for d in deletes {
            if let Some(b) = self.backends.iter_mut().find(|b| b.zone() == d.zone) {
                b.delete(&d, events);
            }
        }
    }

    /// Each backend's timers (idle checks, retries, refreshes), or, when
    /// stopping, what it still holds for a retry.
    fn timers(
        &mut self,
        ch: &Channel,
        stopping: bool,
        deadline: Option<Instant>,
        events: &mut Vec<Event>,
    ) {
        for b in self.backends.iter_mut() {
            if stopping {
                b.send(Vec::new(), deadline, false, events);
            } else {
                b.tick(events);
            }
            show_health(ch, b);
        }
    }

    /// The strict links the workers asked for, or lost.
    fn links(&mut self, ch: &Channel, events: &mut Vec<Event>) {
        let linked = ch.links.pending.swap(false, Ordering::AcqRel);
        for b in self.backends.iter_mut() {
            let zone = b.zone() as usize;
            if linked {
                let lost = ch.links.lost.get(zone).map_or(0, |f| f.swap(0, Ordering::AcqRel));
                let lost = LinkLoss::from_u8(lost);
                match lost {
                    LinkLoss::TimedOut => b.server.link_timed_out(events),
                    LinkLoss::Closed => b.server.check_now(events),
                    LinkLoss::None => {}
                }
                show_health(ch, b);
                let want = ch.links.want.get(zone).is_some_and(|f| f.swap(false, Ordering::AcqRel));
                if want || lost != LinkLoss::None {
                    b.want_link();
                }
            }
            b.make_link(events);
        }
    }

    /// A full queue drops increments (they stay counted on this node): say
    /// so, rarely.
    fn report_drops(&mut self, ch: &Channel, events: &mut Vec<Event>) {
        let dropped = ch.counts.dropped.load(Ordering::Relaxed);
        if dropped <= self.drops_reported
            || self.drops_logged.is_some_and(|t| t.elapsed() < DROP_LOG_INTERVAL)
        {
            return;
        }
        events.push(Event::Log {
            zone: self.any_zone,
            level: Level::Error,
            message: format!(
                "redis_ratelimit: {} increments dropped: more than {} distinct keys or {} bytes waited for one flush",
                dropped - self.drops_reported,
                ch.counts.bounds.items,
                ch.counts.bounds.bytes
            ),
        });
        self.drops_reported = dropped;
        self.drops_logged = Some(Instant::now());
    }

    /// What waits per zone, for the metrics, every `WAITING_EVERY`.
    fn publish_waiting(&mut self, ch: &Channel) {
        if self.waiting_at.elapsed() < WAITING_EVERY {
            return;
        }
        self.waiting_at = Instant::now();
        let queued: Vec<u64> = {
            let batch = ch.counts.batch.lock();
            self.backends.iter().map(|b| batch.pending(b.zone())).collect()
        };
        let mut orphans = Vec::new();
        for (b, q) in self.backends.iter_mut().zip(queued) {
            if let Some(pid) = b.publish_waiting(q) {
                orphans.push(Event::Orphaned { zone: b.zone(), pid });
            }
        }
        ch.publish(orphans);
    }
}
