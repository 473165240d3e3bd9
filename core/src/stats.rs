//! A zone's figures, kept in its shared memory next to its table (see
//! `table::Header`): what the zone decided and what its Redis threads did,
//! as atomics that any worker or thread updates without the zone's lock.
//! `metrics` turns them into the metrics page.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (µs) of the Redis round-trip histogram's buckets (the last,
/// `+Inf`, is implied).
pub const RTT_BUCKETS_US: [u64; 11] =
    [500, 1_000, 2_000, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000];

/// A zone's figures, kept in its shared memory: what it decided (counted
/// by the workers) and what its Redis threads did (counted by them: plain
/// atomics, no lock, no nginx call).
#[repr(C)]
#[derive(Debug, Default)]
pub struct Stats {
    pub passed: AtomicU64,
    pub rejected: AtomicU64,
    pub rejected_dry_run: AtomicU64,
    /// Requests whose key for the zone was empty (not limited by it).
    pub not_limited: AtomicU64,
    /// Replies that closed a key's breaker.
    pub breaker_trips: AtomicU64,
    /// Increments the queue had no room for (counted on the node only).
    pub dropped: AtomicU64,
    /// 1 while the backend works, as the last Redis thread to look saw it.
    pub backend_up: AtomicU64,
    pub commands: AtomicU64,
    pub pipelines: AtomicU64,
    /// Transport failures (refused, reset, timeout, TLS, cluster down).
    pub errors_transport: AtomicU64,
    /// Error replies to single commands (WRONGTYPE, OOM, not a number).
    pub errors_reply: AtomicU64,
    pub connects: AtomicU64,
    /// When a flush last went through (ms since the epoch; 0: never).
    pub last_sync_ms: AtomicU64,
    /// Flush round trips: how many fell at or below each bound of
    /// `RTT_BUCKETS_US` (and not below the one before), then above all.
    pub rtt_buckets: [AtomicU64; RTT_BUCKETS_US.len() + 1],
    pub rtt_sum_us: AtomicU64,
    /// Increments waiting to be sent, all Redis threads together (each adds
    /// and takes back its own share).
    pub waiting: AtomicU64,
    /// Requests that waited for Redis's decision (`strict`), and those of
    /// them whose wait ended without it (then decided by `on_error`).
    pub strict_waits: AtomicU64,
    pub strict_timeouts: AtomicU64,
}

impl Stats {
    /// Counts one request's outcome.
    #[inline]
    pub fn add(&self, outcome: Outcome) {
        let c = match outcome {
            Outcome::Passed => &self.passed,
            Outcome::Rejected => &self.rejected,
            Outcome::RejectedDryRun => &self.rejected_dry_run,
        };
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// One pipeline of `commands` sent, answered (or not) after `rtt_us`.
    pub fn pipeline(&self, commands: usize, rtt_us: u64) {
        self.pipelines.fetch_add(1, Ordering::Relaxed);
        self.commands.fetch_add(commands as u64, Ordering::Relaxed);
        let i = RTT_BUCKETS_US.iter().position(|&b| rtt_us <= b).unwrap_or(RTT_BUCKETS_US.len());
        self.rtt_buckets[i].fetch_add(1, Ordering::Relaxed);
        self.rtt_sum_us.fetch_add(rtt_us, Ordering::Relaxed);
    }

    /// Moves the waiting gauge from `old` to `new` (one thread's share).
    pub fn waiting_moved(&self, old: u64, new: u64) {
        if new > old {
            self.waiting.fetch_add(new - old, Ordering::Relaxed);
        } else if old > new {
            self.waiting.fetch_sub(old - new, Ordering::Relaxed);
        }
    }

    /// A flush went through at `now_ms`.
    pub fn synced(&self, now_ms: u64) {
        self.last_sync_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// Adds one to a counter.
    #[inline]
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Reads a counter.
    #[inline]
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }
}

/// What a request came to under a zone (`$redis_ratelimit_status`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Rejected,
    RejectedDryRun,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Passed => "PASSED",
            Outcome::Rejected => "REJECTED",
            Outcome::RejectedDryRun => "REJECTED_DRY_RUN",
        }
    }
}
