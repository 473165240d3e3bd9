//! The background I/O thread of a worker process: it takes the coalesced
//! increments, sends them to Redis as pipelines and hands the answers back
//! as events. It never calls an nginx API (nginx is not thread-safe): it
//! talks to the worker only through `Channel` (parking_lot locks, atomics)
//! and a pipe that wakes the worker's event loop.
//!
//! Per item a flush sends `INCRBY cur n`; `GET prev` from a key's second
//! flush in a window until that count is final; and `EXPIRE cur 2P` when the
//! `INCRBY` reply shows it created the key (reply = n), so that no counter
//! lives without a TTL, also after a `DEL`. Each reply is handled on its own
//! (see `send.rs`): an error reply fails that item only.

mod clock;
mod controls;
mod event;
mod fleet;
mod io;
mod link;
mod process;
mod refresh;
mod retry;
mod ring;
mod run;
mod send;
mod server;
mod signals;
mod strict;
mod zone;

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

pub use ratelimit_core::batch::Increment;
use ratelimit_core::batch::{Batch, Bounds, Delete, ItemId};
use ratelimit_core::control::Change;
use ratelimit_core::counter;
use ratelimit_core::sync::Due;

pub use event::{Event, Level, StatsRef, StrictAsk, StrictGroup, ZoneSpec};
pub use io::Tls;
pub use process::{holder, process_alive};
pub use ring::{RingHeader, RingRef};
pub use zone::Backend;

/// Increments wait at least this long after a flush, so that a hot key
/// costs one pipeline per interval however many requests it gets.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(2);
/// How often a worker that does not send a zone forwards the counts its
/// worker made to the node's sender (a count near its limit goes at once).
pub const FORWARD_EVERY: Duration = Duration::from_millis(10);
/// Items due this soon after the first one go with it (fewer, fuller
/// pipelines; a little early is harmless).
pub const DUE_SLACK_MS: u64 = 10;
/// At most this many items that waited go per flush: many keys due at
/// once (the end of a window) go in several flushes, and what must go at
/// once (a key near its limit) never waits behind a large pipeline.
pub const DUE_CHUNK: usize = 512;
/// How often the thread publishes its waiting increments (metrics).
const WAITING_EVERY: Duration = Duration::from_millis(100);
/// How long the thread may spend sending what it holds when it is asked to
/// stop (worker exit, reload).
pub const STOP_FLUSH: Duration = Duration::from_secs(1);
const DROP_LOG_INTERVAL: Duration = Duration::from_secs(10);
/// How a worker's strict link failed (`Channel::link_lost`), the worse
/// of two failures the larger.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
enum LinkLoss {
    /// Not lost since the thread last looked.
    None = 0,
    /// Closed or broken: the thread checks the backend at once.
    Closed = 1,
    /// No answer within `timeout=`: the backend is down.
    TimedOut = 2,
}

impl LinkLoss {
    fn from_u8(v: u8) -> LinkLoss {
        match v {
            1 => LinkLoss::Closed,
            2 => LinkLoss::TimedOut,
            _ => LinkLoss::None,
        }
    }
}

/// What a worker and its thread share, by what it carries.
pub struct Channel {
    counts: Counts,
    strict: StrictQueue,
    controls: ControlQueue,
    links: LinkRequests,
    health: ZoneHealth,
    events: Events,
    /// The worker asks the thread to stop (after sending what it holds).
    stop: AtomicBool,
    done: Done,
}

/// The increments waiting for the thread, and how it is woken for them.
struct Counts {
    batch: Mutex<Batch>,
    bounds: Bounds,
    wake: Condvar,
    /// An increment of a key near its limit is waiting: flush now.
    urgent: AtomicBool,
    /// Increments dropped because the batch was full.
    dropped: AtomicU64,
    /// The ring the thread sleeps on now, if any (`wake_thread`).
    sleeps_on: Mutex<Option<RingRef>>,
}

/// Strict requests' limits waiting to be decided in Redis.
struct StrictQueue {
    asks: Mutex<Vec<StrictAsk>>,
    /// `asks` is not empty: the thread sends it at once.
    pending: AtomicBool,
}

/// Changes of zones' controls the worker made, for Redis.
struct ControlQueue {
    changes: Mutex<Vec<(u32, Change)>>,
    /// `changes` is not empty: the thread writes them at once.
    pending: AtomicBool,
}

/// What the worker asks of the thread about its strict links, per zone
/// index.
struct LinkRequests {
    /// The worker wants a strict link (`link.rs`).
    want: Vec<AtomicBool>,
    /// The worker's strict link failed (a `LinkLoss`).
    lost: Vec<AtomicU8>,
    /// One of the two above is set.
    pending: AtomicBool,
}

/// What the thread says of each zone's backend, per zone index.
struct ZoneHealth {
    /// Whether its backend is up (transport works).
    up: Vec<AtomicBool>,
    /// How long (ms) a key's increments may wait for an answer before the
    /// node's view of the key counts as stale (`counter::stale_after_ms`
    /// of the zone's usual round trip).
    stale_ms: Vec<AtomicU32>,
}

