//! Trace simulation of the limiter's decision logic — the crate's own pure
//! code, not a re-implementation: many sources, Poisson and bursty on/off
//! arrivals at rates around the limit, every request decided by
//! `counter::check` / `counter::count` on a `table::Entry`, and each decision
//! compared with an exact sliding-window log over the same history:
//!
//!   exact: allowed iff fewer than L *allowed* requests lie in (t - P, t]
//!
//! Printed: % wrongly allowed, % wrongly rejected, mean relative error of the
//! estimate against the exact count, and the admitted total against an
//! independent exact sliding-log limiter fed the same arrivals.
//!
//! It is a test of the core crate (core/Cargo.toml, `[[test]] trace_sim`).
//! Run: cargo test --release -p ratelimit-core --test trace_sim -- --nocapture --exact trace_simulation

#[path = "sim/common.rs"]
mod common;

use common::{Arrivals, Kind, Rng, SlidingLog};
use ratelimit_core::counter::{check, count};
use ratelimit_core::rate::Rate;
use ratelimit_core::table::Entry;
use ratelimit_core::window::{roll, window_index, Estimate};

#[derive(Default, Clone, Copy)]
struct Tally {
    requests: u64,
    allowed: u64,
    wrongly_allowed: u64,
    wrongly_rejected: u64,
    /// sum of |estimate - exact| / exact over requests with exact > 0
    rel_err_sum: f64,
    rel_err_n: u64,
    /// sum of |estimate - exact| / L over all requests
    abs_err_l_sum: f64,
    /// admitted by an independent exact sliding-log limiter
    exact_allowed: u64,
}

impl Tally {
    fn add(&mut self, o: &Tally) {
        self.requests += o.requests;
        self.allowed += o.allowed;
        self.wrongly_allowed += o.wrongly_allowed;
        self.wrongly_rejected += o.wrongly_rejected;
        self.rel_err_sum += o.rel_err_sum;
        self.rel_err_n += o.rel_err_n;
        self.abs_err_l_sum += o.abs_err_l_sum;
        self.exact_allowed += o.exact_allowed;
    }
    fn pct(&self, n: u64) -> f64 {
        100.0 * n as f64 / self.requests.max(1) as f64
    }
    fn row(&self, name: &str) {
        println!(
            "| {name:<26} | {:>9} | {:>8.3} | {:>8.3} | {:>8.2} | {:>8.2} | {:>7.3} |",
            self.requests,
            self.pct(self.wrongly_allowed),
            self.pct(self.wrongly_rejected),
            100.0 * self.rel_err_sum / self.rel_err_n.max(1) as f64,
            100.0 * self.abs_err_l_sum / self.requests.max(1) as f64,
            self.allowed as f64 / self.exact_allowed.max(1) as f64,
        );
    }
}

/// Simulates one source; every decision comes from `counter::check`.
fn simulate(rate: Rate, arrivals: Arrivals, backend: bool) -> Tally {
    let p = rate.period_ms();
    let limit = rate.limit as usize;
    let mut e = Entry::default();
    let mut log = SlidingLog::new(p); // the module's allowed requests
    let mut ideal = SlidingLog::new(p); // an exact limiter's own history
    let mut t = Tally::default();
    for now in arrivals {
        t.requests += 1;

        // What the window module says the entry should hold after rolling.
        let idx = window_index(now, p);
        let (want_prev, want_cur) = if u64::from(e.window) < idx {
            roll(u64::from(e.window), e.prev, e.cur.saturating_add(e.inflight), idx)
        } else {
            (e.prev, e.cur.saturating_add(e.inflight))
        };

        let c = check(&mut e, rate, now);

        assert_eq!(u64::from(e.window), idx, "entry rolled to the current window");
        assert_eq!(
            (e.prev, e.cur.saturating_add(e.inflight)),
            (want_prev, want_cur),
            "counter::roll agrees with window::roll"
        );
        let est = Estimate::new(e.prev, e.cur.saturating_add(e.inflight), now - idx * p, p);
        assert_eq!(est, c.estimate, "estimate is the window formula");

        let exact = log.count_at(now);
        let exact_allows = exact < limit;
        match (c.allowed, exact_allows) {
            (true, false) => t.wrongly_allowed += 1,
            (false, true) => t.wrongly_rejected += 1,
            _ => {}
        }
        let diff = (c.estimate.value() - exact as f64).abs();
        if exact > 0 {
            t.rel_err_sum += diff / exact as f64;
            t.rel_err_n += 1;
        }
        t.abs_err_l_sum += diff / f64::from(rate.limit);

        if c.allowed {
            count(&mut e, backend);
            log.push(now);
            t.allowed += 1;
        }

        if ideal.count_at(now) < limit {
            ideal.push(now);
            t.exact_allowed += 1;
        }
    }
    t
}

