use super::*;
use crate::counter::Confirmation;
use crate::window::window_index;

const T0: u64 = 1_700_000_040_000; // start of a minute

/// `many_into` with lists of its own.
fn many<E: Entries + ?Sized>(
    entries: &mut E,
    limits: &[Limit],
    now_ms: u64,
    take: Take,
    queue: bool,
) -> (Decision, CheckedAll, Pushes) {
    let (mut all, mut pushes) = (CheckedAll::new(), Pushes::new());
    let d = many_into(entries, limits, now_ms, take, queue, &mut all, &mut pushes);
    (d, all, pushes)
}

fn lim(entry: usize, limit: u32, mode: Mode) -> Limit {
    Limit {
        entry,
        rate: Rate { limit, period: 60 },
        cost: 1,
        mode,
        strict: Strict::Background,
        stale_ms: 5,
        hold_ms: 5000,
        nodes: 0,
        bucket: None,
    }
}

fn entries(n: usize) -> Vec<Entry> {
    vec![Entry::default(); n]
}

/// An entry of a per-minute limit holding `cur` in T0's window.
fn at(cur: u32) -> Entry {
    let mut e = Entry::default();
    e.window = window_index(T0, 60_000) as u32;
    e.cur = cur;
    e
}

#[test]
fn a_limit_passes_its_requests_then_rejects_with_a_retry_time() {
    let mut es = entries(1);
    let l = lim(0, 3, Mode::Local);
    for left in [2, 1, 0] {
        let (d, _, pushes) = many(&mut es[..], &[l], T0, Take::IfAllowed, true);
        assert!(d.allowed && d.limit == 3 && d.remaining() == left);
        assert!(pushes.is_empty(), "counted locally: nothing to push");
    }
    let (d, _, _) = many(&mut es[..], &[l], T0 + 10, Take::IfAllowed, true);
    assert!(!d.allowed && d.limit == 0 && d.remaining() == 0);
    // the 3 weigh into the next window: a little after it starts
    assert!(d.retry_at_ms > T0 + 60_000 && d.retry_at_ms < T0 + 120_000, "{}", d.retry_at_ms);
    assert_eq!(es[0].cur, 3, "the rejected request is not counted");
}

#[test]
fn limits_of_one_entry_count_the_request_once_at_the_heaviest_cost() {
    let mut es = entries(1);
    let a = Limit { cost: 1, ..lim(0, 100, Mode::Remote) };
    let b = Limit { cost: 3, ..lim(0, 50, Mode::Remote) };
    let (d, all, pushes) = many(&mut es[..], &[a, b], T0, Take::IfAllowed, true);
    assert!(d.allowed);
    assert_eq!(es[0].inflight, 3);
    assert_eq!(pushes.len(), 1);
    assert_eq!((pushes[0].limit_index, pushes[0].limit, pushes[0].n), (0, 50, 3));
    assert_eq!(all[0].after, all[1].after, "both see the entry after the count");
    assert_eq!(d.tightest, 1, "the fewest left: 47 of 50");
}

#[test]
fn a_rejecting_limit_stops_the_count_of_every_other() {
    let mut es = [at(0), at(5)];
    let loose = lim(0, 100, Mode::Local);
    let tight = lim(1, 5, Mode::Local);
    let (d, all, _) = many(&mut es[..], &[loose, tight], T0, Take::IfAllowed, true);
    assert!(!d.allowed);
    assert_eq!(d.tightest, 1, "the first that rejected");
    assert_eq!(d.retry_at_ms, all[1].check.retry_at_ms);
    assert_eq!((es[0].cur, es[1].cur), (0, 5), "neither counted");
    // Take::Always counts it anyway (Lua's `measure`, a count after the
    // response); Take::Never counts nothing even when allowed
    let (d, _, _) = many(&mut es[..], &[loose, tight], T0, Take::Always, true);
    assert!(!d.allowed && es[0].cur == 1 && es[1].cur == 6);
    let (d, _, _) = many(&mut es[..], &[loose], T0, Take::Never, true);
    assert!(d.allowed && es[0].cur == 1);
}

