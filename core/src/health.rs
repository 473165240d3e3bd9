//! Pure timing rules of a backend, apart from any I/O so that they are
//! unit-tested: when a backend that failed may be tried again (backoff),
//! when an idle one is checked, how many refresh commands it may spend, and
//! how often it may log.

use std::time::{Duration, Instant};

pub const BACKOFF_MIN: Duration = Duration::from_millis(100);
pub const BACKOFF_MAX: Duration = Duration::from_secs(5);
/// An idle backend that is up is PINGed this often, so that `on_error`
/// applies from the first request after an outage and a half-open
/// connection is found before a request needs it.
pub const IDLE_CHECK: Duration = Duration::from_secs(1);

/// Whether a backend is up, and when a down one may be tried again.
///
/// Only transport failures (refused, reset, timeout, TLS, a cluster that is
/// not serving) take a backend down; error replies to single commands do
/// not. A down backend is tried once per backoff (100 ms doubling to 5 s),
/// never in a loop. A down backend is up again (and its backoff starts
/// over) only once a real exchange worked: what it held went through, or a
/// check when it held nothing; a PING that works before a pipeline that
/// fails does not count, so such a backend cannot make it flap.
#[derive(Debug)]
pub struct Health {
    up: bool,
    backoff: Duration,
    retry_at: Option<Instant>,
    last_exchange: Instant,
}

impl Health {
    /// A backend checked at once: increments far from their limit may wait
    /// seconds before they are sent (`sync`), and `on_error` should not.
    pub fn new(now: Instant) -> Health {
        let checked = now.checked_sub(IDLE_CHECK).unwrap_or(now);
        Health { up: true, backoff: BACKOFF_MIN, retry_at: None, last_exchange: checked }
    }

    pub fn is_up(&self) -> bool {
        self.up
    }

    /// Whether anything may be sent now: always while up, once the backoff
    /// has passed while down.
    pub fn may_send(&self, now: Instant) -> bool {
        self.up || self.retry_at.is_none_or(|t| now >= t)
    }

    /// A transport failure. Returns true if the backend just went down.
    pub fn failed(&mut self, now: Instant) -> bool {
        let was_up = self.up;
        self.up = false;
        self.retry_at = Some(now + self.backoff);
        self.backoff = (self.backoff * 2).min(BACKOFF_MAX);
        self.last_exchange = now;
        was_up
    }

    /// An exchange that worked: up, and the backoff starts over. Returns
    /// true if the backend just came back.
    pub fn succeeded(&mut self, now: Instant) -> bool {
        let was_down = !self.up;
        self.last_exchange = now;
        self.up = true;
        self.retry_at = None;
        self.backoff = BACKOFF_MIN;
        was_down
    }

    /// When the thread must wake up for this backend with nothing queued:
    /// the next try of a down backend, or the idle check of an up one.
    pub fn next_check(&self) -> Instant {
        if self.up {
            self.last_exchange + IDLE_CHECK
        } else {
            self.retry_at.unwrap_or(self.last_exchange + BACKOFF_MIN)
        }
    }

    /// Whether a check (PING) is due now.
    pub fn check_due(&self, now: Instant) -> bool {
        now >= self.next_check()
    }
}

/// A token bucket of Redis commands per second: what refreshes of keys
/// near their limit may spend, whatever the key pattern.
#[derive(Debug)]
pub struct Budget {
    per_sec: u32,
    tokens: f64,
    at: Instant,
}

impl Budget {
    pub fn new(per_sec: u32, now: Instant) -> Budget {
        Budget { per_sec, tokens: f64::from(per_sec), at: now }
    }

    /// Takes `n` commands if the budget has them.
    pub fn take(&mut self, n: u32, now: Instant) -> bool {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        let cap = f64::from(self.per_sec);
        self.tokens = (self.tokens + dt * cap).min(cap);
        if self.tokens >= f64::from(n) {
            self.tokens -= f64::from(n);
            true
        } else {
            false
        }
    }
}

/// At most one line per `every`; counts what it held back.
#[derive(Debug)]
pub struct LogGate {
    every: Duration,
    last: Option<Instant>,
    pub held: u64,
}

impl LogGate {
    pub fn new(every: Duration) -> LogGate {
        LogGate { every, last: None, held: 0 }
    }

    /// Whether a line may be written now (`force`: the first of an outage).
    /// Returns the number of lines held back since the last one.
    pub fn pass(&mut self, now: Instant, force: bool) -> Option<u64> {
        if force || self.last.is_none_or(|t| now.saturating_duration_since(t) >= self.every) {
            self.last = Some(now);
            Some(std::mem::take(&mut self.held))
        } else {
            self.held += 1;
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn down_backend_is_tried_once_per_backoff() {
        let t0 = Instant::now();
        let mut h = Health::new(t0);
        assert!(h.may_send(t0));
        assert!(h.failed(t0));
        assert!(!h.failed(t0), "already down");
        // 100 ms then 200 ms ... never a tight loop: count the tries a
        // backend that keeps failing gets in 10 s
        let mut h = Health::new(t0);
        let mut tries = 0;
        let mut t = t0;
        while t < t0 + Duration::from_secs(10) {
            if h.may_send(t) {
                tries += 1;
                h.failed(t);
            }
            t += Duration::from_millis(1);
        }
        assert!((5..=12).contains(&tries), "{tries} tries in 10 s");
    }

    #[test]
    fn backoff_grows_until_an_exchange_works() {
        let t0 = Instant::now();
        let mut h = Health::new(t0);
        for i in 0..5 {
            h.failed(t0 + Duration::from_secs(i));
        }
        let t = t0 + Duration::from_secs(10);
        h.failed(t);
        assert_eq!(h.next_check(), t + Duration::from_millis(3200));
        assert!(h.succeeded(t + Duration::from_secs(4)));
        assert!(h.is_up());
        h.failed(t + Duration::from_secs(5));
        assert_eq!(h.next_check(), t + Duration::from_secs(5) + BACKOFF_MIN);
    }

    #[test]
    fn idle_backend_is_checked_at_once_then_every_second() {
        let t0 = Instant::now() + IDLE_CHECK;
        let mut h = Health::new(t0);
        assert!(h.check_due(t0));
        h.succeeded(t0);
        assert!(!h.check_due(t0 + Duration::from_millis(999)));
        assert!(h.check_due(t0 + IDLE_CHECK));
        h.succeeded(t0 + IDLE_CHECK);
        assert_eq!(h.next_check(), t0 + 2 * IDLE_CHECK);
    }

    #[test]
    fn budget_caps_commands_per_second() {
        let t0 = Instant::now();
        let mut b = Budget::new(100, t0);
        let mut spent = 0;
        let mut t = t0;
        while t < t0 + Duration::from_secs(5) {
            while b.take(2, t) {
                spent += 2;
            }
            t += Duration::from_millis(10);
        }
        assert!((500..=600).contains(&spent), "{spent} in 5 s");
    }

    #[test]
    fn log_gate_passes_one_line_per_interval() {
        let t0 = Instant::now();
        let mut g = LogGate::new(Duration::from_secs(1));
        assert_eq!(g.pass(t0, false), Some(0));
        assert_eq!(g.pass(t0 + Duration::from_millis(10), false), None);
        assert_eq!(g.pass(t0 + Duration::from_millis(20), false), None);
        assert_eq!(g.pass(t0 + Duration::from_secs(1), false), Some(2));
        assert_eq!(g.pass(t0 + Duration::from_millis(1001), true), Some(0));
    }
}
