use super::*;
use std::collections::HashMap;

/// The script's conn group in Rust (`strict.lua`): leases per holder,
/// `(slots, expiry)`.
#[derive(Default)]
struct Redis {
    leases: HashMap<u32, (u32, u64)>,
}

impl Redis {
    fn call(&mut self, holder: u32, mine: u32, want: u32, max: u32, lease: u64, now: u64) -> Reply {
        let before = self.leases.len();
        self.leases.retain(|&h, &mut (_, x)| h == holder || x > now);
        let expired = (before - self.leases.len()) as u32;
        let (mut others, mut holders) = (0, 0);
        for (&h, &(s, _)) in &self.leases {
            if h != holder {
                others += s;
                holders += 1;
            }
        }
        let granted = want.min(max.saturating_sub(others)).max(mine);
        if granted > 0 {
            self.leases.insert(holder, (granted, now + lease));
        } else {
            self.leases.remove(&holder);
        }
        let packed = Reply::of(
            u64::from(others) + u64::from(holders) * CONN_SPLIT,
            u64::from(granted) + u64::from(expired) * CONN_SPLIT,
        );
        assert_eq!(packed, Reply { others, holders, granted, expired });
        packed
    }

    fn leased(&self) -> u32 {
        self.leases.values().map(|&(s, _)| s).sum()
    }
}

const LEASE: u64 = 10_000;

/// One holder's call: what it uses and asks, written now, answered now.
fn call(h: &mut Holding, id: u32, redis: &mut Redis, max: u32, now: u64) {
    let want = h.want(max);
    h.asked = true;
    h.sent(h.mine, want);
    let r = redis.call(id, h.mine, want, max, LEASE, now);
    h.answered(r, now);
}

#[test]
fn a_lease_is_taken_within_then_refused_and_more_is_asked_ahead() {
    let (mut h, mut redis) = (Holding::default(), Redis::default());
    // a key new to it: the request waits for its first answer, which
    // grants what waits and no spare (it knows nothing of the others yet)
    assert_eq!(h.take(10, LEASE, 1), Take::Wait);
    h.waiting = 1;
    call(&mut h, 1, &mut redis, 10, 2);
    h.waiting = 0;
    assert_eq!((h.mine, h.granted), (0, 1));
    assert_eq!(h.take(10, LEASE, 3), Take::Taken);
    // its lease used up, the fleet not full: the next waits, and its ask
    // takes a spare (its part of half the free slots)
    assert_eq!(h.take(10, LEASE, 3), Take::Wait);
    h.waiting = 1;
    call(&mut h, 1, &mut redis, 10, 4);
    h.waiting = 0;
    assert_eq!(h.granted, 6, "1 used, 1 waiting, half of the 8 free");
    for _ in 0..4 {
        assert_eq!(h.take(10, LEASE, 5), Take::Taken);
    }
    assert!(h.ask_after_take(10), "one left of a spare of two: ask now");
    call(&mut h, 1, &mut redis, 10, 6);
    assert_eq!(h.granted, 7, "5 used and half of the 5 free, rounded down");
    for _ in 0..2 {
        assert_eq!(h.take(10, LEASE, 7), Take::Taken);
    }
    assert_eq!(h.take(10, LEASE, 7), Take::Wait, "7 granted, 7 in use, 3 free: it waits for more");
    assert!(redis.leased() <= 10);
}