#[test]
fn the_retry_time_is_the_latest_of_the_rejecting_limits() {
    let mut es = [at(10), at(10)];
    es[0].window = window_index(T0 + 100, 1000) as u32;
    let short = Limit { rate: Rate { limit: 10, period: 1 }, ..lim(0, 0, Mode::Local) };
    let long = lim(1, 10, Mode::Local);
    let (d, all, _) = many(&mut es[..], &[short, long], T0 + 100, Take::IfAllowed, true);
    assert!(!d.allowed && d.tightest == 0);
    assert!(all[1].check.retry_at_ms > all[0].check.retry_at_ms);
    assert_eq!(d.retry_at_ms, all[1].check.retry_at_ms);
}

#[test]
fn a_backend_down_decides_as_on_error_says() {
    let mut es = [at(10)];
    let (d, _, pushes) = many(&mut es[..], &[lim(0, 10, Mode::Allow)], T0, Take::IfAllowed, true);
    assert!(d.allowed && pushes.is_empty() && es[0].cur == 10 && es[0].inflight == 0);
    es[0].cur = 0;
    let (d, _, _) = many(&mut es[..], &[lim(0, 10, Mode::Deny)], T0, Take::IfAllowed, true);
    assert!(!d.allowed && d.retry_at_ms == T0 + DENY_RETRY_MS && es[0].cur == 0);
}

#[test]
fn redis_verdicts_replace_the_counts_and_redis_counted_what_it_allowed() {
    let mut es = [at(10)]; // full here
    let allowed = Limit { strict: Strict::Allowed, ..lim(0, 10, Mode::Remote) };
    let (d, _, pushes) = many(&mut es[..], &[allowed], T0, Take::IfAllowed, true);
    assert!(d.allowed && pushes.is_empty() && es[0].inflight == 0, "Redis counted it");
    es[0].cur = 0;
    let rejected = Limit { strict: Strict::Rejected, ..allowed };
    let (d, _, _) = many(&mut es[..], &[rejected], T0, Take::IfAllowed, true);
    assert!(!d.allowed && d.retry_at_ms == T0 + DENY_RETRY_MS);
    // no answer: the counts here decide (on_error=local), and count
    let failed = Limit { strict: Strict::Failed, ..allowed };
    let (d, _, pushes) = many(&mut es[..], &[failed], T0, Take::IfAllowed, true);
    assert!(d.allowed && es[0].inflight == 1 && pushes.len() == 1);
}

#[test]
fn a_count_after_the_response_is_in_flight_and_pushed_by_the_caller() {
    let mut es = entries(1);
    let later = Limit { strict: Strict::CountOnly, cost: 2, ..lim(0, 3, Mode::Remote) };
    let (_, _, pushes) = many(&mut es[..], &[later], T0, Take::Always, true);
    assert!(pushes.is_empty());
    assert_eq!(es[0].inflight, 2);
}

#[test]
fn a_check_before_a_strict_wait_leaves_out_what_is_in_flight() {
    let mut es = [at(2)];
    es[0].inflight = 1;
    let before = Limit { strict: Strict::Asking, cost: 0, ..lim(0, 3, Mode::Remote) };
    let (d, _, _) = many(&mut es[..], &[before], T0, Take::Never, true);
    assert!(d.allowed, "Redis's 2 of 3: Redis decides");
    let plain = Limit { strict: Strict::Background, ..before };
    let (d, _, _) = many(&mut es[..], &[plain], T0, Take::Never, true);
    assert!(!d.allowed, "with the 1 in flight: full");
}

#[test]
fn near_the_limit_an_increment_goes_at_once_and_far_from_it_waits() {
    // a node alone on the key (its share all of it) may hold a few
    let mut es = [at(0)];
    es[0].share = u16::MAX;
    let l = lim(0, 100, Mode::Remote);
    let (_, _, pushes) = many(&mut es[..], &[l], T0, Take::IfAllowed, true);
    assert!(matches!(pushes[0].due, Due::Hold(..)) && es[0].waiting == 0);
    es[0].cur = 60;
    let (_, _, pushes) = many(&mut es[..], &[l], T0, Take::IfAllowed, true);
    assert_eq!(pushes[0].due, Due::Now);
    assert_eq!(es[0].waiting, 1, "sent promptly: it waits for Redis's answer");
    let (_, _, pushes) = many(&mut es[..], &[l], T0, Take::IfAllowed, false);
    assert!(pushes.is_empty(), "no thread: nothing to push");
}

