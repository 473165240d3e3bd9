use super::*;

const T0: u64 = 1_700_000_000_000;

fn r(limit: u32, period: u32) -> Rate {
    Rate { limit, period }
}

fn nodelay(burst: u32) -> Bucket {
    Bucket { burst, delay: Delay::Never }
}

fn delay(burst: u32, d: u32) -> Bucket {
    Bucket { burst, delay: Delay::Above(d) }
}

/// Requests of cost 1 at these times (ms after T0): each one's check, the
/// allowed ones committed.
fn run(rate: Rate, b: Bucket, at: &[u64]) -> Vec<Checked> {
    let mut level = None;
    at.iter()
        .map(|&t| {
            let c = check(level, rate, &b, 1, T0 + t);
            if c.allowed {
                level = Some(commit(&c, T0 + t));
            }
            c
        })
        .collect()
}

fn allowed(cs: &[Checked]) -> Vec<bool> {
    cs.iter().map(|c| c.allowed).collect()
}

#[test]
fn limit_req_t_burst_1_nodelay_at_2r_s() {
    // limit_req.t: 2r/s burst=1 nodelay; two pass, the third is rejected,
    // and a rejected request is not counted: 0.5 s later one passes again
    let cs = run(r(2, 1), nodelay(1), &[0, 1, 2, 3, 4, 600]);
    assert_eq!(allowed(&cs), [true, true, false, false, false, true]);
    assert!(cs.iter().all(|c| c.delay_ms == 0), "nodelay: nobody waits");
    assert_eq!(cs[0].excess, 0, "a new key's first request leaves no excess");
    assert_eq!(cs[1].excess, 1000 - 2, "1 ms drained 2 thousandths");
}

#[test]
fn limit_req_t_delays_a_request_of_a_burst_without_nodelay() {
    // limit_req.t's /long: 2r/s burst=5: the second request waits
    let cs = run(r(2, 1), delay(5, 0), &[0, 1]);
    assert_eq!(allowed(&cs), [true, true]);
    assert_eq!(cs[0].delay_ms, 0);
    assert_eq!(cs[1].delay_ms, 499, "(1000 - 2) thousandths at 2r/s, rounded down");
}

#[test]
fn limit_req_t_negative_excess() {
    // 1000r/s burst=1: two requests 100 ms apart both pass at once (the
    // excess drained below zero is floored)
    let cs = run(r(1000, 1), delay(1, 0), &[0, 100]);
    assert_eq!(allowed(&cs), [true, true]);
    assert_eq!((cs[1].excess, cs[1].delay_ms), (0, 0));
}

#[test]
fn limit_req2_t_a_bare_line_is_burst_0() {
    // 1r/m burst=0: the second request 0.1 s later is rejected; at
    // 1000r/s it passes
    assert_eq!(allowed(&run(r(1, 60), delay(0, 0), &[0, 100])), [true, false]);
    assert_eq!(allowed(&run(r(1000, 1), delay(0, 0), &[0, 100])), [true, true]);
    assert_eq!(allowed(&run(r(1, 60), nodelay(0), &[0, 100])), [true, false]);
}

#[test]
fn limit_req_delay_t_delay_1_burst_2_at_30r_m() {
    // the first two pass at once, the third waits 2 s (1 request of excess
    // above delay=1 at 0.5 r/s), the fourth, 0.2 s later, is rejected
    let cs = run(r(30, 60), delay(2, 1), &[0, 5, 10, 210]);
    assert_eq!(allowed(&cs), [true, true, true, false]);
    // (996 thousandths above delay=1 after 10 ms of drain, at 0.5 a second)
    assert_eq!(cs.iter().map(|c| c.delay_ms).collect::<Vec<_>>(), [0, 0, 1992, 0]);
}

#[test]
fn limit_req_dry_run_t_burst_2_delays_the_second() {
    // 1r/m burst=2: the second request of a key is delayed (excess 1 > 0)
    let cs = run(r(1, 60), delay(2, 0), &[0, 5]);
    assert_eq!(allowed(&cs), [true, true]);
    assert!(cs[0].delay_ms == 0 && cs[1].delay_ms > 59_000);
}

#[test]
fn a_rejected_request_says_when_one_would_pass_at_once() {
    // 10r/s burst=2 nodelay: three pass, the fourth is rejected; the next
    // passes once one request's worth has drained (100 ms)
    let cs = run(r(10, 1), nodelay(2), &[0, 0, 0, 0]);
    assert_eq!(allowed(&cs), [true, true, true, false]);
    assert_eq!(cs[3].at_once_ms, T0 + 100);
    let later = run(r(10, 1), nodelay(2), &[0, 0, 0, 99, 100]);
    assert_eq!(allowed(&later), [true, true, true, false, true]);
    assert_eq!(cs[2].remaining(&nodelay(2)), 0);
    assert_eq!(cs[1].remaining(&nodelay(2)), 1);
}

