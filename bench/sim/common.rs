//! What the simulations of `make bench` share: a small deterministic
//! random number generator, arrival processes (Poisson, on/off bursts) and
//! an exact sliding log of allowed requests.

use std::collections::VecDeque;

/// xorshift64* — tiny, deterministic, good enough for arrival times.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1)
    }
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in (0, 1].
    pub fn unit(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 1.0) / (1u64 << 53) as f64
    }
    /// Exponential with the given mean.
    pub fn exp(&mut self, mean: f64) -> f64 {
        -mean * self.unit().ln()
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Poisson,
    /// On/off: "on" periods of mean P/2 at 3x the mean rate, "off" periods
    /// of mean P with nothing, so the long-run mean is the nominal rate.
    Bursty,
}

/// Arrival times (ms since the epoch, non-decreasing) of one source.
pub struct Arrivals {
    rng: Rng,
    kind: Kind,
    /// mean requests per ms over the long run
    rate_per_ms: f64,
    period_ms: f64,
    t: f64,
    end: f64,
    on: bool,
    /// end of the current on/off phase (bursty only)
    phase_end: f64,
}

impl Arrivals {
    pub fn new(
        seed: u64,
        kind: Kind,
        rate_per_ms: f64,
        period_ms: f64,
        start: f64,
        end: f64,
    ) -> Self {
        let mut rng = Rng::new(seed);
        let on = rng.unit() < 1.0 / 3.0;
        let phase_end = start + if on { rng.exp(period_ms / 2.0) } else { rng.exp(period_ms) };
        Arrivals { rng, kind, rate_per_ms, period_ms, t: start, end, on, phase_end }
    }
}

impl Iterator for Arrivals {
    type Item = u64;
    fn next(&mut self) -> Option<u64> {
        match self.kind {
            Kind::Poisson => {
                self.t += self.rng.exp(1.0 / self.rate_per_ms);
            }
            Kind::Bursty => loop {
                if self.on {
                    let next = self.t + self.rng.exp(1.0 / (3.0 * self.rate_per_ms));
                    if next <= self.phase_end {
                        self.t = next;
                        break;
                    }
                    self.t = self.phase_end;
                    self.on = false;
                    self.phase_end = self.t + self.rng.exp(self.period_ms);
                } else {
                    self.t = self.phase_end;
                    self.on = true;
                    self.phase_end = self.t + self.rng.exp(self.period_ms / 2.0);
                }
                if self.t >= self.end {
                    return None;
                }
            },
        }
        if self.t >= self.end {
            None
        } else {
            Some(self.t as u64)
        }
    }
}

/// Exact sliding log: times of the requests counted in (t - P, t].
pub struct SlidingLog {
    times: VecDeque<u64>,
    period_ms: u64,
}

impl SlidingLog {
    pub fn new(period_ms: u64) -> Self {
        SlidingLog { times: VecDeque::new(), period_ms }
    }
    pub fn count_at(&mut self, t: u64) -> usize {
        while let Some(&front) = self.times.front() {
            if front + self.period_ms <= t {
                self.times.pop_front();
            } else {
                break;
            }
        }
        self.times.len()
    }
    pub fn push(&mut self, t: u64) {
        self.times.push_back(t);
    }
}
