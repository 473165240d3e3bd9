//! The background I/O thread of a worker process: it takes the coalesced
//! increments, sends them to Redis as pipelines (`INCRBY cur n`, `GET prev`,
//! `EXPIRE cur 2P` per item) and hands the answers back as events. It never
//! calls an nginx API (nginx is not thread-safe): it talks to the worker only
//! through `Channel` (parking_lot locks, atomics) and a pipe that wakes the
//! worker's event loop.

use std::collections::HashMap;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};
use redis::IntoConnectionInfo;

use crate::batch::{Batch, Delete, Item, ItemId};
use crate::counter::Confirmation;
use crate::key::redis_key;
use crate::params::redact;

/// Increments wait at least this long after a flush, so that a hot key
/// costs one pipeline per interval however many requests it gets.
pub const FLUSH_INTERVAL: Duration = Duration::from_millis(2);
/// Distinct items that may wait for one flush before new ones are dropped.
pub const BATCH_CAPACITY: usize = 1 << 16;
/// Items per pipeline.
const PIPELINE_ITEMS: usize = 1024;
/// Keys near their limit are re-read this often while they are watched, so
/// a node learns what the others counted even when it sends nothing itself.
pub const REFRESH_INTERVAL: Duration = Duration::from_millis(10);
/// How long a key stays watched after this worker last counted it.
const WATCH_FOR: Duration = Duration::from_secs(1);
/// Most keys watched per zone and worker.
const WATCH_MAX: usize = 4096;
/// Most increments kept per zone and worker for sending again once Redis
/// answers (beyond that they are dropped, and stay counted on this node).
const RETRY_MAX: usize = 1 << 16;
/// How long into a window the previous window's count may still grow (late
/// flushes of other workers and nodes): a tenth of the period, at most 2 s.
/// A key's previous window is read at its first flush in a window and once
/// more after that, not on every flush.
fn prev_settle_ms(period: u32) -> u64 {
    (u64::from(period) * 100).min(2000)
}
const BACKOFF_MIN: Duration = Duration::from_millis(100);
const BACKOFF_MAX: Duration = Duration::from_secs(5);
const LOG_INTERVAL: Duration = Duration::from_secs(1);
const DROP_LOG_INTERVAL: Duration = Duration::from_secs(10);

/// A zone with a Redis backend, as the thread needs it.
#[derive(Clone, Debug)]
pub struct ZoneSpec {
    pub index: u32,
    pub name: String,
    pub urls: Vec<String>,
    pub cluster: bool,
    pub prefix: Vec<u8>,
    pub timeout: Duration,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Error,
    Notice,
}

#[derive(Debug)]
pub enum Event {
    Confirmed {
        id: ItemId,
        period: u32,
        limit: u32,
        confirmation: Confirmation,
    },
    Log {
        zone: u32,
        level: Level,
        message: String,
    },
}

/// What a worker and its thread share.
pub struct Channel {
    batch: Mutex<Batch>,
    wake: Condvar,
    stop: AtomicBool,
    events: Mutex<Vec<Event>>,
    notify_fd: RawFd,
    /// Per zone index: whether the last exchange with its backend worked.
    up: Vec<AtomicBool>,
    /// Increments dropped because the batch was full.
    pub dropped: AtomicU64,
    /// An increment of a key near its limit is waiting: flush now.
    urgent: AtomicBool,
    done: Mutex<bool>,
    done_cv: Condvar,
}

impl Channel {
    pub fn new(zones: usize, notify_fd: RawFd) -> Channel {
        Channel {
            batch: Mutex::new(Batch::new(BATCH_CAPACITY)),
            wake: Condvar::new(),
            stop: AtomicBool::new(false),
            events: Mutex::new(Vec::new()),
            notify_fd,
            up: (0..zones).map(|_| AtomicBool::new(true)).collect(),
            dropped: AtomicU64::new(0),
            urgent: AtomicBool::new(false),
            done: Mutex::new(false),
            done_cv: Condvar::new(),
        }
    }

