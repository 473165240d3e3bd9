use super::*;

type C = Calls<u32, Vec<u32>>;

/// The calls written (each its groups).
fn write(c: &mut C, max: usize) -> Vec<Vec<Vec<u32>>> {
    weighed(c, max, usize::MAX)
}

/// The calls written, a group weighing its length.
fn weighed(c: &mut C, max: usize, max_weight: usize) -> Vec<Vec<Vec<u32>>> {
    let calls = c.write(0, max, max_weight, Vec::len);
    calls.map(|call| call.cloned().collect()).collect()
}

/// The oldest call's groups, answered.
fn answer(c: &mut C) -> Option<Vec<Vec<u32>>> {
    let peeked: Vec<Vec<u32>> = c.oldest().cloned().collect();
    let mut gs = Vec::new();
    let got = c.answered(|g| gs.push(std::mem::take(g))).map(|_| gs);
    assert_eq!(got.clone().unwrap_or_default(), peeked, "oldest() shows what answered() takes");
    got
}

#[test]
fn calls_follow_those_handed_over_until_they_are_answered_or_stale() {
    let mut h = Handed::default();
    assert!(!h.first(0, 100), "nothing handed over");
    h.note(2, 10);
    h.note(1, 20);
    assert!(h.first(50, 100));
    h.answered(2);
    assert!(h.first(60, 100), "one is not answered yet");
    h.answered(5);
    assert!(!h.first(70, 100), "all answered (more answers count as all)");
    h.note(1, 1_000);
    assert!(h.first(1_100, 100), "at the bound");
    assert!(!h.first(1_101, 100), "past it: taken as lost");
    assert!(!h.first(1_102, 100), "and forgotten");
}

#[test]
fn a_command_of_no_group_is_answered_in_its_turn() {
    let mut c = C::default();
    c.waiting(1, Vec::new, Vec::clear).push(1);
    assert_eq!(write(&mut c, 8), vec![vec![vec![1]]]);
    c.other(5);
    c.waiting(1, Vec::new, Vec::clear).push(2);
    assert!(c.in_flight());
    assert_eq!(write(&mut c, 8), Vec::<Vec<Vec<u32>>>::new(), "key 1 has a call out");
    assert_eq!(answer(&mut c), Some(vec![vec![1]]));
    // the command's reply: no group, its own time
    assert_eq!(c.oldest_at(), Some(5));
    assert_eq!(answer(&mut c), Some(vec![]));
    assert_eq!(write(&mut c, 8), vec![vec![vec![2]]]);
    assert_eq!(answer(&mut c), Some(vec![vec![2]]));
    assert!(!c.in_flight());
    assert_eq!(answer(&mut c), None);
}

#[test]
fn what_waits_is_written_early_once_enough_keys_can_go_and_few_calls_are_out() {
    let mut c = C::default();
    for k in 0..2 {
        c.waiting(k, Vec::new, Vec::clear).push(k);
    }
    assert!(!c.write_early(3, 2), "two keys can go, three are needed");
    // more requests of a key that waits already: still two keys
    c.waiting(1, Vec::new, Vec::clear).push(10);
    assert!(!c.write_early(3, 2));
    c.waiting(2, Vec::new, Vec::clear).push(2);
    assert!(c.write_early(3, 2), "three keys, no call out");
    assert_eq!(write(&mut c, 32).len(), 1);
    assert!(!c.write_early(1, 2), "nothing waits");
    // keys whose call is out wait behind it: they cannot go
    for k in 0..3 {
        c.waiting(k, Vec::new, Vec::clear).push(k);
    }
    assert!(!c.write_early(3, 2), "three wait, none can go");
    for k in 3..6 {
        c.waiting(k, Vec::new, Vec::clear).push(k);
    }
    assert!(c.write_early(3, 2), "three can go, one call out");
    assert_eq!(write(&mut c, 32).len(), 1);
    for k in 6..9 {
        c.waiting(k, Vec::new, Vec::clear).push(k);
    }
    assert!(!c.write_early(3, 2), "two calls out: the end of the turn");
    assert!(answer(&mut c).is_some());
    assert!(c.write_early(3, 2), "one answered");
}

#[test]
fn the_oldest_call_out_says_when_it_was_written() {
    let mut c = C::default();
    assert_eq!(c.oldest_at(), None);
    c.waiting(1, Vec::new, Vec::clear).push(10);
    assert_eq!(c.write(5, 8, usize::MAX, Vec::len).count(), 1);
    c.waiting(2, Vec::new, Vec::clear).push(20);
    assert_eq!(c.write(9, 8, usize::MAX, Vec::len).count(), 1);
    assert_eq!(c.oldest_at(), Some(5));
    assert_eq!(c.answered(|_| {}), Some(5));
    assert_eq!(c.oldest_at(), Some(9));
    assert_eq!(c.answered(|_| {}), Some(9));
    assert_eq!(c.oldest_at(), None);
}

