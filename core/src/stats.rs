//! A zone's figures, kept in its shared memory next to its table (see
//! `table::Header`): what the zone decided and what its Redis threads did,
//! as atomics that any worker or thread updates without the zone's lock.
//! `metrics` turns them into the metrics page.

use std::sync::atomic::{AtomicU64, Ordering};

/// Upper bounds (µs) of the Redis round-trip histogram's buckets (the last,
/// `+Inf`, is implied).
pub const RTT_BUCKETS_US: [u64; 11] =
    [500, 1_000, 2_000, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000, 1_000_000];

/// How many Redis threads of one zone (one per worker, old and new ones
/// together during a reload) publish their waiting increments; a thread
/// that finds no slot free publishes nothing (the gauge reads low).
pub const WAITING_SLOTS: usize = 64;

/// One thread's published figure: its process id (0: free) and value.
#[repr(C)]
#[derive(Debug, Default)]
pub struct Share {
    pid: AtomicU64,
    n: AtomicU64,
    /// Since when (ms since the epoch) `n` has been above 0 (0: it is 0).
    since: AtomicU64,
}

/// The zone's waiting increments, a slot per thread.
#[repr(C)]
#[derive(Debug)]
pub struct Shares([Share; WAITING_SLOTS]);

impl Default for Shares {
    fn default() -> Shares {
        Shares(std::array::from_fn(|_| Share::default()))
    }
}

impl Shares {
    /// Publishes `n` for process `pid` at `now_ms`, in the slot it holds
    /// (`slot`), else in one it claims: free, or held by a process that
    /// `alive` says is gone. Returns such a process (see `hold`).
    pub fn set(
        &self,
        slot: &mut Option<usize>,
        pid: u64,
        n: u64,
        now_ms: u64,
        alive: impl Fn(u64) -> bool,
    ) -> Option<u64> {
        let held = slot.filter(|&i| self.0[i].pid.load(Ordering::Acquire) == pid);
        let mut gone = None;
        let i = match held {
            Some(i) => i,
            None => {
                if n == 0 {
                    return None;
                }
                let (i, dead) = self.claim(pid, alive)?;
                gone = dead;
                i
            }
        };
        *slot = Some(i);
        let s = &self.0[i];
        let was = s.n.swap(n, Ordering::AcqRel);
        if n == 0 {
            s.since.store(0, Ordering::Release);
        } else if was == 0 || s.since.load(Ordering::Acquire) == 0 {
            s.since.store(now_ms.max(1), Ordering::Release);
        }
        gone
    }

    /// Claims a slot for process `pid`'s thread before it holds anything,
    /// so that its death is seen whenever it comes (`reap`). Returns a
    /// process whose slot it took because that process is gone without
    /// giving it back: it died holding what it had not sent.
    pub fn hold(
        &self,
        slot: &mut Option<usize>,
        pid: u64,
        alive: impl Fn(u64) -> bool,
    ) -> Option<u64> {
        let (i, gone) = self.claim(pid, alive)?;
        *slot = Some(i);
        gone
    }

    /// Frees the slots of processes that are gone without giving them
    /// back (killed, or their thread never stopped), and returns them.
    pub fn reap(&self, alive: impl Fn(u64) -> bool) -> Vec<u64> {
        let mut gone = Vec::new();
        for s in &self.0 {
            let old = s.pid.load(Ordering::Acquire);
            if old != 0
                && !alive(old)
                && s.pid.compare_exchange(old, 0, Ordering::AcqRel, Ordering::Acquire).is_ok()
            {
                s.n.store(0, Ordering::Release);
                s.since.store(0, Ordering::Release);
                gone.push(old);
            }
        }
        gone
    }

    /// A slot for `pid`: the one it has, else a free one, else one of a
    /// process that is gone (returned with it).
    fn claim(&self, pid: u64, alive: impl Fn(u64) -> bool) -> Option<(usize, Option<u64>)> {
        for (i, s) in self.0.iter().enumerate() {
            let old = s.pid.load(Ordering::Acquire);
            if old == pid {
                return Some((i, None));
            }
            if (old == 0 || !alive(old))
                && s.pid.compare_exchange(old, pid, Ordering::AcqRel, Ordering::Acquire).is_ok()
            {
                s.n.store(0, Ordering::Release);
                s.since.store(0, Ordering::Release);
                return Some((i, (old != 0).then_some(old)));
            }
        }
        None
    }

