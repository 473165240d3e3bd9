use super::*;
use crate::bucket::{check, commit, level_of, store, Bucket, Delay};

const T0: u64 = 1_700_000_000_000;

fn r(limit: u32, period: u32) -> Rate {
    Rate { limit, period }
}

/// Redis as the script keeps a bucket: its level, drained by its clock.
struct Redis {
    level: Option<Level>,
}

impl Redis {
    /// Adds a node's debt and decides `asks` (costs) as the script does;
    /// answers the level plus a request (`held`) and the verdicts.
    fn call(
        &mut self,
        rate: Rate,
        b: &Bucket,
        owed: u64,
        asks: &[u32],
        now: u64,
    ) -> (u64, Vec<bool>) {
        let mut e = before(self.level, rate, now) + i128::from(owed);
        let verdicts = asks
            .iter()
            .map(|&c| {
                let with = (e + i128::from(c) * i128::from(MILLI)).max(0);
                let ok = with <= i128::from(b.burst) * i128::from(MILLI);
                if ok {
                    e = with;
                }
                ok
            })
            .collect();
        let held = u64::try_from(e + i128::from(MILLI)).unwrap_or(0);
        self.level = Some(crate::bucket::mirror(held, rate, now));
        (held, verdicts)
    }
}

/// One node's request: decided here when `local` says so (its debt sent
/// at once when `owed_now` takes it), else asked of Redis with the debt
/// ahead of it. Returns whether it was admitted and whether Redis was
/// called.
fn request(
    e: &mut Entry,
    redis: &mut Redis,
    rate: Rate,
    b: &Bucket,
    nodes: u32,
    now: u64,
) -> (bool, bool) {
    let c = check(Some(level_of(e)), rate, b, 1, now);
    if !c.allowed {
        return (false, false);
    }
    if local(e, rate, b.burst, &c, 1, nodes, now) {
        store(e, commit(&c, now));
        let owed = owe(e, rate, b.burst, 1, nodes, now);
        if owed > 0 {
            let (held, _) = redis.call(rate, b, owed, &[], now);
            answered(e, held, rate, now);
        }
        return (true, owed > 0);
    }
    let owed = take(e, rate, now);
    let (held, v) = redis.call(rate, b, owed, &[1], now);
    answered(e, held, rate, now);
    (v[0], true)
}

#[test]
fn a_node_that_has_not_heard_from_redis_asks_it() {
    let (rate, b) = (r(10, 1), Bucket { burst: 20, delay: Delay::Never });
    let e = Entry::default();
    let c = check(Some(level_of(&e)), rate, &b, 1, T0);
    assert!(c.allowed && !local(&e, rate, 20, &c, 1, 1, T0), "never heard: asks");
    let mut e = Entry::default();
    answered(&mut e, 0, rate, T0);
    let c = check(Some(level_of(&e)), rate, &b, 1, T0);
    assert!(local(&e, rate, 20, &c, 1, 1, T0), "heard: decides");
    assert!(!local(&e, rate, 20, &c, 1, 1, T0 + FRESH_MS + 1), "heard too long ago: asks");
}

#[test]
fn nodes_each_at_the_rate_share_it() {
    // two nodes each at 10 r/s against 10r/s burst=5: between them the
    // burst and the rate, not twice the rate (the drain is the fleet's)
    let (rate, b) = (r(10, 1), Bucket { burst: 5, delay: Delay::Never });
    let mut redis = Redis { level: None };
    let mut es = [Entry::default(), Entry::default()];
    let mut admitted = 0;
    for i in 0..100u64 {
        for (n, e) in es.iter_mut().enumerate() {
            admitted += u32::from(request(e, &mut redis, rate, &b, 2, T0 + i * 100 + n as u64).0);
        }
    }
    assert!((6 + 99..=6 + 101).contains(&admitted), "{admitted} of 200 in 10 s");
}

#[test]
fn a_hot_key_sends_its_debt_coalesced() {
    // 1000 r/s against 10000r/s burst=1000: a call per many requests
    let (rate, b) = (r(10_000, 1), Bucket { burst: 1000, delay: Delay::Never });
    let (mut e, mut redis) = (Entry::default(), Redis { level: None });
    let mut calls = 0;
    for i in 0..5000 {
        let (ok, called) = request(&mut e, &mut redis, rate, &b, 1, T0 + i);
        assert!(ok);
        calls += u32::from(called);
    }
    assert!(calls <= 50, "{calls} calls for 5000 requests");
}

#[test]
fn the_debt_is_sent_again_when_it_did_not_reach_redis() {
    let rate = r(1, 60);
    let b = Bucket { burst: 20, delay: Delay::Never };
    let mut e = Entry::default();
    answered(&mut e, 0, rate, T0);
    for _ in 0..3 {
        let c = check(Some(level_of(&e)), rate, &b, 1, T0);
        assert!(local(&e, rate, 20, &c, 1, 1, T0));
        store(&mut e, commit(&c, T0));
        e.prev += MILLI as u32;
    }
    let debt = take(&mut e, rate, T0);
    assert_eq!((debt, owed(&e)), (3 * MILLI, 0), "three requests");
    unanswered(&mut e, debt, rate, T0);
    assert_eq!(owed(&e), debt);
    // answered with them in: the view is Redis's level, nothing owed
    let debt = take(&mut e, rate, T0);
    answered(&mut e, debt, rate, T0);
    assert_eq!((owed(&e), level_of(&e).excess), (0, 2 * MILLI));
}

#[test]
fn nodes_flooding_one_key_get_one_bucket() {
    // N nodes flood a fresh key of 10r/s burst=20 nodelay, each seeing only
    // its own answers: the fleet admits what one bucket would
    for nodes in [1u32, 2, 4, 8] {
        for known in [nodes, nodes.div_ceil(4)] {
            let (rate, b) = (r(10, 1), Bucket { burst: 20, delay: Delay::Never });
            let mut redis = Redis { level: None };
            let mut es = vec![Entry::default(); nodes as usize];
            let mut admitted = 0;
            for t in 0..5000u64 {
                for e in es.iter_mut() {
                    admitted += u32::from(request(e, &mut redis, rate, &b, known, T0 + t).0);
                }
            }
            assert!(admitted <= 21 + 50, "{nodes} nodes (known {known}): {admitted}");
            assert!(admitted >= 21 + 49, "{nodes} nodes (known {known}): {admitted}");
        }
    }
}