    /// Queues one increment (request path: never blocks on I/O).
    /// Queues one increment. `urgent` (the key is near its limit) skips the
    /// flush pacing: other nodes should learn of it as soon as possible.
    pub fn push(
        &self,
        id: ItemId,
        namespace: &[u8],
        key: &[u8],
        period: u32,
        limit: u32,
        urgent: bool,
    ) -> bool {
        let mut b = self.batch.lock();
        let was_empty = b.is_empty();
        let ok = b.add(id, namespace, key, period, limit);
        if !ok {
            self.dropped.fetch_add(1, Ordering::Relaxed);
        }
        let wake = ok && (was_empty || (urgent && !self.urgent.swap(true, Ordering::AcqRel)));
        drop(b);
        if wake {
            self.wake.notify_one();
        }
        ok
    }

    /// Queues the deletion of a key's Redis counters.
    pub fn delete(&self, d: Delete) -> bool {
        let mut b = self.batch.lock();
        let was_empty = b.is_empty();
        let ok = b.delete(d);
        drop(b);
        if was_empty && ok {
            self.wake.notify_one();
        }
        ok
    }

    pub fn is_up(&self, zone: usize) -> bool {
        self.up.get(zone).is_none_or(|u| u.load(Ordering::Relaxed))
    }

    pub fn take_events(&self) -> Vec<Event> {
        std::mem::take(&mut *self.events.lock())
    }

    /// Asks the thread to stop and waits for it at most `wait`; returns
    /// whether it stopped (then it can be joined without blocking).
    pub fn stop(&self, wait: Duration) -> bool {
        self.stop.store(true, Ordering::Release);
        {
            let _b = self.batch.lock();
            self.wake.notify_all();
        }
        let deadline = Instant::now() + wait;
        let mut done = self.done.lock();
        while !*done {
            if self.done_cv.wait_until(&mut done, deadline).timed_out() {
                return *done;
            }
        }
        true
    }

    fn publish(&self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        self.events.lock().extend(events);
        let byte = 1u8;
        // SAFETY: writes one byte from a valid buffer to the pipe's write end,
        // which stays open until the thread has stopped. The pipe is
        // non-blocking: a full pipe already has a wake-up pending.
        unsafe { libc::write(self.notify_fd, (&raw const byte).cast(), 1) };
    }
}