/// What the thread hands back, and the pipe that wakes the worker for it.
struct Events {
    list: Mutex<Vec<Event>>,
    notify_fd: RawFd,
}

/// The thread has ended.
struct Done {
    flag: Mutex<bool>,
    cv: Condvar,
}

impl Channel {
    pub fn new(zones: usize, notify_fd: RawFd, bounds: Bounds) -> Channel {
        Channel {
            counts: Counts {
                batch: Mutex::new(Batch::new(bounds.items, bounds.bytes)),
                bounds,
                wake: Condvar::new(),
                urgent: AtomicBool::new(false),
                dropped: AtomicU64::new(0),
                sleeps_on: Mutex::new(None),
            },
            strict: StrictQueue { asks: Mutex::new(Vec::new()), pending: AtomicBool::new(false) },
            controls: ControlQueue {
                changes: Mutex::new(Vec::new()),
                pending: AtomicBool::new(false),
            },
            links: LinkRequests {
                want: (0..zones).map(|_| AtomicBool::new(false)).collect(),
                lost: (0..zones).map(|_| AtomicU8::new(0)).collect(),
                pending: AtomicBool::new(false),
            },
            health: ZoneHealth {
                up: (0..zones).map(|_| AtomicBool::new(true)).collect(),
                stale_ms: (0..zones)
                    .map(|_| AtomicU32::new(counter::STALE_MIN_MS as u32))
                    .collect(),
            },
            events: Events { list: Mutex::new(Vec::new()), notify_fd },
            stop: AtomicBool::new(false),
            done: Done { flag: Mutex::new(false), cv: Condvar::new() },
        }
    }

    /// Queues one increment (request path: never blocks on I/O), to reach
    /// Redis as `send` says (`ratelimit_core::sync`). One that must go at
    /// once skips the flush pacing: other nodes should learn of it as soon
    /// as possible. The thread is woken only when the increment is due
    /// before it planned to wake, or when what waits holds more bytes than
    /// the hold budget.
    #[inline]
    pub fn push(&self, id: ItemId, inc: Increment<'_>, send: Due) -> bool {
        let mut b = self.counts.batch.lock();
        let added = b.add(id, &inc, send);
        let (ok, due) = (added.is_some(), added.unwrap_or(u64::MAX));
        if !ok {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
        let first_urgent = ok && due == 0 && !self.counts.urgent.swap(true, Ordering::AcqRel);
        // what waits crossed the hold budget: the thread sends the longest
        // held now (it may sleep until the earliest is due, seconds away,
        // while a spray of new keys fills the batch)
        let over = ok && b.wake_at > 1 && b.bytes() > self.counts.bounds.hold;
        let wake = over || ok && due < b.wake_at && (due > 0 || first_urgent);
        if wake {
            // it plans anew when woken
            b.wake_at = 0;
        }
        drop(b);
        if wake {
            self.wake_thread();
        }
        ok
    }

    pub fn delete(&self, d: Delete) -> bool {
        let mut b = self.counts.batch.lock();
        let ok = b.delete(d);
        // a delete is due at once
        let wake = ok && b.wake_at > 0;
        if wake {
            b.wake_at = 0;
        }
        drop(b);
        if wake {
            self.wake_thread();
        }
        ok
    }

    /// Queues strict requests' limits for the thread, which sends them at
    /// once (no flush pacing: a request waits for the answer).
    pub fn push_strict(&self, asks: impl IntoIterator<Item = StrictAsk>) {
        self.strict.asks.lock().extend(asks);
        self.strict.pending.store(true, Ordering::Release);
        // under the batch lock: the thread is either waiting (and woken) or
        // about to look at `strict_pending`
        let _b = self.counts.batch.lock();
        self.wake_thread();
    }

    /// Queues a change of a zone's controls for Redis (written at once).
    pub fn push_control(&self, zone: usize, change: Change) {
        self.controls.changes.lock().push((zone as u32, change));
        self.controls.pending.store(true, Ordering::Release);
        let _b = self.counts.batch.lock();
        self.wake_thread();
    }

    /// Asks the thread for a strict link for a zone again (the worker could
    /// not take the one it was handed).
    pub fn want_link(&self, zone: usize) {
        if let Some(f) = self.links.want.get(zone) {
            f.store(true, Ordering::Release);
            self.wake_for_links();
        }
    }

    /// The worker's strict link of a zone failed. No answer within the
    /// zone's `timeout=` takes the backend down, as the thread's own
    /// exchanges do (strict requests stop waiting for it); a link closed
    /// or broken otherwise makes the thread check the backend at once.
    pub fn link_lost(&self, zone: usize, timed_out: bool) {
        if timed_out {
            // down for the worker at once: the thread may be busy (a check
            // of its own hanging on the same server) before it hears of it
            if let Some(up) = self.health.up.get(zone) {
                up.store(false, Ordering::Relaxed);
            }
        }
        if let Some(f) = self.links.lost.get(zone) {
            let loss = if timed_out { LinkLoss::TimedOut } else { LinkLoss::Closed };
            f.fetch_max(loss as u8, Ordering::AcqRel);
            self.wake_for_links();
        }
    }

    fn wake_for_links(&self) {
        self.links.pending.store(true, Ordering::Release);
        let _b = self.counts.batch.lock();
        self.wake_thread();
    }

    /// Wakes the thread, on its condition variable or, while it sleeps on
    /// a zone's ring (it sends the zone: `run.rs`), there.
    fn wake_thread(&self) {
        self.counts.wake.notify_one();
        if let Some(ring) = *self.counts.sleeps_on.lock() {
            ring.wake();
        }
    }

    /// See `stale_ms` (the field).
    #[inline]
    pub fn stale_ms(&self, zone: usize) -> u64 {
        self.health
            .stale_ms
            .get(zone)
            .map_or(counter::STALE_MIN_MS, |s| u64::from(s.load(Ordering::Relaxed)))
    }

    pub fn is_up(&self, zone: usize) -> bool {
        self.health.up.get(zone).is_none_or(|u| u.load(Ordering::Relaxed))
    }

    pub fn take_events(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.list.lock())
    }