#[test]
fn an_unrenewed_lease_is_not_trusted_and_an_ended_one_frees_its_slots() {
    let (mut a, mut b, mut redis) = (Holding::default(), Holding::default(), Redis::default());
    assert_eq!(a.take(4, LEASE, 1), Take::Wait);
    a.mine = 4; // four waited and were let through by its answer
    call(&mut a, 1, &mut redis, 4, 1);
    assert_eq!(a.granted, 4);
    // b finds the number leased to a
    assert_eq!(b.take(4, LEASE, 2), Take::Wait);
    call(&mut b, 2, &mut redis, 4, 2);
    assert_eq!(b.take(4, LEASE, 3), Take::Full, "all leased, said a moment ago");
    assert_eq!((b.others, b.holders), (4, 1));
    assert_eq!(b.take(4, LEASE, 2 + RECENT_MS), Take::Wait, "said a while ago: it asks");
    // a stops renewing (killed): past two thirds of the lease it would not
    // trust its lease, and past the lease Redis drops it
    assert!(a.trusted(LEASE, 1 + LEASE * 2 / 3 - 1));
    assert_eq!(a.take(4, LEASE, 1 + LEASE * 2 / 3), Take::Unsure);
    assert_eq!(b.take(4, LEASE, 1 + LEASE + 1), Take::Wait, "b's answer is old");
    b.waiting = 1;
    call(&mut b, 2, &mut redis, 4, 1 + LEASE + 1);
    b.waiting = 0;
    assert_eq!(b.others, 0);
    assert_eq!(Reply::of(0, u64::from(b.granted) + CONN_SPLIT).expired, 1);
    assert_eq!(b.take(4, LEASE, LEASE + 3), Take::Taken, "a's slots are back");
}

#[test]
fn a_renewal_gives_an_idle_key_s_lease_back_and_spare_slots_go_when_others_are_short() {
    let (mut a, mut b, mut redis) = (Holding::default(), Holding::default(), Redis::default());
    a.take(10, LEASE, 1);
    a.waiting = 1;
    call(&mut a, 1, &mut redis, 10, 1);
    a.waiting = 0;
    assert_eq!(a.granted, 1, "a first ask: what waits");
    assert_eq!(a.take(10, LEASE, 2), Take::Taken);
    a.give();
    assert_eq!(a.want(10), 5, "a slot taken since its last call: a spare kept");
    call(&mut a, 1, &mut redis, 10, 2);
    assert_eq!(a.want(10), 0, "nothing taken since its last call: the lease goes");
    assert!(a.renewal_due(LEASE, 2 + LEASE / 3));
    call(&mut a, 1, &mut redis, 10, 2 + LEASE / 3);
    assert_eq!(a.granted, 0);
    assert!(!a.idle(LEASE, 3 + LEASE / 3), "what it knows is new");
    assert!(a.idle(LEASE, 2 + LEASE), "old: forgotten");
    assert_eq!(redis.leased(), 0);

    // b leases the rest while a holds spare slots: a hands them back
    a.mine = 3;
    a.demand = true;
    call(&mut a, 1, &mut redis, 10, 20000);
    b.mine = 7;
    b.demand = true;
    call(&mut b, 2, &mut redis, 10, 20001);
    call(&mut a, 1, &mut redis, 10, 20002);
    assert_eq!(a.others + a.granted, 10, "every slot leased: {a:?}");
    a.give();
    assert!(a.ask_after_give(10), "near the number no spare is kept: the slot goes back");
    call(&mut a, 1, &mut redis, 10, 20003);
    assert_eq!(a.granted, a.mine);
}