#[test]
fn near_the_limit_a_node_spends_no_more_than_its_share_of_the_headroom() {
    let mut es = [at(60)];
    let l = lim(0, 100, Mode::Remote);
    let idx = window_index(T0, 60_000);
    es[0].share = u16::MAX / 10; // a tenth of the key's traffic
    let mut passed = 0;
    for i in 0..40 {
        if many(&mut es[..], &[l], T0 + i, Take::IfAllowed, true).0.allowed {
            passed += 1;
        }
    }
    assert_eq!(passed, 4, "a tenth of the 40 left, before Redis answers");
    let c = Confirmation { window: idx, sent: 4, carried: 0, cur: 64, prev: Some(0) };
    counter::confirm(&mut es[0], &c, l.rate, T0 + 50);
    assert!(many(&mut es[..], &[l], T0 + 51, Take::IfAllowed, true).0.allowed);
}

#[test]
fn with_redis_down_and_on_error_share_a_node_passes_its_share() {
    // a key first seen during the outage, four nodes: L/4 here
    let mut es = entries(1);
    let l = Limit { nodes: 4, ..lim(0, 40, Mode::Share) };
    let passed = (0..40)
        .filter(|&i| many(&mut es[..], &[l], T0 + i, Take::IfAllowed, true).0.allowed)
        .count();
    assert_eq!(passed, 10);
    assert_eq!(es[0].inflight, 10, "counted, to be sent once Redis is back");
    // a known key: 16 of 40 counted in Redis, this node sends 70 % of the
    // key's traffic: 70 % of the 24 left
    let mut es = [at(16)];
    es[0].share = (u32::from(u16::MAX) * 7 / 10) as u16;
    let passed = (0..40)
        .filter(|&i| many(&mut es[..], &[l], T0 + i, Take::IfAllowed, true).0.allowed)
        .count();
    assert_eq!(passed, 17);
    // never less than one a window; nodes not known: the node alone
    let mut es = [at(0)];
    es[0].share = 1;
    let passed = (0..5)
        .filter(|&i| many(&mut es[..], &[l], T0 + i, Take::IfAllowed, true).0.allowed)
        .count();
    assert_eq!(passed, 1);
    let (d, _, _) = many(&mut es[..], &[l], T0 + 9, Take::IfAllowed, true);
    assert_eq!(d.retry_at_ms, T0 + 60_000, "until the window ends");
    let mut es = entries(1);
    let alone = Limit { nodes: 0, ..l };
    let passed = (0..50)
        .filter(|&i| many(&mut es[..], &[alone], T0 + i, Take::IfAllowed, true).0.allowed)
        .count();
    assert_eq!(passed, 40);
}

/// A small deterministic generator (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }

    fn pick<T: Copy>(&mut self, xs: &[T]) -> T {
        xs[self.below(xs.len() as u64) as usize]
    }
}

fn random_limit(g: &mut Rng, entry: usize) -> Limit {
    Limit {
        entry,
        rate: Rate { limit: g.pick(&[1, 3, 10, 40, 1000]), period: g.pick(&[1, 60, 3600]) },
        cost: g.pick(&[0, 1, 1, 1, 2, 5]),
        mode: g.pick(&[
            Mode::Remote,
            Mode::Remote,
            Mode::Local,
            Mode::Allow,
            Mode::Deny,
            Mode::Share,
        ]),
        strict: Strict::Background,
        stale_ms: g.pick(&[5, 40, u64::MAX]),
        hold_ms: g.pick(&[0, 5000]),
        nodes: g.pick(&[0, 1, 4]),
        bucket: None,
    }
}

/// What Redis might answer for what the entry holds: a count that grew by
/// this node's increments and maybe others', or an error reply.
fn random_reply(g: &mut Rng, e: &mut Entry, rate: Rate, now: u64) {
    let window = window_index(now, rate.period_ms());
    let sent = if e.inflight == 0 { 0 } else { g.below(u64::from(e.inflight) + 1) as u32 };
    if g.below(8) == 0 {
        counter::keep_local(e, window, sent);
        return;
    }
    let others = g.pick(&[0, 0, 1, 3, 20]);
    let cur = u64::from(e.cur) + u64::from(sent) + others;
    let c = Confirmation { window, sent, carried: 0, cur, prev: Some(u64::from(e.prev)) };
    counter::confirm(e, &c, rate, now);
}

