//! Unit tests of `counter.rs`.
use super::*;

#[test]
fn cost_consumes_its_weight_and_a_heavier_request_is_refused_uncounted() {
    for backend in [false, true] {
        let mut e = Entry::default();
        // 10 per minute: three of cost 3 pass (9), a fourth of cost 3 does
        // not fit (9 + 3 - 1 >= 10) and is not counted, one of cost 1 does
        for _ in 0..3 {
            assert!(check_cost(&mut e, R, T0, 3).allowed);
            count_cost(&mut e, backend, 3);
        }
        let c = check_cost(&mut e, R, T0 + 1, 3);
        assert!(!c.allowed);
        assert!(c.retry_at_ms > T0 + 1 && c.retry_at_ms <= T0 + 1 + 60_000);
        assert!(check_cost(&mut e, R, T0 + 2, 1).allowed);
        count_cost(&mut e, backend, 1);
        assert!(!check_cost(&mut e, R, T0 + 3, 1).allowed);
        assert_eq!(e.cur + e.inflight, 10);
    }
}

#[test]
fn cost_zero_checks_without_counting_and_cost_above_the_limit_never_passes() {
    let mut e = Entry::default();
    assert!(check_cost(&mut e, R, T0, 0).allowed);
    count_cost(&mut e, true, 0);
    assert_eq!(e.inflight, 0);
    let c = check_cost(&mut e, R, T0, 11);
    assert!(!c.allowed);
    assert_eq!(c.retry_at_ms, T0 + 60_000);
    assert!(check_cost(&mut e, R, T0, 10).allowed, "cost L fits an empty window");
}

const R: Rate = Rate { limit: 10, period: 60 };
pub(crate) const T0: u64 = 1_700_000_040_000; // start of a minute

pub(crate) fn fresh() -> Entry {
    Entry::default()
}

#[test]
fn local_counting_allows_exactly_the_limit() {
    for backend in [false, true] {
        let mut e = fresh();
        let mut allowed = 0;
        for i in 0..30 {
            if check(&mut e, R, T0 + i).allowed {
                count(&mut e, backend);
                allowed += 1;
            }
        }
        assert_eq!(allowed, 10, "backend={backend}");
    }
}

#[test]
fn confirmations_replace_inflight_with_global_counts() {
    let mut e = fresh();
    for _ in 0..3 {
        assert!(check(&mut e, R, T0).allowed);
        count(&mut e, true);
    }
    assert_eq!((e.cur, e.inflight), (0, 3));
    // Redis says the window holds 8: our 3 plus 5 from other nodes.
    let idx = window_index(T0, R.period_ms());
    confirm(
        &mut e,
        &Confirmation { window: idx, sent: 3, carried: 0, cur: 8, prev: Some(0) },
        R,
        T0 + 5,
    );
    assert_eq!((e.cur, e.inflight), (8, 0));
    assert!(check(&mut e, R, T0 + 6).allowed);
    count(&mut e, true);
    assert!(check(&mut e, R, T0 + 7).allowed);
    count(&mut e, true);
    let c = check(&mut e, R, T0 + 8);
    assert!(!c.allowed);
    assert!(c.retry_at_ms >= T0 + 60_000);
}

#[test]
fn out_of_order_confirmations_keep_the_largest() {
    let mut e = fresh();
    let idx = window_index(T0, R.period_ms());
    for _ in 0..2 {
        check(&mut e, R, T0);
        count(&mut e, true);
    }
    confirm(
        &mut e,
        &Confirmation { window: idx, sent: 1, carried: 0, cur: 6, prev: Some(0) },
        R,
        T0,
    );
    confirm(
        &mut e,
        &Confirmation { window: idx, sent: 1, carried: 0, cur: 4, prev: Some(0) },
        R,
        T0,
    );
    assert_eq!((e.cur, e.inflight), (6, 0));
}

