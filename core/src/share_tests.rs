//! `cap_to_share` and the wait for Redis's answers: what a node passes
//! blind near the limit, and once its view is stale; `cap_to_fleet_share`.
use super::*;
use crate::counter::tests::{fresh, T0};
use crate::counter::*;

/// Near the limit each node spends half its share of the confirmed
/// headroom.
fn capped(e: &mut Entry, rate: Rate, now: u64) -> bool {
    let mut c = check_cost(e, rate, now, 1);
    cap_to_share(e, rate, now, 1, 1, STALE_MIN_MS, &mut c);
    if c.allowed {
        count_cost(e, true, 1);
        // sent within a flush: near the limit, or past what it may hold
        let after = estimate(e, rate, now);
        let send = crate::sync::when(rate, after, e.inflight, e.share, now, 5_000);
        wait(e, send.prompt(), now);
    }
    c.allowed
}

#[test]
fn near_the_limit_a_node_spends_only_its_share_of_the_headroom() {
    let rate = Rate { limit: 1000, period: 60 };
    let mut e = fresh();
    roll(&mut e, T0, 60_000);
    // Redis says 900 (h = 100), this node sends a quarter of the traffic
    e.cur = 900;
    e.share = u16::MAX / 4;
    let passed = (0..100).take_while(|_| capped(&mut e, rate, T0 + 10)).count();
    assert_eq!(passed, 13, "half a quarter of 100");
    let mut c = check_cost(&mut e, rate, T0 + 10, 1);
    cap_to_share(&e, rate, T0 + 10, 1, 1, STALE_MIN_MS, &mut c);
    assert!(!c.allowed);
    assert_eq!(c.retry_at_ms, T0 + 11, "until the next reply");
    // the reply: three others with the same share sent 13 each meanwhile
    let reply =
        Confirmation { window: e.window.into(), sent: 13, carried: 0, cur: 952, prev: None };
    confirm(&mut e, &reply, rate, T0 + 11);
    assert_eq!(e.inflight, 0);
    // 48 left, the share still a quarter: half a quarter of 48
    assert_eq!((0..10).take_while(|_| capped(&mut e, rate, T0 + 12)).count(), 6);
    // the next: 9 left, and a share learnt smaller (6 of 39): half of it
    // is less than one request, but CAP_FLOOR (4) may be in flight
    let reply = Confirmation { window: e.window.into(), sent: 6, carried: 0, cur: 991, prev: None };
    confirm(&mut e, &reply, rate, T0 + 13);
    assert_eq!((0..10).take_while(|_| capped(&mut e, rate, T0 + 14)).count(), 4);
}

#[test]
fn no_cap_far_from_the_limit_or_before_the_first_reply() {
    let rate = Rate { limit: 1000, period: 60 };
    // far: 300 unconfirmed with a small share, all pass
    let mut e = fresh();
    roll(&mut e, T0, 60_000);
    e.share = u16::MAX / 32;
    assert_eq!((0..300).filter(|_| capped(&mut e, rate, T0)).count(), 300);
    // no reply yet (share 0): one node's burst on a fresh key gets the
    // whole limit, as without a cap
    let mut e = fresh();
    assert_eq!((0..1200).filter(|_| capped(&mut e, rate, T0)).count(), 1000);
    // near the limit a node spends half its share of the headroom, alone
    // or not: half of it with all the traffic, a quarter with half (two
    // such nodes together pass half the headroom, and no more than all of
    // it if each believes it has all the traffic)
    for (share, alone, passed) in [(u16::MAX, 1, 50), (u16::MAX / 2, 1, 25), (u16::MAX / 2, 0, 25)]
    {
        let mut e = fresh();
        roll(&mut e, T0, 60_000);
        e.cur = 900;
        e.share = share;
        e.alone = alone;
        assert_eq!((0..200).filter(|_| capped(&mut e, rate, T0)).count(), passed);
    }
    // a lone client's requests one after another at 5r/m, each in flight
    // when the next comes, the first reply in after the second
    let five = Rate { limit: 5, period: 60 };
    let mut e = fresh();
    let mut got = vec![capped(&mut e, five, T0), capped(&mut e, five, T0)];
    let w = e.window.into();
    confirm(
        &mut e,
        &Confirmation { window: w, sent: 1, carried: 0, cur: 1, prev: None },
        five,
        T0 + 1,
    );
    got.extend((0..5).map(|_| capped(&mut e, five, T0 + 2)));
    assert_eq!(got, [true, true, true, true, true, false, false]);
}