#[test]
fn a_request_s_cost_is_added_to_an_idle_key_s_credit_of_one() {
    let b = nodelay(5);
    let c = check(None, r(1, 1), &b, 3, T0);
    assert!(c.allowed);
    assert_eq!(c.excess, 2000, "cost 3 on a new key: 2 requests of excess");
    let idle = Some(Level { excess: 4000, last_ms: T0 - 3_600_000 });
    assert_eq!(check(idle, r(1, 1), &b, 3, T0).excess, 2000, "idle: the same");
    assert!(!check(None, r(1, 1), &b, 7, T0).allowed, "6 > burst 5");
    assert_eq!(check(None, r(1, 1), &b, 0, T0).excess, 0, "cost 0 adds nothing");
}

#[test]
fn every_period_drains_exactly() {
    assert_eq!(drained(r(1, 60), 60_000), 1000);
    assert_eq!(drained(r(1, 3600), 3_600_000), 1000);
    assert_eq!(drained(r(24, 86400), 3_600_000), 1000);
    assert_eq!(drained(r(1, 60), 100), 1, "1.67 thousandths, rounded down");
    assert_eq!(drain_ms(r(30, 60), 1000), 2000);
    assert_eq!(drained(r(u32::MAX, 1), u64::MAX / 2), u64::MAX, "saturates, never wraps");
}

#[test]
fn a_clock_that_goes_back_drains_nothing() {
    let l = Some(Level { excess: 1000, last_ms: T0 });
    let c = check(l, r(10, 1), &nodelay(5), 1, T0 - 5000);
    assert_eq!(c.excess, 2000);
}

#[test]
fn a_fleet_of_paced_requests_holds_burst_plus_rate() {
    // 1.5 x 10r/s for 20 s against burst=20 nodelay: at most 21 + 10 x 20
    let mut level = None;
    let mut passed = 0;
    for i in 0..300u64 {
        let t = T0 + i * 1000 / 15;
        let c = check(level, r(10, 1), &nodelay(20), 1, t);
        if c.allowed {
            level = Some(commit(&c, t));
            passed += 1;
        }
    }
    assert!(passed <= 21 + 10 * 20, "{passed}");
    assert!(passed >= 20 + 10 * 20 - 1, "{passed}");
}

#[test]
fn a_bucket_s_entry_id_is_one_per_rate_and_never_a_window_s() {
    let windows = [1u32, 60, 3600, 86400];
    let mut seen = std::collections::HashSet::new();
    for period in windows {
        for limit in [1, 2, 10, 1000, MAX_BUCKET_LIMIT] {
            let p = id_period(r(limit, period)).expect("a bucket's rate");
            assert!(!windows.contains(&p));
            assert!(seen.insert(p), "{limit} per {period}: one value per rate");
        }
    }
    assert_eq!(id_period(r(MAX_BUCKET_LIMIT + 1, 1)), None);
    assert_eq!(id_period(r(1, 7)), None);
}

#[test]
fn an_entry_keeps_a_bucket_and_a_new_one_reads_as_idle() {
    let mut e = Entry::default();
    let fresh = check(Some(level_of(&e)), r(2, 1), &nodelay(1), 1, T0);
    assert_eq!(fresh, check(None, r(2, 1), &nodelay(1), 1, T0), "new entry = new key");
    store(&mut e, commit(&fresh, T0));
    let second = check(Some(level_of(&e)), r(2, 1), &nodelay(1), 1, T0 + 1);
    assert!(second.allowed);
    store(&mut e, commit(&second, T0 + 1));
    assert!(!check(Some(level_of(&e)), r(2, 1), &nodelay(1), 1, T0 + 2).allowed);
    let full = Checked {
        allowed: true,
        excess: u64::from(MAX_BURST) * MILLI,
        delay_ms: 0,
        at_once_ms: T0,
        local: false,
        owed: 0,
    };
    store(&mut e, commit(&full, T0));
    assert_eq!(level_of(&e).excess, u64::from(MAX_BURST) * MILLI, "the largest burst fits");
}

#[test]
fn redis_s_level_kept_here_decides_as_the_script_did() {
    let (rate, b) = (r(10, 1), Bucket { burst: 5, delay: Delay::Above(2) });
    // an idle key's level (one request below empty) reads as idle here
    let idle = mirror(0, rate, T0);
    assert_eq!(check(Some(idle), rate, &b, 1, T0), check(None, rate, &b, 1, T0));
    // half a request below empty: a request leaves the excess at 500
    let half = check(Some(mirror(500, rate, T0)), rate, &b, 1, T0);
    assert!(half.allowed);
    assert!(half.excess.abs_diff(500) <= 10, "{half:?}");
    // the script admitted a request that left 4 requests of excess: it
    // waits for 2 of them to drain (200 ms at 10 r/s)
    let held = mirror(5 * MILLI, rate, T0);
    let a = admitted(Some(held), rate, &b, T0);
    assert_eq!((a.allowed, a.excess, a.delay_ms), (true, 4 * MILLI, 200));
    // rejected: told when a request would pass at once
    let full = mirror(6 * MILLI, rate, T0);
    let no = refused(Some(full), rate, &b, 1, T0);
    assert!(!no.allowed);
    assert_eq!(no.at_once_ms, T0 + 400, "{no:?}");
    // rejected although it drained since: a request's drain from now
    let later = refused(Some(held), rate, &b, 1, T0 + 1000);
    assert_eq!((later.allowed, later.at_once_ms), (false, T0 + 1100));
}