#[test]
fn a_key_has_one_call_out_and_the_rest_wait_together() {
    let mut c = C::default();
    c.waiting(1, Vec::new, Vec::clear).push(10);
    c.waiting(1, Vec::new, Vec::clear).push(11);
    c.waiting(2, Vec::new, Vec::clear).push(20);
    let first = write(&mut c, 8);
    assert_eq!(first, [vec![vec![10, 11], vec![20]]], "one call, two keys");
    assert!(!c.has_waiting() && c.in_flight());
    // key 1 is out: its new requests wait, key 3 goes
    c.waiting(1, Vec::new, Vec::clear).push(12);
    c.waiting(1, Vec::new, Vec::clear).push(13);
    c.waiting(3, Vec::new, Vec::clear).push(30);
    assert_eq!(write(&mut c, 8), [vec![vec![30]]]);
    assert!(c.has_waiting());
    // answers in order free their keys
    assert_eq!(answer(&mut c), Some(first[0].clone()));
    assert_eq!(write(&mut c, 8), [vec![vec![12, 13]]]);
    assert_eq!(answer(&mut c), Some(vec![vec![30]]));
    assert_eq!(answer(&mut c), Some(vec![vec![12, 13]]));
    assert_eq!(answer(&mut c), None);
    assert!(!c.in_flight() && c.keys.len() == c.idle, "no key left behind");
}

#[test]
fn keys_are_written_in_the_order_they_became_ready_in_calls_of_at_most_max() {
    let mut c = C::default();
    for k in [5, 1, 9, 3, 7] {
        c.waiting(k, Vec::new, Vec::clear).push(k);
    }
    let calls = write(&mut c, 2);
    assert_eq!(calls, [vec![vec![5], vec![1]], vec![vec![9], vec![3]], vec![vec![7]]]);
    // 9 and 5 wait behind their calls; 5's call is answered first
    c.waiting(9, Vec::new, Vec::clear).push(90);
    c.waiting(5, Vec::new, Vec::clear).push(50);
    assert!(write(&mut c, 2).is_empty());
    assert_eq!(answer(&mut c), Some(vec![vec![5], vec![1]]));
    assert_eq!(write(&mut c, 2), [vec![vec![50]]]);
    assert_eq!(answer(&mut c), Some(vec![vec![9], vec![3]]));
    assert_eq!(write(&mut c, 2), [vec![vec![90]]]);
    assert!(!c.has_waiting());
    assert_eq!(answer(&mut c), Some(vec![vec![7]]));
    assert_eq!(answer(&mut c), Some(vec![vec![50]]));
    assert_eq!(answer(&mut c), Some(vec![vec![90]]));
    assert!(!c.in_flight() && c.keys.len() == c.idle, "no key left behind");
    assert_eq!(c.oldest().count(), 0);
}

#[test]
fn a_call_holds_at_most_max_weight_unless_one_group_weighs_more() {
    let mut c = C::default();
    for (k, n) in [(1, 2), (2, 3), (3, 9), (4, 1), (5, 1), (6, 4)] {
        c.waiting(k, Vec::new, Vec::clear).extend(std::iter::repeat_n(k, n));
    }
    let calls = weighed(&mut c, 8, 5);
    let lens: Vec<Vec<usize>> = calls.iter().map(|x| x.iter().map(Vec::len).collect()).collect();
    assert_eq!(lens, [vec![2, 3], vec![9], vec![1, 1], vec![4]]);
    for call in calls {
        assert_eq!(answer(&mut c), Some(call));
    }
    assert!(!c.in_flight() && c.keys.len() == c.idle, "no key left behind");
}

#[test]
fn drain_takes_everything_and_frees_the_keys() {
    let mut c = C::default();
    c.waiting(1, Vec::new, Vec::clear).push(1);
    assert_eq!(write(&mut c, 4).len(), 1);
    c.waiting(1, Vec::new, Vec::clear).push(2);
    c.waiting(2, Vec::new, Vec::clear).push(3);
    let (out, mut waiting) = c.drain();
    waiting.sort();
    assert_eq!(out, [vec![1]]);
    assert_eq!(waiting, [vec![2], vec![3]]);
    assert!(!c.in_flight() && !c.has_waiting());
    // key 1 is free again
    c.waiting(1, Vec::new, Vec::clear).push(4);
    assert_eq!(write(&mut c, 4), [vec![vec![4]]]);
}

/// xorshift64*: a deterministic stream for the random test.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % n
    }
}