#[test]
fn breaker_opens_when_the_global_count_reaches_the_limit() {
    let mut e = fresh();
    let idx = window_index(T0, R.period_ms());
    check(&mut e, R, T0);
    count(&mut e, true);
    confirm(
        &mut e,
        &Confirmation { window: idx, sent: 1, carried: 0, cur: 10, prev: Some(0) },
        R,
        T0 + 1,
    );
    assert_eq!(e.blocked_limit, 10);
    assert_eq!(e.blocked_until_ms, T0 + 60_000 + 1);
    let c = check(&mut e, R, T0 + 2);
    assert!(!c.allowed);
    assert_eq!(c.retry_at_ms, T0 + 60_000 + 1);
    // a looser limit on the same entry is not held by that breaker
    let loose = Rate { limit: 20, period: 60 };
    assert!(check(&mut e, loose, T0 + 3).allowed);
}

#[test]
fn window_roll_carries_unconfirmed_counts_into_prev() {
    let mut e = fresh();
    for _ in 0..4 {
        check(&mut e, R, T0);
        count(&mut e, true);
    }
    // next minute, halfway: prev = 4 (all unconfirmed), weight 1/2
    let c = check(&mut e, R, T0 + 90_000);
    assert!(c.allowed);
    assert_eq!(e.prev, 4);
    assert!((c.estimate.value() - 2.0).abs() < 1e-9);
    // a late confirmation for the old window raises prev to the global count
    let old = window_index(T0, R.period_ms());
    confirm(
        &mut e,
        &Confirmation { window: old, sent: 4, carried: 0, cur: 12, prev: Some(0) },
        R,
        T0 + 90_001,
    );
    assert_eq!(e.prev, 12);
    assert_eq!(e.inflight, 0);
    // two windows later everything is forgotten
    let c = check(&mut e, R, T0 + 200_000);
    assert_eq!(e.prev, 0);
    assert!(c.allowed);
}

#[test]
fn breaker_ignores_requests_counted_twice_in_flight() {
    // Two workers each allowed 5 (inflight 10 in shared memory). Worker
    // A's INCRBY reply already includes worker B's 5 (cur = 10) before
    // B's own reply is applied: the total is briefly 15, but only the
    // global 10 may arm the breaker, and a limit of 12 is not reached.
    let r = Rate { limit: 12, period: 60 };
    let mut e = fresh();
    for _ in 0..10 {
        assert!(check(&mut e, r, T0).allowed);
        count(&mut e, true);
    }
    let idx = window_index(T0, r.period_ms());
    confirm(
        &mut e,
        &Confirmation { window: idx, sent: 5, carried: 0, cur: 10, prev: Some(0) },
        r,
        T0 + 1,
    );
    assert_eq!((e.cur, e.inflight), (10, 5));
    assert_eq!(e.blocked_until_ms, 0, "no breaker from a double count");
    // until B's reply arrives decisions are conservative...
    assert!(!check(&mut e, r, T0 + 2).allowed);
    confirm(
        &mut e,
        &Confirmation { window: idx, sent: 5, carried: 0, cur: 10, prev: Some(0) },
        r,
        T0 + 3,
    );
    // ...then exact again: 2 more pass
    assert!(check(&mut e, r, T0 + 4).allowed);
}

#[test]
fn a_check_on_redis_counts_alone_leaves_out_what_is_in_flight() {
    // A strict answer said 2 of 3, its count already holding this node's
    // unconfirmed 1: counted twice, the key would look full; Redis would
    // allow one more. The breaker still rejects.
    let r = Rate { limit: 3, period: 60 };
    let mut e = fresh();
    assert!(check(&mut e, r, T0).allowed);
    count(&mut e, true);
    let idx = window_index(T0, r.period_ms());
    let answer = Confirmation { window: idx, sent: 0, carried: 0, cur: 2, prev: Some(0) };
    confirm(&mut e, &answer, r, T0 + 1);
    assert!(!check_cost(&mut e, r, T0 + 2, 0).allowed, "2 + 1 in flight: full");
    let c = check_known(&mut e, r, T0 + 2, 0);
    assert!(c.allowed && c.cur == 2, "Redis's 2: one more");
    assert_eq!(e.inflight, 1, "what is in flight stays");
    confirm(&mut e, &Confirmation { cur: 3, ..answer }, r, T0 + 3);
    assert!(!check_known(&mut e, r, T0 + 4, 0).allowed, "Redis's 3: full");
    // a later window: nothing in flight is carried into the check
    let next = check_known(&mut e, r, T0 + 60_000, 0);
    assert_eq!((next.window, e.inflight), (idx + 1, 0));
}