    /// Asks the thread to stop (after sending what it holds, for at most
    /// `STOP_FLUSH`) and waits for it at most `wait`; returns whether it
    /// stopped (then it can be joined without blocking).
    pub fn stop(&self, wait: Duration) -> bool {
        self.stop.store(true, Ordering::Release);
        {
            let _b = self.counts.batch.lock();
            self.counts.wake.notify_all();
            self.wake_thread();
        }
        let deadline = Instant::now() + wait;
        let mut done = self.done.flag.lock();
        while !*done {
            if self.done.cv.wait_until(&mut done, deadline).timed_out() {
                return *done;
            }
        }
        true
    }

    fn publish(&self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        self.events.list.lock().extend(events);
        let byte = 1u8;
        // SAFETY: writes one byte from a valid buffer to the pipe's write end,
        // which stays open until the thread has stopped. The pipe is
        // non-blocking: a full pipe already has a wake-up pending.
        unsafe { libc::write(self.events.notify_fd, (&raw const byte).cast(), 1) };
    }
}

/// Starts the thread for these zones. Every signal is blocked in the
/// calling thread while the new one is created, so that it starts with all
/// of them blocked: nginx handles signals in the worker's main thread.
pub fn spawn(channel: Arc<Channel>, zones: Vec<ZoneSpec>) -> std::io::Result<JoinHandle<()>> {
    let saved = signals::block_all();
    let spawned = std::thread::Builder::new()
        .name("redis_ratelimit".into())
        .spawn(move || {
            let names: Vec<(u32, String)> = zones.iter().map(|z| (z.index, z.name.clone())).collect();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run::run(&channel, zones)));
            if outcome.is_err() {
                // A bug, not an outage: say so, and let the zones count on
                // this node (their on_error policy) from now on.
                let events = names
                    .iter()
                    .map(|(index, name)| {
                        if let Some(up) = channel.health.up.get(*index as usize) {
                            up.store(false, Ordering::Relaxed);
                        }
                        Event::Log {
                            zone: *index,
                            level: Level::Error,
                            message: format!(
                                "redis_ratelimit: zone \"{name}\": the background thread failed; counting on this node only until the worker restarts"
                            ),
                        }
                    })
                    .collect();
                channel.publish(events);
            }
            *channel.done.flag.lock() = true;
            channel.done.cv.notify_all();
        });
    signals::restore(&saved);
    spawned
}

/// Whether a backend is up, for the worker (strict requests, `on_error`)
/// and the metrics, and how long a view may wait for an answer: the
/// zone's sender works them out and puts them in shared memory; a thread
/// that does not send reads them there (and is down as well when its own
/// strict calls found Redis down).
pub(super) fn show_health(ch: &Channel, b: &Backend) {
    let st = b.stats();
    let (up, ms) = if b.sends() {
        let ms = counter::stale_after_ms(b.server.rtt.usual_us());
        if let Some(st) = st {
            st.backend_up.store(u64::from(b.is_up()), Ordering::Relaxed);
            st.down.store(u64::from(!b.is_up()), Ordering::Relaxed);
            st.stale_ms.store(ms, Ordering::Relaxed);
        }
        (b.is_up(), ms)
    } else {
        let shared_up = st.is_none_or(|s| s.down.load(Ordering::Relaxed) == 0);
        let ms = st.map_or(0, |s| s.stale_ms.load(Ordering::Relaxed));
        (shared_up && b.server.health.is_up(), if ms == 0 { counter::STALE_MIN_MS } else { ms })
    };
    if let Some(u) = ch.health.up.get(b.zone() as usize) {
        u.store(up, Ordering::Relaxed);
    }
    if let Some(s) = ch.health.stale_ms.get(b.zone() as usize) {
        s.store(u32::try_from(ms).unwrap_or(u32::MAX), Ordering::Relaxed);
    }
}