#[test]
fn trace_simulation() {
    const SOURCES: u64 = 1000;
    const PERIODS: f64 = 20.0;
    // Offered load as a multiple of the limit, cycled over the sources.
    const LOADS: [f64; 9] = [0.1, 0.25, 0.5, 0.8, 0.95, 1.0, 1.05, 1.5, 3.0];
    const RATES: [Rate; 4] = [
        Rate { limit: 10, period: 1 },
        Rate { limit: 100, period: 1 },
        Rate { limit: 100, period: 60 },
        Rate { limit: 1000, period: 60 },
    ];

    let mut by_kind = [Tally::default(); 2];
    let mut by_load = [Tally::default(); LOADS.len()];
    let mut by_rate = [Tally::default(); RATES.len()];
    let mut total = Tally::default();
    let mut rng = Rng::new(0x5eed);
    for s in 0..SOURCES {
        let kind = if s % 2 == 0 { Kind::Poisson } else { Kind::Bursty };
        let li = (s as usize / 2) % LOADS.len();
        let ri = (s as usize / 2 / LOADS.len()) % RATES.len();
        let rate = RATES[ri];
        let p = rate.period_ms() as f64;
        // start anywhere in a window, some day in 2023
        let start = 1_700_000_000_000.0 + (rng.next_u64() % 86_400_000) as f64;
        let end = start + PERIODS * p;
        let per_ms = LOADS[li] * f64::from(rate.limit) / p;
        let arrivals = Arrivals::new(rng.next_u64(), kind, per_ms, p, start, end);
        // Local zones count final; Redis zones count in flight until
        // confirmed. With no confirmation both must decide alike.
        let backend = s % 4 == 1;
        let t = simulate(rate, arrivals, backend);
        by_kind[usize::from(kind == Kind::Bursty)].add(&t);
        by_load[li].add(&t);
        by_rate[ri].add(&t);
        total.add(&t);
    }

    println!();
    println!(
        "trace simulation: {SOURCES} sources (half Poisson, half on/off bursts), {PERIODS} periods each"
    );
    println!(
        "| traffic                    |  requests | wr.allow |   wr.rej |  relerr% |   err/L% |  adm/ex |"
    );
    println!(
        "|----------------------------|----------:|---------:|---------:|---------:|---------:|--------:|"
    );
    by_kind[0].row("Poisson, all loads");
    by_kind[1].row("bursty on/off, all loads");
    for (t, l) in by_load.iter().zip(LOADS) {
        t.row(&format!("load {l:.2} x limit"));
    }
    for (t, r) in by_rate.iter().zip(RATES) {
        t.row(&format!("limit {r}"));
    }
    total.row("all");
    println!(
        "wr.allow / wr.rej: % of requests the estimate allowed / rejected against the exact \
         sliding log of allowed requests; relerr%: mean |estimate - exact| / exact (exact > 0); \
         err/L%: mean |estimate - exact| / L; adm/ex: admitted / admitted by an exact sliding-log limiter"
    );

    let wrong = total.pct(total.wrongly_allowed + total.wrongly_rejected);
    let adm = total.allowed as f64 / total.exact_allowed as f64;
    println!("wrong decisions overall: {wrong:.3}%; admitted / exact limiter: {adm:.3}");
    // Sanity only: near the limit every decision is a close call, so the
    // per-request disagreement is large by nature; the admitted volume is
    // what must stay close to the exact limiter's.
    assert!(total.requests > 100_000, "the simulation ran");
    assert!(wrong < 50.0, "wrong decisions {wrong:.3}% >= 50%");
    assert!((0.9..=1.1).contains(&adm), "admitted / exact {adm:.3}");
}