const HOUR: u64 = 3_600_000;

/// Requests every 10 ms for `ms` from `start`, each confirmed by an
/// exact single-node Redis (so inflight drains): how many pass.
fn run(
    e: &mut Entry,
    r: Rate,
    start: u64,
    ms: u64,
    redis: &mut std::collections::HashMap<u64, u64>,
) -> (u32, u64) {
    let mut allowed = 0;
    let mut worst_retry = 0;
    let mut t = start;
    while t < start + ms {
        let c = check(e, r, t);
        if c.allowed {
            count(e, true);
            allowed += 1;
            let cur = redis.entry(c.window).or_default();
            *cur += 1;
            let prev = redis.get(&(c.window.wrapping_sub(1))).copied().unwrap_or(0);
            let conf = Confirmation {
                window: c.window,
                sent: 1,
                carried: 0,
                cur: *redis.get(&c.window).unwrap_or(&0),
                prev: Some(prev),
            };
            confirm(e, &conf, r, t);
        } else {
            worst_retry = worst_retry.max(c.retry_at_ms - t);
        }
        t += 10;
    }
    (allowed, worst_retry)
}

#[test]
fn clock_step_back_of_an_hour_neither_blocks_nor_floods() {
    let r = Rate { limit: 10, period: 1 };
    let mut e = fresh();
    let mut redis = std::collections::HashMap::new();
    let (a, _) = run(&mut e, r, T0, 3000, &mut redis);
    assert!((28..=31).contains(&a), "{a} in 3 s before the step");
    // an item sent just before the step comes back after it: ignored
    let late = Confirmation {
        window: window_index(T0 + 3000, 1000),
        sent: 1,
        carried: 0,
        cur: 99,
        prev: Some(99),
    };
    let back = T0 + 3000 - HOUR;
    confirm(&mut e, &late, r, back);
    let (a, worst) = run(&mut e, r, back, 10_000, &mut redis);
    assert!((95..=105).contains(&a), "{a} in 10 s after a 1 h step back");
    assert!(worst <= 1000, "Retry-After {worst} ms > the period");
}

#[test]
fn clock_step_forward_of_an_hour_forgets_and_goes_on() {
    let r = Rate { limit: 10, period: 60 };
    let mut e = fresh();
    let mut redis = std::collections::HashMap::new();
    let (a, _) = run(&mut e, r, T0, 1000, &mut redis);
    assert_eq!(a, 10);
    let (a, worst) = run(&mut e, r, T0 + HOUR, 1000, &mut redis);
    assert_eq!(a, 10, "a fresh window after the step");
    assert!(worst <= 60_000);
    // and a step back to where it was: never more than a period blocked
    let (a, worst) = run(&mut e, r, T0 + 2000, 61_000, &mut redis);
    assert!(a <= 11, "{a}");
    assert!(worst <= 60_000, "{worst}");
}

#[test]
fn a_worker_a_little_behind_keeps_the_entry() {
    let r = Rate { limit: 10, period: 1 };
    let mut e = fresh();
    let w = T0 / 1000 + 1;
    for _ in 0..10 {
        assert!(check(&mut e, r, w * 1000 + 5).allowed);
        count(&mut e, true);
    }
    // another worker's cached clock, 3 ms behind the window start
    let c = check(&mut e, r, w * 1000 - 3);
    assert!(!c.allowed);
    assert_eq!(c.window, w);
    assert_eq!(e.inflight, 10);
    // a breaker set far in the future (clock stepped back) is dropped
    e.blocked_until_ms = w * 1000 + HOUR;
    e.blocked_limit = 10;
    let c = check(&mut e, r, w * 1000 + 10);
    assert!(c.retry_at_ms <= w * 1000 + 10 + 1000);
}

#[test]
fn failed_increments_stay_counted_here() {
    let mut e = fresh();
    let c = check(&mut e, R, T0);
    count(&mut e, true);
    count(&mut e, true);
    keep_local(&mut e, c.window, 2);
    assert_eq!((e.cur, e.inflight), (2, 0));
    keep_local(&mut e, c.window + 5, 2);
    assert_eq!((e.cur, e.inflight), (2, 0));
}