/// Holders whose requests come and go, each request taking a slot within
/// its holder's lease or waiting for the holder's next call: the slots in
/// use never pass the number, and they are used.
#[test]
fn a_fleet_of_holders_never_passes_the_number() {
    for holders in [1u32, 2, 4, 8] {
        for max in [1u32, 3, 10, 50] {
            let mut redis = Redis::default();
            let mut hs = vec![Holding::default(); holders as usize];
            let mut waiting = vec![0u32; holders as usize];
            let (mut used, mut now) = (0, 1);
            for round in 0..200u32 {
                for (i, h) in hs.iter_mut().enumerate() {
                    // some requests end, and new ones come at once (a slot
                    // given back is wanted again before the next call)
                    if (round + i as u32).is_multiple_of(3) && h.mine > 0 {
                        h.give();
                    }
                    for _ in 0..3 {
                        if h.take(max, LEASE, now) == Take::Wait {
                            waiting[i] += 1;
                        }
                    }
                }
                let in_use: u32 = hs.iter().map(|h| h.mine).sum();
                used += in_use;
                assert!(in_use <= max, "{holders} holders, max {max}: {in_use} in use");
                for (i, h) in hs.iter_mut().enumerate() {
                    h.waiting = waiting[i];
                    call(h, i as u32, &mut redis, max, now);
                    h.waiting = 0;
                    // the waiting requests take theirs again
                    for _ in 0..std::mem::take(&mut waiting[i]) {
                        h.take(max, LEASE, now);
                    }
                }
                let in_use: u32 = hs.iter().map(|h| h.mine).sum();
                assert!(in_use <= max, "{holders} holders, max {max}: {in_use} in use");
                assert!(redis.leased() <= max, "{holders}/{max}: {} leased", redis.leased());
                now += 50;
            }
            assert!(
                used * 2 >= 199 * max.min(3 * holders),
                "{holders} holders, max {max}: {used} used"
            );
        }
    }
}

#[test]
fn a_strict_holder_holds_only_what_it_uses() {
    let (mut h, mut redis) = (Holding { strict: true, ..Holding::default() }, Redis::default());
    assert_eq!(h.take(10, LEASE, 1), Take::Wait);
    h.waiting = 2;
    call(&mut h, 1, &mut redis, 10, 2);
    h.waiting = 0;
    assert_eq!(h.granted, 2, "the two waiting, no spare");
    assert_eq!(h.take(10, LEASE, 3), Take::Taken);
    assert_eq!(h.take(10, LEASE, 3), Take::Taken);
    assert!(!h.ask_after_take(10), "nothing asked ahead");
    assert_eq!(h.take(10, LEASE, 3), Take::Wait, "a third waits for Redis");
}

#[test]
fn a_lease_shrunk_by_a_call_out_counts_as_shrunk_before_the_answer() {
    let (mut a, mut b, mut redis) = (Holding::default(), Holding::default(), Redis::default());
    a.take(10, LEASE, 1);
    a.waiting = 5;
    call(&mut a, 1, &mut redis, 10, 1);
    a.waiting = 0;
    for _ in 0..5 {
        assert_eq!(a.take(10, LEASE, 2), Take::Taken);
    }
    call(&mut a, 1, &mut redis, 10, 2);
    let big = a.granted;
    assert!(big > 5, "a spare: {big}");
    // b takes the rest, then a's requests end but three and a renewal
    // shrinking its lease is written
    b.take(10, LEASE, 3);
    b.waiting = 10;
    call(&mut b, 2, &mut redis, 10, 3);
    a.give();
    a.give();
    let want = a.want(10);
    a.asked = true;
    a.sent(a.mine, want);
    assert!(a.granted < big, "the lease counts as shrunk at once: {a:?}");
    // a slot wanted before the answer comes is not taken of what goes back
    let before = a.mine;
    let _ = a.take(10, LEASE, 4);
    let r = redis.call(1, before, want, 10, LEASE, 4);
    a.answered(r, 4);
    assert!(a.mine <= a.granted, "Redis counts every slot in use: {a:?}");
    assert!(redis.leased() <= 10);
}

#[test]
fn requests_waiting_for_a_first_answer_share_one_ask() {
    let (mut h, mut redis) = (Holding::default(), Redis::default());
    assert_eq!(h.take(3, LEASE, 1), Take::Wait);
    h.asked = true;
    h.waiting = 1;
    assert_eq!(h.take(3, LEASE, 1), Take::Wait);
    assert!(h.asked && h.waiting == 1, "the ask out and its waiting request stay: {h:?}");
    h.waiting = 2;
    call(&mut h, 1, &mut redis, 3, 2);
    h.waiting = 0;
    assert_eq!(h.granted, 2, "both waiting requests granted in one answer");
    assert_eq!(h.take(3, LEASE, 2), Take::Taken);
    assert_eq!(h.take(3, LEASE, 2), Take::Taken);
}