/// Starts the thread for these zones.
pub fn spawn(channel: Arc<Channel>, zones: Vec<ZoneSpec>) -> std::io::Result<JoinHandle<()>> {
    std::thread::Builder::new()
        .name("redis_ratelimit".into())
        .spawn(move || {
            block_signals();
            let names: Vec<(u32, String)> = zones.iter().map(|z| (z.index, z.name.clone())).collect();
            let outcome = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| run(&channel, zones)));
            if outcome.is_err() {
                // A bug, not an outage: say so, and let the zones count on
                // this node (their on_error policy) from now on.
                let events = names
                    .iter()
                    .map(|(index, name)| {
                        if let Some(up) = channel.up.get(*index as usize) {
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
            *channel.done.lock() = true;
            channel.done_cv.notify_all();
        })
}

/// nginx handles signals in the worker's main thread; this one must not
/// receive any.
fn block_signals() {
    // SAFETY: plain libc calls on a local signal set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut set);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
    }
}

fn run(ch: &Channel, zones: Vec<ZoneSpec>) {
    let mut backends: HashMap<u32, Backend> = zones
        .into_iter()
        .map(|z| (z.index, Backend::new(z)))
        .collect();
    let mut last_flush: Option<Instant> = None;
    let mut drops_reported = 0u64;
    let mut drops_logged: Option<Instant> = None;
    let any_zone = backends.keys().copied().min().unwrap_or(0);
    loop {
        let (items, deletes) = {
            let mut b = ch.batch.lock();
            loop {
                if ch.stop.load(Ordering::Acquire) {
                    return;
                }
                if b.is_empty() {
                    // Idle: sleep until woken, unless keys near their limit
                    // are watched (wake up to refresh them) or a backend is
                    // down (wake up to probe it: with on_error=allow or deny
                    // nothing is counted, so nothing else would notice it is
                    // back).
                    let now = Instant::now();
                    let mut next: Option<Instant> = None;
                    for be in backends.values() {
                        for t in [be.next_refresh(now), be.next_probe()]
                            .into_iter()
                            .flatten()
                        {
                            next = Some(next.map_or(t, |n: Instant| n.min(t)));
                        }
                    }
                    match next {
                        Some(t) => {
                            if ch.wake.wait_until(&mut b, t.max(now)).timed_out() && b.is_empty() {
                                break (Vec::new(), Vec::new());
                            }
                        }
                        None => ch.wake.wait(&mut b),
                    }
                    continue;
                }
                let ready = last_flush.map_or(Duration::MAX, |t| t.elapsed());
                if ready >= FLUSH_INTERVAL || ch.urgent.swap(false, Ordering::AcqRel) {
                    break b.drain();
                }
                ch.wake.wait_for(&mut b, FLUSH_INTERVAL - ready);
            }
        };

        let mut events = Vec::new();
        for d in deletes {
            if let Some(b) = backends.get_mut(&d.zone) {
                b.delete(&d, &mut events);
            }
        }
        if !items.is_empty() {
            last_flush = Some(Instant::now());
            let mut by_zone: HashMap<u32, Vec<(ItemId, Item)>> = HashMap::new();
            for (id, item) in items {
                by_zone.entry(id.zone).or_default().push((id, item));
            }
            for (zone, items) in by_zone {
                let Some(b) = backends.get_mut(&zone) else {
                    continue;
                };
                let items = b.with_retry(items);
                for chunk in items.chunks(PIPELINE_ITEMS) {
                    b.flush(chunk, &mut events);
                }
            }
        }

        for (zone, b) in backends.iter_mut() {
            b.probe(&mut events);
            if b.healthy && !b.retry.is_empty() {
                let items = b.with_retry(Vec::new());
                for chunk in items.chunks(PIPELINE_ITEMS) {
                    b.flush(chunk, &mut events);
                }
            }
            b.refresh(&mut events);
            if let Some(up) = ch.up.get(*zone as usize) {
                up.store(b.healthy, Ordering::Relaxed);
            }
        }
        // A full queue drops increments (they stay counted on this node):
        // say so, rarely.
        let dropped = ch.dropped.load(Ordering::Relaxed);
        if dropped > drops_reported && drops_logged.is_none_or(|t| t.elapsed() >= DROP_LOG_INTERVAL)
        {
            events.push(Event::Log {
                zone: any_zone,
                level: Level::Error,
                message: format!(
                    "redis_ratelimit: {} increments dropped: more than {} distinct keys waited for one flush",
                    dropped - drops_reported,
                    BATCH_CAPACITY
                ),
            });
            drops_reported = dropped;
            drops_logged = Some(Instant::now());
        }
        ch.publish(events);
    }
}

/// A key this worker counted recently that is near its limit.
struct Watch {
    namespace: Vec<u8>,
    key: Vec<u8>,
    period: u32,
    limit: u32,
    /// Last time Redis told us its counts (flush or refresh).
    fresh: Instant,
    /// Watched until then (extended by each flush of the key).
    until: Instant,
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}

/// Whether counts put a key at or above half its limit.
fn near_limit(c: &Confirmation, period: u32, limit: u32, now_ms: u64) -> bool {
    let p = u64::from(period) * 1000;
    let idx = crate::window::window_index(now_ms, p);
    let (prev, cur) = if idx == c.window {
        (c.prev, c.cur)
    } else if idx == c.window + 1 {
        (c.cur, 0)
    } else {
        return false;
    };
    let clamp = |v: u64| v.min(u64::from(u32::MAX)) as u32;
    let est = crate::window::Estimate::new(clamp(prev), clamp(cur), now_ms - idx * p, p);
    !est.below(limit.div_ceil(2))
}

enum Conn {
    Single(redis::Connection),
    Cluster(Box<redis::cluster::ClusterConnection>),
}

struct Backend {
    spec: ZoneSpec,
    conn: Option<Conn>,
    retry_at: Option<Instant>,
    backoff: Duration,
    healthy: bool,
    last_log: Option<Instant>,
    suppressed: u64,
    secrets: Vec<String>,
    watch: HashMap<ItemId, Watch>,
    /// Increments whose pipeline failed, sent again with the next flush.
    retry: HashMap<ItemId, Item>,
    /// (key, window) counters whose EXPIRE this connection already set:
    /// one EXPIRE per counter and window is enough. Cleared on reconnect (a
    /// restarted Redis may have lost the TTL with the key).
    expiring: std::collections::HashSet<ItemId>,
    /// Counts of previous windows already read: (count, final). Final once
    /// read after `prev_settle_ms` into the window.
    prev_final: HashMap<ItemId, (u64, bool)>,
}

impl Backend {
    fn new(spec: ZoneSpec) -> Backend {
        let secrets = spec
            .urls
            .iter()
            .filter_map(|u| u.as_str().into_connection_info().ok())
            .filter_map(|ci| ci.redis_settings().password().map(str::to_string))
            .filter(|p| !p.is_empty())
            .collect();
        Backend {
            spec,
            conn: None,
            retry_at: None,
            backoff: BACKOFF_MIN,
            healthy: true,
            last_log: None,
            suppressed: 0,
            secrets,
            watch: HashMap::new(),
            retry: HashMap::new(),
            expiring: std::collections::HashSet::new(),
            prev_final: HashMap::new(),
        }
    }

    /// Keeps the increments of a failed pipeline for the next flush. Redis
    /// may have run a pipeline whose reply timed out: sending it again then
    /// counts twice, which errs on the side of the limit; dropping it would
    /// hide this node's traffic from the others for good.
    fn keep_for_retry(&mut self, items: &[(ItemId, Item)]) {
        for (id, item) in items.iter().filter(|(_, i)| i.n > 0) {
            if let Some(r) = self.retry.get_mut(id) {
                r.n = r.n.saturating_add(item.n);
                r.limit = r.limit.min(item.limit);
            } else if self.retry.len() < RETRY_MAX {
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

    /// When watched keys need their next refresh.
    fn next_refresh(&self, now: Instant) -> Option<Instant> {
        if self.watch.is_empty() || !self.healthy {
            return None;
        }
        Some(now + REFRESH_INTERVAL)
    }

    /// When a backend that is down should be tried again.
    fn next_probe(&self) -> Option<Instant> {
        if self.healthy {
            return None;
        }
        self.retry_at
    }

    /// Tries a backend that is down once its backoff has passed: connects
    /// and sends PING.
    fn probe(&mut self, events: &mut Vec<Event>) {
        if self.healthy || self.retry_at.is_some_and(|t| Instant::now() < t) {
            return;
        }
        if !self.ensure_conn(events) {
            return;
        }
        // A single command: a cluster pipeline refuses PING.
        let ping = redis::cmd("PING");
        let result: redis::RedisResult<redis::Value> = match self.conn.as_mut() {
            Some(Conn::Single(con)) => ping.query(con),
            Some(Conn::Cluster(con)) => ping.query(&mut **con),
            None => return,
        };
        match result {
            Ok(_) => self.recovered(events),
            Err(e) => self.failed("sending to", &e, events),
        }
    }

    /// Re-reads the counts of watched keys not confirmed in the last
    /// `REFRESH_INTERVAL`, and forgets the ones no longer watched.
    fn refresh(&mut self, events: &mut Vec<Event>) {
        let now = Instant::now();
        self.watch.retain(|_, w| w.until > now);
        if self.watch.is_empty() || !self.healthy {
            return;
        }
        let now_ms = unix_ms();
        let due: Vec<(ItemId, Item)> = self
            .watch
            .iter()
            .filter(|(_, w)| now.duration_since(w.fresh) >= REFRESH_INTERVAL)
            .map(|(id, w)| {
                let p = u64::from(w.period) * 1000;
                let mut id = *id;
                id.window = crate::window::window_index(now_ms, p);
                (
                    id,
                    Item {
                        namespace: w.namespace.clone(),
                        key: w.key.clone(),
                        period: w.period,
                        limit: w.limit,
                        n: 0,
                    },
                )
            })
            .collect();
        for chunk in due.chunks(PIPELINE_ITEMS) {
            self.flush(chunk, events);
        }
    }

    fn describe(&self) -> String {
        self.spec
            .urls
            .iter()
            .map(|u| redact(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn scrub(&self, mut text: String) -> String {
        for s in &self.secrets {
            text = text.replace(s.as_str(), "***");
        }
        text
    }

    fn connect(&mut self) -> redis::RedisResult<Conn> {
        self.expiring.clear();
        self.prev_final.clear();
        let t = self.spec.timeout;
        if self.spec.cluster {
            let client = redis::cluster::ClusterClient::builder(self.spec.urls.clone())
                .connection_timeout(t)
                .response_timeout(t)
                .retries(1)
                .build()?;
            Ok(Conn::Cluster(Box::new(client.get_connection()?)))
        } else {
            let client = redis::Client::open(self.spec.urls[0].as_str())?;
            let con = client.get_connection_with_timeout(t)?;
            con.set_read_timeout(Some(t))?;
            con.set_write_timeout(Some(t))?;
            Ok(Conn::Single(con))
        }
    }

    fn failed(&mut self, what: &str, err: &redis::RedisError, events: &mut Vec<Event>) {
        self.conn = None;
        self.retry_at = Some(Instant::now() + self.backoff);
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        let first = self.healthy;
        self.healthy = false;
        let due = self.last_log.is_none_or(|t| t.elapsed() >= LOG_INTERVAL);
        if first || due {
            let extra = if self.suppressed > 0 {
                format!(" ({} more errors since the last report)", self.suppressed)
            } else {
                String::new()
            };
            let message = self.scrub(format!(
                "redis_ratelimit: zone \"{}\": {} {} failed: {}{}",
                self.spec.name,
                what,
                self.describe(),
                err,
                extra
            ));
            events.push(Event::Log {
                zone: self.spec.index,
                level: Level::Error,
                message,
            });
            self.last_log = Some(Instant::now());
            self.suppressed = 0;
        } else {
            self.suppressed += 1;
        }
    }

    fn recovered(&mut self, events: &mut Vec<Event>) {
        // A cluster coming back answers on some nodes before it serves all
        // slots: call it back only once it says so, or it would flap.
        if !self.healthy && !self.cluster_ok() {
            return;
        }
        self.backoff = BACKOFF_MIN;
        self.retry_at = None;
        if !self.healthy {
            self.healthy = true;
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

    /// For a cluster, whether a node reports `cluster_state:ok`; true for a
    /// single Redis.
    fn cluster_ok(&mut self) -> bool {
        let Some(Conn::Cluster(con)) = self.conn.as_mut() else {
            return true;
        };
        let info: redis::RedisResult<String> = redis::cmd("CLUSTER").arg("INFO").query(&mut **con);
        info.is_ok_and(|text| text.contains("cluster_state:ok"))
    }

    fn flush(&mut self, items: &[(ItemId, Item)], events: &mut Vec<Event>) {
        if !self.ensure_conn(events) {
            // backing off or unreachable: sent with the first flush after it
            self.keep_for_retry(items);
            return;
        }
        let groups = self.commands(items);
        let has_prev: Vec<bool> = groups.iter().map(Group::has_prev).collect();
        let result = match self.conn.as_mut() {
            Some(Conn::Cluster(con)) => exec_cluster_items(con, groups),
            Some(_) => {
                let cmds = groups
                    .into_iter()
                    .flat_map(|g| g.cmds)
                    .map(|(c, role)| (c, role == Role::Expire))
                    .collect();
                match self.exec(cmds) {
                    Some(r) => r.map(|values| per_group(&has_prev, values)),
                    None => return,
                }
            }
            None => return,
        };
        match result {
            Ok(values) => {
                self.recovered(events);
                if self.expiring.len() > 4 * BATCH_CAPACITY {
                    self.expiring.clear();
                }
                self.expiring
                    .extend(items.iter().filter(|(_, i)| i.n > 0).map(|(id, _)| *id));
                let now = Instant::now();
                let now_ms = unix_ms();
                if self.prev_final.len() > 4 * BATCH_CAPACITY {
                    self.prev_final.clear();
                }
                for ((id, item), (cur, prev)) in items.iter().zip(values) {
                    let cur = as_count(&cur);
                    let prev = match prev {
                        Some(v) => {
                            let prev = as_count(&v);
                            // late increments of the previous window arrive
                            // within a flush or two of its end: read after
                            // the settle time, its count is final
                            let start = id.window * u64::from(item.period) * 1000;
                            let settled = now_ms >= start + prev_settle_ms(item.period);
                            if item.n > 0 {
                                self.prev_final.insert(*id, (prev, settled));
                            }
                            prev
                        }
                        None => self.prev_final.get(id).map_or(0, |(v, _)| *v),
                    };
                    let confirmation = Confirmation {
                        window: id.window,
                        sent: item.n,
                        cur,
                        prev,
                    };
                    let mut wid = *id;
                    wid.window = 0;
                    if let Some(w) = self.watch.get_mut(&wid) {
                        w.fresh = now;
                        if item.n > 0 {
                            w.until = now + WATCH_FOR;
                        }
                    } else if item.n > 0
                        && self.watch.len() < WATCH_MAX
                        && near_limit(&confirmation, item.period, item.limit, now_ms)
                    {
                        self.watch.insert(
                            wid,
                            Watch {
                                namespace: item.namespace.clone(),
                                key: item.key.clone(),
                                period: item.period,
                                limit: item.limit,
                                fresh: now,
                                until: now + WATCH_FOR,
                            },
                        );
                    }
                    events.push(Event::Confirmed {
                        id: *id,
                        period: item.period,
                        limit: item.limit,
                        confirmation,
                    });
                }
            }
            Err(e) => {
                self.failed("sending to", &e, events);
                self.keep_for_retry(items);
            }
        }
    }

    /// A connection, unless backing off or connecting fails (then false).
    fn ensure_conn(&mut self, events: &mut Vec<Event>) -> bool {
        if self.conn.is_some() {
            return true;
        }
        if self.retry_at.is_some_and(|t| Instant::now() < t) {
            return false;
        }
        match self.connect() {
            Ok(c) => {
                self.conn = Some(c);
                true
            }
            Err(e) => {
                self.failed("connecting to", &e, events);
                false
            }
        }
    }

    /// Sends the commands as one pipeline (per node, in a cluster).
    fn exec(
        &mut self,
        cmds: Vec<(redis::Cmd, bool)>,
    ) -> Option<redis::RedisResult<Vec<redis::Value>>> {
        match self.conn.as_mut()? {
            Conn::Single(con) => {
                let mut p = redis::pipe();
                for c in cmds {
                    add(&mut p, c);
                }
                Some(p.query(con))
            }
            Conn::Cluster(con) => {
                let mut p = redis::cluster::cluster_pipe();
                for c in cmds {
                    add_cluster(&mut p, c);
                }
                Some(p.query(con))
            }
        }
    }

    /// Deletes both windows of a key (Lua's `reset`). Best effort: a failure
    /// is logged like any other.
    fn delete(&mut self, d: &Delete, events: &mut Vec<Event>) {
        // counted before the reset: forget them too
        self.retry.retain(|id, _| id.entry != d.entry);
        self.expiring.retain(|id| id.entry != d.entry);
        self.prev_final.retain(|id, _| id.entry != d.entry);
        self.watch.retain(|id, _| id.entry != d.entry);
        if !self.ensure_conn(events) {
            return;
        }
        let p = u64::from(d.period);
        let keys: Vec<Vec<u8>> = [d.window, d.window.saturating_sub(1)]
            .iter()
            .map(|w| redis_key(&self.spec.prefix, &d.namespace, &d.key, d.period, w * p))
            .collect();
        // One DEL per key: in a cluster each command goes to its node.
        let cmds: Vec<(redis::Cmd, bool)> = keys
            .iter()
            .map(|k| {
                let mut c = redis::cmd("DEL");
                c.arg(k);
                (c, false)
            })
            .collect();
        let Some(result) = self.exec(cmds) else {
            return;
        };
        match result {
            Ok(_) => self.recovered(events),
            Err(e) => self.failed("sending to", &e, events),
        }
    }

    /// Per item: the command whose reply is the current window's count
    /// (`INCRBY`, or `GET` for a refresh), `GET` of the previous window
    /// unless its count is already known to be final, and `EXPIRE` once per
    /// counter and window.
    fn commands(&self, items: &[(ItemId, Item)]) -> Vec<Group> {
        let now_ms = unix_ms();
        let mut all = Vec::with_capacity(items.len());
        for (id, item) in items {
            let mut out = Vec::with_capacity(3);
            let ns = &item.namespace;
            let p = u64::from(item.period);
            let cur = redis_key(&self.spec.prefix, ns, &item.key, item.period, id.window * p);
            let prev = redis_key(
                &self.spec.prefix,
                ns,
                &item.key,
                item.period,
                id.window.saturating_sub(1) * p,
            );
            let mut get = redis::cmd("GET");
            get.arg(&prev);
            if item.n == 0 {
                // a refresh: read both windows, change nothing
                let mut get_cur = redis::cmd("GET");
                get_cur.arg(&cur);
                out.push((get_cur, Role::Cur));
                out.push((get, Role::Prev));
                all.push(Group {
                    incr: false,
                    cur,
                    cmds: out,
                });
                continue;
            }
            let mut incr = redis::cmd("INCRBY");
            incr.arg(&cur).arg(item.n);
            out.push((incr, Role::Cur));
            let settled = now_ms >= id.window * p * 1000 + prev_settle_ms(item.period);
            match self.prev_final.get(id) {
                Some((_, true)) => {}
                Some((_, false)) if !settled => {}
                _ => out.push((get, Role::Prev)),
            }
            if !self.expiring.contains(id) {
                let mut expire = redis::cmd("EXPIRE");
                expire.arg(&cur).arg(2 * p);
                out.push((expire, Role::Expire));
            }
            all.push(Group {
                incr: true,
                cur,
                cmds: out,
            });
        }
        all
    }
}

/// What a command of an item is for.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    /// `INCRBY` (or a refresh's `GET`): its reply is the current count.
    Cur,
    /// `GET` of the previous window.
    Prev,
    /// `EXPIRE`: its reply is ignored.
    Expire,
}

/// The commands of one item.
struct Group {
    /// Whether the `Cur` command is `INCRBY` (else a refresh's `GET`).
    incr: bool,
    /// The current window's key.
    cur: Vec<u8>,
    cmds: Vec<(redis::Cmd, Role)>,
}

impl Group {
    fn has_prev(&self) -> bool {
        self.cmds.iter().any(|(_, r)| *r == Role::Prev)
    }
}

/// Splits a pipeline's replies (ignored `EXPIRE`s left out) into the
/// (current, previous) counts of each group; `None` where no `GET` of the
/// previous window was sent.
fn per_group(
    has_prev: &[bool],
    values: Vec<redis::Value>,
) -> Vec<(redis::Value, Option<redis::Value>)> {
    let mut it = values.into_iter();
    has_prev
        .iter()
        .map(|&p| {
            let cur = it.next().unwrap_or(redis::Value::Nil);
            let prev = if p { it.next() } else { None };
            (cur, prev)
        })
        .collect()
}

/// Runs the item groups on a cluster as one pipeline (grouped per node by
/// redis-rs). When the topology moved under it (MOVED, ASK, TRYAGAIN,
/// CLUSTERDOWN replies: those commands were not run), the failed commands
/// are sent again one by one, which follows redirections, and the counts of
/// the items whose `INCRBY` did run are read back with `GET`. Returns two
/// values per item, like a plain pipeline whose `EXPIRE`s are ignored.
fn exec_cluster_items(
    con: &mut redis::cluster::ClusterConnection,
    groups: Vec<Group>,
) -> redis::RedisResult<Vec<(redis::Value, Option<redis::Value>)>> {
    let has_prev: Vec<bool> = groups.iter().map(Group::has_prev).collect();
    let mut p = redis::cluster::cluster_pipe();
    for g in &groups {
        for (c, role) in &g.cmds {
            add_cluster(&mut p, (c.clone(), *role == Role::Expire));
        }
    }
    let err = match p.query::<Vec<redis::Value>>(con) {
        Ok(v) => return Ok(per_group(&has_prev, v)),
        Err(e) => e,
    };
    let redirected = |k: Option<redis::ServerErrorKind>| {
        matches!(
            k,
            Some(
                redis::ServerErrorKind::Moved
                    | redis::ServerErrorKind::Ask
                    | redis::ServerErrorKind::TryAgain
                    | redis::ServerErrorKind::ClusterDown
            )
        )
    };
    let failed: std::collections::HashSet<usize> = match err.clone().into_server_errors() {
        Some(errs) if !errs.is_empty() && errs.iter().all(|(_, e)| redirected(e.kind())) => {
            errs.iter().map(|(i, _)| *i).collect()
        }
        _ => return Err(err),
    };
    let mut out = Vec::with_capacity(groups.len());
    let mut index = 0;
    for g in groups {
        let mut cur = redis::Value::Nil;
        let mut prev = None;
        for (cmd, role) in g.cmds {
            let i = index;
            index += 1;
            match role {
                Role::Cur if g.incr && !failed.contains(&i) => {
                    // it ran: read the count it left
                    cur = redis::cmd("GET").arg(&g.cur).query(con)?;
                }
                Role::Cur => cur = cmd.query(con)?,
                Role::Prev => prev = Some(cmd.query(con)?),
                Role::Expire => {
                    if failed.contains(&i) {
                        cmd.query::<redis::Value>(con)?;
                    }
                }
            }
        }
        out.push((cur, prev));
    }
    Ok(out)
}

fn add(p: &mut redis::Pipeline, (cmd, ignore): (redis::Cmd, bool)) {
    p.add_command(cmd);
    if ignore {
        p.ignore();
    }
}

fn add_cluster(p: &mut redis::cluster::ClusterPipeline, (cmd, ignore): (redis::Cmd, bool)) {
    p.add_command(cmd);
    if ignore {
        p.ignore();
    }
}

/// An `INCRBY` reply or a `GET` of a counter; anything unexpected counts 0.
fn as_count(v: &redis::Value) -> u64 {
    match v {
        redis::Value::Int(n) => (*n).max(0) as u64,
        redis::Value::BulkString(b) => std::str::from_utf8(b)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .unwrap_or(0),
        _ => 0,
    }
}