#[test]
fn stale_confirmations_are_ignored() {
    let mut e = fresh();
    check(&mut e, R, T0 + 180_000);
    let old = window_index(T0, R.period_ms());
    confirm(
        &mut e,
        &Confirmation { window: old, sent: 1, carried: 0, cur: 99, prev: Some(99) },
        R,
        T0 + 180_000,
    );
    assert_eq!((e.prev, e.cur), (0, 0));
}

#[test]
fn replies_teach_the_node_its_share_of_the_key() {
    let big = Rate { limit: 6000, period: 60 };
    let mut e = fresh();
    assert_eq!(e.share, 0, "unknown until a reply");
    let w = T0 / 60_000;
    let reply = |e: &mut Entry, sent: u32, cur: u64, at: u64| {
        for _ in 0..sent {
            count(e, true);
        }
        confirm(e, &Confirmation { window: w, sent, carried: 0, cur, prev: None }, big, at);
    };
    // first contact: alone so far (cur = what it sent), believed by half
    check(&mut e, big, T0);
    reply(&mut e, 4, 4, T0 + 1);
    assert_eq!(e.share, u16::MAX / 2);
    // the count grew by 40 while it sent 10: a quarter, believed at once
    reply(&mut e, 10, 44, T0 + 2);
    assert_eq!(e.share, u16::MAX / 4);
    // alone again: it grows back slowly
    reply(&mut e, 10, 54, T0 + 3);
    assert!(e.share > u16::MAX / 4 && e.share < u16::MAX / 2, "{}", e.share);
    // a reply without increments (a refresh) teaches nothing
    let before = e.share;
    confirm(
        &mut e,
        &Confirmation { window: w, sent: 0, carried: 0, cur: 900, prev: None },
        big,
        T0 + 4,
    );
    assert_eq!(e.share, before);
    // a late reply for the window before teaches nothing either
    let mut f = fresh();
    check(&mut f, big, T0 + 60_000);
    count(&mut f, true);
    confirm(
        &mut f,
        &Confirmation { window: w, sent: 1, carried: 0, cur: 1, prev: None },
        big,
        T0 + 60_001,
    );
    assert_eq!(f.share, 0);
}

#[test]
fn a_counter_is_new_to_a_node_that_was_alone_in_the_last_count() {
    let big = Rate { limit: 1000, period: 1 };
    let mut e = fresh();
    assert!(!counter_is_new(&e), "no count from Redis yet: not known");
    e.share = u16::MAX;
    let w = roll(&mut e, T0, 1000);
    count_cost(&mut e, true, 3);
    let c = Confirmation { window: w, sent: 3, carried: 0, cur: 3, prev: None };
    confirm(&mut e, &c, big, T0 + 1);
    assert!(!counter_is_new(&e), "this window's counter exists now");
    // a second reply of the window, grown by this node's increments alone
    count_cost(&mut e, true, 1);
    let c = Confirmation { window: w, sent: 1, carried: 0, cur: 4, prev: None };
    confirm(&mut e, &c, big, T0 + 2);
    roll(&mut e, T0 + 1000, 1000);
    assert!(counter_is_new(&e), "the next window's: this node was alone in the last count");
    e.share = u16::MAX / 2;
    assert!(!counter_is_new(&e), "with half the key's traffic: another may make it first");
    e.share = u16::MAX;
    // others counted too in the next reply: no longer guessed new
    count_cost(&mut e, true, 2);
    let c = Confirmation { window: w + 1, sent: 2, carried: 0, cur: 7, prev: None };
    confirm(&mut e, &c, big, T0 + 1001);
    roll(&mut e, T0 + 2000, 1000);
    assert!(!counter_is_new(&e));
}