    /// Gives the slot back (the thread exits).
    pub fn release(&self, slot: &mut Option<usize>, pid: u64) {
        if let Some(i) = slot.take() {
            let s = &self.0[i];
            if s.pid.load(Ordering::Acquire) == pid {
                s.n.store(0, Ordering::Release);
                s.since.store(0, Ordering::Release);
                let _ = s.pid.compare_exchange(pid, 0, Ordering::AcqRel, Ordering::Acquire);
            }
        }
    }

    /// What the live processes' threads published: the increments that
    /// wait, and since when the longest-waiting thread has had some (0:
    /// none waits).
    pub fn sum(&self, alive: impl Fn(u64) -> bool) -> (u64, u64) {
        let mut total = 0;
        let mut oldest = 0;
        for s in &self.0 {
            let pid = s.pid.load(Ordering::Acquire);
            if pid == 0 || !alive(pid) {
                continue;
            }
            let n = s.n.load(Ordering::Acquire);
            if n > 0 {
                total += n;
                let since = s.since.load(Ordering::Acquire);
                if since > 0 && (oldest == 0 || since < oldest) {
                    oldest = since;
                }
            }
        }
        (total, oldest)
    }
}

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
    /// Passed requests a bucket delayed (`delay=`), also in `passed`.
    pub delayed: AtomicU64,
    /// Requests in flight holding a slot of a concurrency limit
    /// (`redis_ratelimit_conn`), and those a full limit refused (or, in
    /// dry run, let through).
    pub conn_in_flight: AtomicU64,
    pub conn_rejected: AtomicU64,
    pub conn_rejected_dry_run: AtomicU64,
    /// Slots this node's workers hold leases of in Redis (a concurrency
    /// limit on a zone with `redis=`), and other holders' leases this
    /// node's calls found ended and dropped (a node gone, frozen or cut
    /// off).
    pub conn_leased: AtomicU64,
    pub conn_expired: AtomicU64,
    /// Keys blocked by a `block=` line's penalty (each time, on this node).
    pub blocks: AtomicU64,
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
    /// Increments waiting to be sent: each Redis thread's own figure, in a
    /// slot it claims with its process's pid, so that a worker that dies
    /// (killed, crashed) takes its share with it: readers add only the
    /// slots of live processes.
    pub waiting: Shares,
    /// Requests that waited for Redis's decision (`strict`), and those of
    /// them whose wait ended without it (then decided by `on_error`).
    pub strict_waits: AtomicU64,
    pub strict_timeouts: AtomicU64,
    /// The nodes that counted through the zone's Redis lately, as a Redis
    /// thread last read it (0: never read): `on_error=share` divides by it,
    /// and it outlives reloads and workers.
    pub fleet_nodes: AtomicU64,
    /// How long (ms) a key's increments may wait for an answer before the
    /// node's view of it counts as stale, as the zone's sender last worked
    /// it out from its round trips (0: not yet).
    pub stale_ms: AtomicU64,
    /// 1 while the zone's sender finds Redis down (0 until it says so, so
    /// that a zone is up from its start, as a worker's own view is): every
    /// worker decides as `on_error` says from the sender's next turn on.
    pub down: AtomicU64,
}

impl Stats {
    /// Counts one request's outcome.
    #[inline]
    pub fn add(&self, outcome: Outcome) {
        if matches!(outcome, Outcome::Delayed | Outcome::DelayedDryRun) {
            self.delayed.fetch_add(1, Ordering::Relaxed);
        }
        let c = match outcome {
            Outcome::Passed | Outcome::Delayed | Outcome::DelayedDryRun => &self.passed,
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

    /// A flush went through at `now_ms`.
    pub fn synced(&self, now_ms: u64) {
        self.last_sync_ms.fetch_max(now_ms, Ordering::Relaxed);
    }

    /// Adds one to a counter.
    #[inline]
    pub fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    /// Takes one off a gauge (never below 0).
    #[inline]
    pub fn unbump(c: &AtomicU64) {
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| v.checked_sub(1));
    }

    /// Adds `n` to a counter or gauge.
    #[inline]
    pub fn add_n(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }

    /// Takes `n` off a gauge (never below 0).
    #[inline]
    pub fn sub_n(c: &AtomicU64, n: u64) {
        let _ = c.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(n)));
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
    /// Passed after a bucket's delay (`burst=` without `nodelay`).
    Delayed,
    Rejected,
    /// Would have waited, in `redis_ratelimit_dry_run`: passed at once.
    DelayedDryRun,
    RejectedDryRun,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Passed => "PASSED",
            Outcome::Delayed => "DELAYED",
            Outcome::Rejected => "REJECTED",
            Outcome::DelayedDryRun => "DELAYED_DRY_RUN",
            Outcome::RejectedDryRun => "REJECTED_DRY_RUN",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_process_publishes_in_its_own_slot() {
        let w = Shares::default();
        let (mut a, mut b) = (None, None);
        w.set(&mut a, 100, 5, 1000, |_| true);
        w.set(&mut b, 200, 7, 1000, |_| true);
        assert_eq!(w.sum(|_| true).0, 12);
        w.set(&mut a, 100, 2, 1000, |_| true);
        assert_eq!(w.sum(|_| true).0, 9);
        assert_ne!(a, b);
        w.release(&mut a, 100);
        assert_eq!(w.sum(|_| true).0, 7);
        assert_eq!(a, None);
    }

