//! One zone's backend in the thread: what it holds (connection, health,
//! increments to send again, keys to refresh, TTLs to set again, what it
//! knows of previous windows, the cluster's masters) and its bounds. What
//! it does with them: `zone.rs` (periodic work, logs), `flush.rs` (what a
//! flush sends, how each reply is read), `refresh.rs` (keys near their
//! limit), `cluster.rs` (one pipeline per master).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ratelimit_core::batch::{Item, ItemMap};
use ratelimit_core::counter::RoundTrip;
use ratelimit_core::health::{Budget, Health, LogGate};
use ratelimit_core::slots::Topology;
use ratelimit_core::stats::Stats;
use ratelimit_core::sync::FirstCounts;
use redis::IntoConnectionInfo;

use super::event::{StatsRef, ZoneSpec};
use super::io::Conn;

/// Bytes the increments kept for sending again may hold, per zone and
/// worker (beyond it they are dropped, and stay counted on this node).
pub const RETRY_BYTES: usize = 4 << 20;
const LOG_INTERVAL: Duration = Duration::from_secs(1);

/// Most keys whose TTL is still to be set again after a lost reply.
pub(super) const TTL_FIX_MAX: usize = 4096;
/// Redis commands per second the refreshes of one zone may spend, per
/// worker, whatever the keys.
pub const REFRESH_BUDGET: u32 = 200;
/// Most keys waiting for a refresh, per zone and worker.
pub(super) const WATCH_MAX: usize = 4096;

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

/// A key near its limit that this worker counts: read again once after
/// each flush that counted it, shortly before its next request is expected
/// (three quarters of the gap between its last two flushes, at least
/// `REFRESH_AFTER`), so that the next decision sees what the other nodes
/// counted meanwhile. At most one refresh per counted flush, within the
/// zone's budget.
pub(super) struct Watch {
    pub(super) tag: Box<[u8]>,
    pub(super) period: u32,
    pub(super) limit: u32,
    pub(super) window: u64,
    /// The last flush that counted the key.
    pub(super) last: Instant,
    /// When to read it again, if a refresh is owed.
    pub(super) due: Option<Instant>,
}

pub struct Backend {
    pub(super) spec: ZoneSpec,
    pub(super) conn: Option<Conn>,
    /// Redis's clock minus ours (ms), learnt when `conn` was made (`None`:
    /// `TIME` refused): strict calls carry deadlines in Redis's clock.
    pub(super) clock_offset_ms: Option<i64>,
    pub(super) health: Health,
    pub(super) errors: LogGate,
    pub(super) refusals: LogGate,
    pub(super) secrets: Vec<String>,
    /// Increments known not to have run, sent with the next flush.
    pub(super) retry: ItemMap<Item>,
    pub(super) retry_bytes: usize,
    /// Increments that will never reach Redis, not logged yet, and the
    /// gate of that line.
    pub(super) unsent: u64,
    pub(super) drops: LogGate,
    /// Keys near their limit, to be read again (by entry, window 0).
    pub(super) watch: ItemMap<Watch>,
    pub(super) budget: Budget,
    /// Counters whose `INCRBY` may have created them without an `EXPIRE`
    /// (reply lost): `EXPIRE` sent with the next exchange.
    pub(super) ttl_fix: ItemMap<TtlFix>,
    pub(super) prev: ItemMap<Prev>,
    /// When `prev` was last rid of windows that are over.
    pub(super) swept: Instant,
    /// Cluster: a copy of the slot map, and when it was read.
    pub(super) topo: Option<Topology>,
    pub(super) topo_at: Option<Instant>,
    /// Cluster: masters that failed, each with its own backoff (the keys of
    /// their slots wait, the others go on).
    pub(super) nodes: HashMap<String, Health>,
    /// This thread's slot in the zone's waiting gauge, once it has one.
    pub(super) waiting_slot: Option<usize>,
    /// This thread holds the zone's sender lease (`ring`): it sends the
    /// node's counts of the zone, its worker's and those the other workers
    /// forward. Else it forwards its worker's counts into the zone's ring.
    pub(super) sender: bool,
    /// The worker wants a strict link (`link.rs`).
    pub(super) link_wanted: bool,
    /// When one was last tried, and how long after a failed try the next
    /// one waits.
    pub(super) link_tried: Option<Instant>,
    pub(super) link_backoff: Duration,
    /// How this zone's first counts make their counters lately.
    pub(super) first: FirstCounts,
    /// Redis refused `SET` to this user (`NOPERM`): counters are made by
    /// `INCRBY` only.
    pub(super) set_refused: bool,
    /// The usual round trip of a flush (`counter::RoundTrip`, slots timed
    /// from `born`): how long the worker may wait for an answer
    /// (`Channel::stale_ms`).
    pub(super) rtt: RoundTrip,
    pub(super) born: Instant,
    /// The nodes counting the zone through this Redis (`on_error=share`).
    pub(super) fleet: Fleet,
}