#[test]
fn what_a_node_knows_of_a_windows_counter() {
    let big = Rate { limit: 1000, period: 1 };
    let mut e = fresh();
    assert_eq!(super::fresh(&e), Fresh::Maybe, "first contact");
    let w = roll(&mut e, T0, 1000);
    count_cost(&mut e, true, 2);
    confirm(&mut e, &Confirmation { window: w, sent: 2, carried: 0, cur: 2, prev: None }, big, T0);
    assert_eq!(super::fresh(&e), Fresh::No, "the window's counter exists");
    roll(&mut e, T0 + 1000, 1000);
    assert!(e.share < u16::MAX / 4 * 3, "a share half learnt after one reply: {}", e.share);
    assert_eq!(super::fresh(&e), Fresh::Maybe, "its last count its own, the share not learnt yet");
    e.share = u16::MAX;
    assert_eq!(super::fresh(&e), Fresh::Alone);
    // another node counted too
    count_cost(&mut e, true, 1);
    let c = Confirmation { window: w + 1, sent: 1, carried: 0, cur: 5, prev: None };
    confirm(&mut e, &c, big, T0 + 1001);
    roll(&mut e, T0 + 2000, 1000);
    assert_eq!(super::fresh(&e), Fresh::No, "others count the key");
}

#[test]
fn a_breaker_opening_is_counted_once_per_key_and_window() {
    let mut e = Entry::default();
    e.window = 100;
    assert!(opened(&mut e));
    assert!(!opened(&mut e));
    assert!(!opened(&mut e));
    e.window = 101;
    assert!(opened(&mut e));
    assert!(!opened(&mut e));
    e.window = 0;
    assert!(opened(&mut e), "window 0 is a window like any other");
}

#[test]
fn the_usual_round_trip_is_the_shortest_of_the_last_seconds() {
    let mut rt = RoundTrip::default();
    assert_eq!(rt.usual_us(), 0, "none yet");
    rt.add(300, 10);
    rt.add(280, 20);
    // a stall: a long round trip does not move it
    rt.add(40_000, 60);
    assert_eq!(rt.usual_us(), 280);
    assert_eq!(stale_after_ms(rt.usual_us()), STALE_MIN_MS, "the least wait");
    // the next slot opens with a stall: the last slot's shortest holds
    rt.add(40_000, 1_100);
    assert_eq!(rt.usual_us(), 280);
    rt.add(290, 1_200);
    // after a pause in the traffic, the first exchange meets a stall
    rt.add(35_000, 60_000);
    assert_eq!(rt.usual_us(), 290);
    // a Redis slower for good is followed within two slots
    let mut slow = RoundTrip::default();
    slow.add(300, 0);
    for t in (1_000..3_100).step_by(100) {
        slow.add(20_000, t);
    }
    assert_eq!(slow.usual_us(), 20_000);
    assert_eq!(stale_after_ms(slow.usual_us()), 40, "two round trips");
    // a round trip below the clock's unit counts as one (0 is none)
    let mut fast = RoundTrip::default();
    fast.add(0, 5);
    assert_eq!(fast.usual_us(), 1);
}

#[test]
fn requests_a_lost_sender_held_become_local_counts_and_end_the_wait() {
    let r = Rate { limit: 100, period: 3600 };
    let mut e = fresh();
    for i in 0..30 {
        assert!(check(&mut e, r, T0 + i).allowed);
        count(&mut e, true);
        wait(&mut e, true, T0 + i);
    }
    // seconds later, no answer will come: the stale view caps the key far
    // below its limit (30 in flight against an eighth of the headroom)
    let later = T0 + 8_000;
    let mut c = check(&mut e, r, later);
    crate::share::cap_to_share(&e, r, later, 1, 100, STALE_MIN_MS, &mut c);
    assert!(!c.allowed, "stranded requests in flight hold the key back");
    assert_eq!(orphan(&mut e), 30);
    assert_eq!((e.cur, e.inflight, waited_ms(&e, later)), (30, 0, 0));
    let mut c = check(&mut e, r, later);
    crate::share::cap_to_share(&e, r, later, 1, 100, STALE_MIN_MS, &mut c);
    assert!(c.allowed, "the key has the rest of its limit");
    assert_eq!(c.cur, 30, "the requests stay counted on this node");
    // an answer for 10 of them a live sender held: nothing counted twice
    count(&mut e, true);
    let idx = window_index(later, r.period_ms());
    confirm(
        &mut e,
        &Confirmation { window: idx, sent: 10, carried: 0, cur: 10, prev: None },
        r,
        later,
    );
    assert_eq!((e.cur, e.inflight), (30, 0));
    assert_eq!(orphan(&mut e), 0, "nothing left to orphan");
}