    #[test]
    fn a_dead_process_share_leaves_the_sum_and_its_slot_is_taken_again() {
        let w = Shares::default();
        let mut dead = None;
        w.set(&mut dead, 100, 2000, 1000, |_| true);
        let alive = |pid: u64| pid != 100;
        assert_eq!(w.sum(alive).0, 0);
        let mut fresh = None;
        for pid in 1000..1000 + WAITING_SLOTS as u64 {
            let mut s = None;
            w.set(&mut s, pid, 1, 1000, alive);
            assert!(s.is_some(), "slot for {pid}");
            if pid == 1000 {
                fresh = s;
            }
        }
        // the first claim took the free slots in order, the dead one too
        assert_eq!(w.sum(alive).0, WAITING_SLOTS as u64);
        assert!(fresh.is_some());
        let mut none = None;
        w.set(&mut none, 5000, 3, 1000, alive);
        assert_eq!(none, None, "no slot left: nothing published");
    }

    #[test]
    fn nothing_to_publish_claims_no_slot() {
        let w = Shares::default();
        let mut s = None;
        w.set(&mut s, 1, 0, 1000, |_| true);
        assert_eq!(s, None);
        assert_eq!(w.sum(|_| true).0, 0);
    }

    #[test]
    fn a_slot_taken_over_is_not_written_by_its_old_holder() {
        let w = Shares::default();
        let mut old = None;
        w.set(&mut old, 100, 4, 1000, |_| true);
        // 100 is thought dead (its pid reused?): 200 takes the slot
        let mut new = None;
        w.set(&mut new, 200, 1, 1000, |p| p != 100);
        assert_eq!(old, new);
        // the old holder's next figure goes to a slot of its own
        w.set(&mut old, 100, 9, 1000, |_| true);
        assert_ne!(old, new);
        assert_eq!(w.sum(|_| true).0, 10);
    }

    #[test]
    fn the_oldest_waiting_thread_says_since_when() {
        let w = Shares::default();
        let (mut a, mut b) = (None, None);
        assert_eq!(w.sum(|_| true), (0, 0));
        w.set(&mut a, 1, 5, 1000, |_| true);
        w.set(&mut b, 2, 3, 3000, |_| true);
        w.set(&mut a, 1, 7, 4000, |_| true);
        assert_eq!(w.sum(|_| true), (10, 1000), "a has waited since 1000");
        w.set(&mut a, 1, 0, 5000, |_| true);
        assert_eq!(w.sum(|_| true), (3, 3000));
        w.set(&mut a, 1, 2, 6000, |_| true);
        assert_eq!(w.sum(|_| true), (5, 3000));
        assert_eq!(w.sum(|p| p != 2), (2, 6000), "a dead thread's time goes with it");
    }

    #[test]
    fn a_process_gone_without_giving_its_slot_back_is_told_once() {
        let w = Shares::default();
        let (mut a, mut b, mut c) = (None, None, None);
        assert_eq!(w.hold(&mut a, 100, |_| true), None);
        assert_eq!(w.hold(&mut b, 200, |_| true), None);
        assert!(a.is_some() && b.is_some() && a != b);
        // 200 gives its slot back (a clean exit): never reported
        w.release(&mut b, 200);
        let alive = |pid: u64| pid != 100 && pid != 200;
        assert_eq!(w.reap(alive), vec![100], "100 died holding its slot");
        assert_eq!(w.reap(alive), Vec::<u64>::new(), "once");
        // a slot taken over from a dead holder names it
        w.hold(&mut c, 300, |_| true);
        let mut d = None;
        assert_eq!(w.hold(&mut d, 400, |p| p != 300), Some(300));
        let full = Shares::default();
        let mut slots = Vec::new();
        for pid in 1..=WAITING_SLOTS as u64 {
            let mut s = None;
            full.hold(&mut s, pid, |_| true);
            slots.push(s);
        }
        let mut e = None;
        assert_eq!(full.hold(&mut e, 9999, |p| p != 7), Some(7));
        assert_eq!(e, slots[6]);
    }
}