impl Backend {
    pub fn new(spec: ZoneSpec, now: Instant) -> Backend {
        // a zone a `strict` limit uses gets its link as soon as it is up;
        // another when a small limit first needs one (`want_link`)
        let link_at_once = spec.strict && spec.may_link();
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
        Backend {
            spec,
            conn: None,
            clock_offset_ms: None,
            health: Health::new(now),
            errors: LogGate::new(LOG_INTERVAL),
            refusals: LogGate::new(LOG_INTERVAL),
            secrets,
            retry: ItemMap::default(),
            retry_bytes: 0,
            unsent: 0,
            drops: LogGate::new(super::DROP_LOG_INTERVAL),
            watch: ItemMap::default(),
            budget: Budget::new(REFRESH_BUDGET, now),
            ttl_fix: ItemMap::default(),
            prev: ItemMap::default(),
            swept: now,
            topo: None,
            topo_at: None,
            nodes: HashMap::new(),
            waiting_slot: None,
            sender: false,
            link_wanted: link_at_once,
            link_tried: None,
            link_backoff: Duration::from_secs(1),
            first: FirstCounts::default(),
            set_refused: false,
            rtt: RoundTrip::default(),
            born: now,
            fleet: Fleet::new(now),
        }
    }

    pub fn zone(&self) -> u32 {
        self.spec.index
    }

    /// Publishes how many increments of this zone wait in this thread
    /// (`queued` in the worker's queue, plus those kept to send again).
    /// Returns a process found gone with its slot (`Shares::hold`).
    pub(super) fn publish_waiting(&mut self, queued: u64) -> Option<u64> {
        let now = queued + self.retry.values().map(|i| u64::from(i.n)).sum::<u64>();
        let st = self.spec.stats.as_ref().map(StatsRef::get)?;
        let at = super::clock::unix_ms();
        st.waiting.set(&mut self.waiting_slot, own_pid(), now, at, process_alive)
    }

    /// Takes this thread's slot in the zone's waiting gauge before it holds
    /// any increment, so that the worker's death is seen whenever it
    /// comes. Returns a process found gone with its slot.
    pub(super) fn hold_waiting_slot(&mut self) -> Option<u64> {
        let st = self.spec.stats.as_ref().map(StatsRef::get)?;
        st.waiting.hold(&mut self.waiting_slot, own_pid(), process_alive)
    }

    /// Takes this thread's share back from the waiting gauge (it exits).
    pub(super) fn unpublish_waiting(&mut self) {
        if let Some(st) = self.spec.stats.as_ref().map(StatsRef::get) {
            st.waiting.release(&mut self.waiting_slot, own_pid());
        }
    }

    /// The zone's figures in shared memory, if mapped.
    pub(super) fn stats(&self) -> Option<&Stats> {
        self.spec.stats.as_ref().map(StatsRef::get)
    }

    /// Whether the backend works: its connection, and every master of a
    /// cluster.
    pub fn is_up(&self) -> bool {
        self.health.is_up() && self.nodes.is_empty()
    }

    /// Whether this thread sends the zone's counts to Redis: it holds the
    /// lease, or the zone has no ring here.
    pub fn sends(&self) -> bool {
        self.sender || self.spec.ring.is_none()
    }
}

/// This worker's process id.
pub(super) fn own_pid() -> u64 {
    // SAFETY: getpid() has no preconditions.
    u64::from(unsafe { libc::getpid() }.unsigned_abs())
}

/// Whether process `pid` still runs (a dead worker's waiting increments
/// leave the gauge): `kill(pid, 0)` succeeds, or is refused for lack of
/// permission (it exists).
pub fn process_alive(pid: u64) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false; // 0 would ask about the whole process group
    }
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    let sent = unsafe { libc::kill(pid, 0) } == 0;
    sent || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// What the thread knows of the zone's nodes.
pub(super) struct Fleet {
    /// When this node says it counts next.
    pub(super) due: Instant,
    /// This node: its host name and nginx master's pid (its workers are
    /// one node).
    pub(super) id: String,
}

impl Fleet {
    pub(super) fn new(now: Instant) -> Fleet {
        Fleet { due: now, id: node_id() }
    }
}

/// `<host name>:<pid of nginx's master>`.
fn node_id() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: writes at most `buf.len()` bytes into our buffer.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    let host = if rc == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        String::from_utf8_lossy(&buf[..end]).into_owned()
    } else {
        String::from("unknown")
    };
    // SAFETY: getppid cannot fail.
    let master = unsafe { libc::getppid() };
    format!("{host}:{master}")
}