#[test]
fn random_use_answers_every_request_once_in_order_one_call_out_per_key() {
    let mut g = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..300 {
        let mut c = C::default();
        // requests are (key << 16 | n): a key's n-th request
        let (mut pushed, mut sent) = ([0u32; 6], [0u32; 6]);
        let mut out = std::collections::HashSet::new();
        let mut calls: std::collections::VecDeque<Vec<u32>> = Default::default();
        for _ in 0..200 {
            match g.below(10) {
                0..=4 => {
                    let k = g.below(6) as u32;
                    c.waiting(k, Vec::new, Vec::clear).push(k << 16 | pushed[k as usize]);
                    pushed[k as usize] += 1;
                }
                5..=6 => {
                    let (max, max_weight) = (1 + g.below(4) as usize, 1 + g.below(8) as usize);
                    for call in weighed(&mut c, max, max_weight) {
                        let weight: usize = call.iter().map(Vec::len).sum();
                        assert!(call.len() <= max && (call.len() == 1 || weight <= max_weight));
                        let keys: Vec<u32> = call.iter().map(|gr| gr[0] >> 16).collect();
                        for &k in &keys {
                            assert!(out.insert(k), "key {k} has two calls out");
                        }
                        calls.push_back(keys);
                    }
                }
                _ => {
                    if let Some(groups) = answer(&mut c) {
                        for k in calls.pop_front().unwrap_or_default() {
                            out.remove(&k);
                        }
                        for gr in groups {
                            for r in gr {
                                let k = (r >> 16) as usize;
                                assert_eq!(r & 0xffff, sent[k], "key {k}'s requests in order");
                                sent[k] += 1;
                            }
                        }
                    }
                }
            }
        }
        // everything written and answered: every request once
        for round in 0.. {
            if !c.has_waiting() && !c.in_flight() {
                break;
            }
            assert!(round < 100, "what waits is never written");
            let _ = weighed(&mut c, 3, 5);
            while let Some(groups) = answer(&mut c) {
                for r in groups.into_iter().flatten() {
                    let k = (r >> 16) as usize;
                    assert_eq!(r & 0xffff, sent[k], "key {k}'s requests in order");
                    sent[k] += 1;
                }
            }
        }
        assert_eq!(sent, pushed, "every request answered once");
        assert!(c.keys.len() == c.idle && c.ready.is_empty(), "no key left behind");
    }
}

#[test]
fn keys_answered_stay_idle_for_their_next_request_and_are_forgotten_when_the_most() {
    let mut c = C::default();
    c.waiting(7, Vec::new, Vec::clear).push(1);
    assert_eq!(write(&mut c, 8), [vec![vec![1]]]);
    assert_eq!(answer(&mut c), Some(vec![vec![1]]));
    assert_eq!((c.keys.len(), c.idle), (1, 1), "key 7 kept, idle");
    // its next request: ready again, a place used again (no new group)
    c.waiting(7, Vec::new, Vec::clear).push(2);
    assert_eq!((c.idle, c.groups.len()), (0, 1));
    assert_eq!(write(&mut c, 8), [vec![vec![2]]]);
    assert_eq!(answer(&mut c), Some(vec![vec![2]]));
    // many keys, each once: the idle ones are taken out as they become
    // the most
    for k in 100..1100 {
        c.waiting(k, Vec::new, Vec::clear).push(k);
        assert_eq!(write(&mut c, 8), [vec![vec![k]]]);
        assert_eq!(answer(&mut c), Some(vec![vec![k]]));
        assert!(c.keys.len() <= 130, "{} keys kept", c.keys.len());
    }
    assert!(c.keys.len() == c.idle && !c.has_waiting() && !c.in_flight());
}

#[test]
fn calls_answered_are_dropped_once_they_are_the_most_and_the_rest_keep_their_order() {
    let mut c = C::default();
    for k in 0..100 {
        c.waiting(k, Vec::new, Vec::clear).push(k);
    }
    assert_eq!(write(&mut c, 1).len(), 100, "a call a key");
    for k in 0..70 {
        assert_eq!(answer(&mut c), Some(vec![vec![k]]));
    }
    assert!(c.calls.len() < 100 && c.flight.len() < 100, "answered ones dropped");
    // more written behind those still out
    c.waiting(200, Vec::new, Vec::clear).push(200);
    assert_eq!(write(&mut c, 1).len(), 1);
    for k in (70..100).chain([200]) {
        assert_eq!(answer(&mut c), Some(vec![vec![k]]));
    }
    assert_eq!(answer(&mut c), None);
    assert!(!c.in_flight() && c.calls.is_empty() && c.flight.is_empty());
}