#[test]
fn a_stale_view_spends_only_a_share() {
    let rate = Rate { limit: 1000, period: 60 };
    // first contact: 600 pass within STALE_MIN_MS of the first request
    // sent (a lone client's burst gets the limit while Redis answers in
    // time) ...
    let mut e = fresh();
    let near = (0..600).filter(|_| capped(&mut e, rate, T0)).count();
    assert_eq!(near, 600);
    assert_eq!(e.waiting, 1, "past FIRST_SHARE's allowance: sent, waiting");
    // ... but with no reply STALE_MIN_MS later (near the limit now, by its
    // own 600), no more than half an eighth of the headroom Redis
    // confirmed (1000: nothing confirmed yet), shrunk by the wait, is in
    // flight: 600 are already, so none passes
    let late = T0 + STALE_MIN_MS + 1;
    assert_eq!((0..100).filter(|_| capped(&mut e, rate, late)).count(), 0);
    // the reply (others counted 300 meanwhile) ends the wait
    let w = e.window.into();
    confirm(
        &mut e,
        &Confirmation { window: w, sent: 600, carried: 0, cur: 900, prev: None },
        rate,
        late,
    );
    assert_eq!(waited_ms(&e, late + 100), 0);
    assert!(capped(&mut e, rate, late + 1));

    // a Redis that stalls at first contact: an eighth of the headroom
    // below half the limit, then nothing until it answers (5 a ms: 30 come
    // before the wait is stale)
    let mut e = fresh();
    let stalled = (0..400).filter(|i| capped(&mut e, rate, T0 + i / 5)).count();
    assert_eq!(stalled, 63, "an eighth of 500");

    // a lone client (its share all of the key's traffic) at 10 a second
    // goes on through a Redis stall of 3 s: its share of the 400 below
    // half the limit is all of them
    let mut e = fresh();
    roll(&mut e, T0, 60_000);
    e.cur = 100;
    e.share = u16::MAX;
    // it sent at once at T0 (past its allowance) and Redis stalls
    wait(&mut e, true, T0);
    let stall = (0..30).filter(|i| capped(&mut e, rate, T0 + i * 100)).count();
    assert_eq!((stall, e.waiting), (30, 1));

    // far from the limit: no cap while fresh, the share of the headroom
    // below half the limit once stale, however long the wait
    let far = |waited: u64| {
        let mut e = fresh();
        roll(&mut e, T0, 60_000);
        e.share = u16::MAX / 4;
        // past the allowance (a quarter of 500, over 4): sent
        let sent = (0..40).filter(|_| capped(&mut e, rate, T0)).count();
        assert_eq!((sent, e.waiting), (40, 1));
        sent + (0..400).filter(|_| capped(&mut e, rate, T0 + waited)).count()
    };
    assert_eq!(far(STALE_MIN_MS), 440, "fresh: far from the limit, no cap");
    assert_eq!(far(STALE_MIN_MS + 1), 125, "a quarter of 500");
    assert_eq!(far(1000 * STALE_MIN_MS), 125, "the same after a long wait");
    // near the limit, a stale share shrinks with the wait: the headroom it
    // was learnt against is older, and others spent it meanwhile
    let near = |waited: u64| {
        let mut e = fresh();
        roll(&mut e, T0, 60_000);
        e.cur = 900;
        e.share = u16::MAX / 4;
        assert!(capped(&mut e, rate, T0));
        assert_eq!(e.waiting, 1, "near the limit: sent at once");
        1 + (0..100).filter(|_| capped(&mut e, rate, T0 + waited)).count()
    };
    assert_eq!(near(STALE_MIN_MS), 13, "fresh: half a quarter of 100");
    assert_eq!(near(STALE_MIN_MS + 1), 11, "half a quarter of 100, times 5/6");
    assert_eq!(
        near(10 * STALE_MIN_MS),
        CAP_FLOOR as usize,
        "half a quarter of 100 times 1/10: CAP_FLOOR"
    );

    // a backend known down: on_error decides, never stale
    let mut e = fresh();
    roll(&mut e, T0, 60_000);
    e.share = u16::MAX / 4;
    e.inflight = 300;
    wait(&mut e, true, T0);
    let mut c = check_cost(&mut e, rate, T0 + 10_000, 1);
    cap_to_share(&e, rate, T0 + 10_000, 1, 1, u64::MAX, &mut c);
    assert!(c.allowed);

    // increments held far from the limit wait for nothing: a key quiet for
    // minutes is not capped when it is counted again
    let mut e = fresh();
    roll(&mut e, T0, 60_000);
    e.share = u16::MAX;
    assert!(capped(&mut e, rate, T0));
    assert_eq!(e.waiting, 0, "held, not sent");
    assert_eq!((0..50).filter(|_| capped(&mut e, rate, T0 + 50_000)).count(), 50);
}

#[test]
fn waits_wrap_without_harm() {
    let mut e = fresh();
    wait(&mut e, true, 65_535);
    assert_eq!(waited_ms(&e, 65_537), 2);
    assert_eq!(waited_ms(&e, 65_535 + 65_536), 0);
    // only the first prompt send starts the wait; a held one none
    wait(&mut e, true, 70_000);
    assert_eq!(waited_ms(&e, 70_000), 70_000 - 65_535);
    let mut h = fresh();
    wait(&mut h, false, 1);
    assert_eq!(waited_ms(&h, 1_000), 0);
    // a new window starts without a wait
    roll(&mut e, 120_000, 60_000);
    assert_eq!(waited_ms(&e, 120_001), 0);
    // an error reply ends it too: the counts stay here, nothing is awaited
    let w = e.window.into();
    count_cost(&mut e, true, 2);
    wait(&mut e, true, 120_002);
    keep_local(&mut e, w, 2);
    assert_eq!((waited_ms(&e, 130_000), e.inflight, e.cur), (0, 0, 2));
}