#[test]
fn the_one_limit_path_decides_as_the_general_path() {
    let mut g = Rng(0x9e37_79b9_7f4a_7c15);
    let mut decisions = 0;
    for _ in 0..400 {
        let mut e = Entry::default();
        let mut now = T0 + g.below(120_000);
        for _ in 0..200 {
            let strict = g.pick(&[
                Strict::Background,
                Strict::Background,
                Strict::Background,
                Strict::Asking,
                Strict::CountOnly,
                Strict::Allowed,
                Strict::Rejected,
                Strict::Failed,
            ]);
            let l = Limit { strict, ..random_limit(&mut g, 0) };
            let take = g.pick(&[Take::IfAllowed, Take::IfAllowed, Take::Always, Take::Never]);
            let queue = g.below(4) != 0;
            let mut a = e;
            let mut b = [e];
            let (d1, p1) = one(&mut a, &l, now, take, queue);
            let (d2, all, p2) = many(&mut b[..], &[l], now, take, queue);
            assert_eq!(d1, d2, "{l:?} {take:?} on {e:?} at {now}");
            assert_eq!(all[0], d2.checked);
            assert_eq!(p1, p2.first().copied(), "{l:?} {take:?} on {e:?}");
            assert_eq!(a, b[0], "{l:?} {take:?} on {e:?}");
            e = a;
            decisions += 1;
            now += g.pick(&[0, 1, 3, 20, 500, 30_000]);
            if g.below(3) == 0 {
                random_reply(&mut g, &mut e, l.rate, now);
            }
        }
    }
    assert_eq!(decisions, 80_000);
}

#[test]
fn several_limits_count_each_entry_once_whatever_their_order() {
    // random requests of 1 to 4 limits over 1 to 3 entries: an allowed
    // request adds its heaviest cost once to each entry it counts in; a
    // rejected one adds nothing; one increment is pushed per entry counted
    // through Redis, for its tightest limit
    let mut g = Rng(0x5151_7e57_d00d_f00d);
    for _ in 0..20_000 {
        let n_entries = 1 + g.below(3) as usize;
        let mut es = entries(n_entries);
        for e in &mut es {
            e.window = window_index(T0, 60_000) as u32;
            e.cur = g.pick(&[0, 2, 30, 999]);
        }
        let n = 1 + g.below(4) as usize;
        let limits: Vec<Limit> = (0..n)
            .map(|_| {
                let entry = g.below(n_entries as u64) as usize;
                Limit {
                    rate: Rate { limit: g.pick(&[3, 40, 1000]), period: 60 },
                    ..random_limit(&mut g, entry)
                }
            })
            .collect();
        let before = es.clone();
        let (d, all, pushes) = many(&mut es[..], &limits, T0 + 10, Take::IfAllowed, true);
        assert_eq!(d.allowed, all.iter().all(|c| c.check.allowed));
        for (i, e) in es.iter().enumerate() {
            let mine: Vec<&Limit> = limits.iter().filter(|l| l.entry == i).collect();
            let added = (e.cur + e.inflight) - (before[i].cur + before[i].inflight);
            let counts = d.allowed && mine.first().is_some_and(|l| l.mode.counts());
            let heaviest = mine.iter().map(|l| l.cost).max().unwrap_or(0);
            assert_eq!(added, if counts { heaviest } else { 0 }, "{limits:?}");
            let pushed: Vec<&Push> =
                pushes.iter().filter(|p| limits[p.limit_index].entry == i).collect();
            let remote = counts && mine[0].mode.remote() && heaviest > 0;
            assert_eq!(pushed.len(), usize::from(remote), "{limits:?}");
            if let Some(p) = pushed.first() {
                assert_eq!(p.limit, mine.iter().map(|l| l.rate.limit).min().unwrap_or(0));
                assert_eq!(p.n, heaviest);
            }
        }
        if d.allowed {
            let least = limits.iter().zip(&all).map(|(l, c)| c.after.remaining(l.rate.limit)).min();
            assert_eq!(Some(d.remaining()), least);
        } else {
            assert!(!all[d.tightest].check.allowed);
            assert!(all[..d.tightest].iter().all(|c| c.check.allowed));
        }
    }
}
