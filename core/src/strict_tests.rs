use super::*;
use crate::key::EntryId;

#[test]
fn the_scripts_name_is_its_sha1() {
    assert_eq!(sha1_hex().len(), 40);
    assert!(sha1_hex().bytes().all(|b| b.is_ascii_hexdigit()));
}

#[test]
fn a_fresh_key_gets_exactly_its_limit() {
    let (cur, flags) = decide(5, 60_000, 0, 0, 0, &[1; 8]);
    assert_eq!(cur, 5);
    assert_eq!(flags, [true, true, true, true, true, false, false, false]);
}

#[test]
fn the_previous_window_weighs_by_time_left() {
    // prev 10 at a quarter into the window weighs 7.5 of 10
    let (cur, flags) = decide(10, 1000, 250, 10, 0, &[1; 4]);
    assert_eq!(flags, [true, true, true, false]);
    assert_eq!(cur, 3);
    // at the window's end the previous window weighs nothing
    let (cur, _) = decide(10, 1000, 5000, 10, 0, &[1; 12]);
    assert_eq!(cur, 10);
}

#[test]
fn costs_and_rejected_requests_are_not_counted() {
    // 3 left: a cost of 4 is refused, the 2 and the 1 after it pass
    let (cur, flags) = decide(10, 1000, 0, 0, 7, &[4, 2, 1, 1]);
    assert_eq!(flags, [false, true, true, false]);
    assert_eq!(cur, 10);
    // cost 0 checks without counting
    let (cur, flags) = decide(10, 1000, 0, 0, 9, &[0, 0]);
    assert_eq!((cur, flags), (9, vec![true, true]));
    let (_, flags) = decide(10, 1000, 0, 0, 10, &[0]);
    assert_eq!(flags, [false]);
}

/// Requests of these costs and deadlines (0 where there are fewer), with
/// tickets 1, 2, ... (a test's: leaked).
fn reqs(costs: &[u32], deadlines: &[u64]) -> &'static [Request] {
    let r = costs.iter().enumerate().map(|(i, &cost)| Request {
        ticket: crate::tickets::Ticket(i as u64 + 1),
        cost,
        deadline_ms: deadlines.get(i).copied().unwrap_or(0),
    });
    r.collect::<Vec<_>>().leak()
}

fn group(costs: &[u32], deadlines: &[u64]) -> Group<'static> {
    Group {
        tag: b"z:k",
        key: None,
        period: 60,
        window: 100,
        limit: 100,
        kind: Kind::Window,
        requests: reqs(costs, deadlines),
    }
}

fn collect(g: &Group, now_ms: u64, offset: Option<i64>) -> Vec<u64> {
    let mut out = g.limit_args(now_ms, 0).to_vec();
    g.request_args(offset, |n| out.push(n));
    out
}

#[test]
fn args_and_answers() {
    // 1.5 s into the window that starts at 6000 s; the deadline moves by
    // the clock's offset
    let g = group(&[1, 3], &[0, 1_700_000_000_500]);
    assert_eq!(
        collect(&g, 6_001_500, Some(-500)),
        [1500, 100, 60_000, 120, 2, 1, 0, 3, 1_700_000_000_000]
    );
    let g = Group { limit: 5, period: 1, window: 7, ..group(&[1], &[]) };
    assert_eq!(collect(&g, 99_999_999, None), [1000, 5, 1000, 2, 1, 1, 0]);
    let a = parse_answer(&[7, 2, 1, 0, 2], 3).unwrap();
    assert_eq!(
        a,
        Answer { cur: 7, prev: 2, allowed: smallvec::smallvec![Some(true), Some(false), None] }
    );
    assert_eq!(parse_answer(&[7, 2, 1], 2), None);
    assert_eq!(parse_answer(&[7, 2, 3], 1), None);
    assert_eq!(parse_answer(&[-1, 2, 1], 1), None);
    assert_eq!(parse_answer(&[], 0), None);
}

/// Each group's outcome, its answer as an `Answer` (`Err`: alone or bad).
fn answers(values: &[i64], requests: &[usize]) -> Vec<Result<Answer, &'static str>> {
    let mut a = Answers::new(values, requests.len(), requests.iter().sum());
    let own = |o| match o {
        Outcome::Answer(p) => {
            let a = Part::to_answer(&p);
            // what a part says is what its answer says
            for i in 0..a.allowed.len() + 1 {
                assert_eq!(Verdicts::allowed(&p, i), Verdicts::allowed(&a, i));
            }
            Ok(a)
        }
        Outcome::Alone => Err("alone"),
        Outcome::Bad => Err("bad"),
    };
    requests.iter().map(|&n| own(a.next(n))).collect()
}

#[test]
fn a_calls_answer_is_cut_into_its_groups() {
    let one = |cur, prev, f: &[Option<bool>]| {
        Ok(Answer { cur, prev, allowed: f.iter().copied().collect() })
    };
    let got = answers(&[3, 1, 1, 0, 9, 0, 0, -1, 0, 0, 0, 5, 5, 2], &[2, 1, 2, 1]);
    assert_eq!(
        got,
        [
            one(3, 1, &[Some(true), Some(false)]),
            one(9, 0, &[Some(false)]),
            Err("alone"),
            one(5, 5, &[None]),
        ]
    );
    // a flag out of range fails its group alone
    let got = answers(&[1, 0, 7, 1, 0, 1], &[1, 1]);
    assert_eq!(got, [Err("bad"), one(1, 0, &[Some(true)])]);
    // an answer of another length fails every group of the call
    for values in [&[1, 0, 1, 1, 0][..], &[1, 0, 1, 1, 0, 1, 1], &[]] {
        let got = answers(values, &[1, 1]);
        assert_eq!(got, [Err("bad"), Err("bad")], "{values:?}");
    }
}

fn text(words: &[Vec<u8>]) -> Vec<String> {
    words.iter().map(|b| String::from_utf8_lossy(b).into_owned()).collect()
}

#[test]
fn a_call_names_both_windows_and_the_time_into_the_current_one() {
    let costs = [1, 2, 3];
    let deadlines = [6_000_750, 0, COUNTED];
    let groups = [Group { limit: 5, ..group(&costs, &deadlines) }];
    let c = Call {
        prefix: b"rl:",
        now_ms: 6_000_250,
        clock_offset_ms: Some(0),
        holder: 0,
        groups: groups.iter().copied(),
    };
    let words = c.words();
    assert_eq!(text(&words)[..3], ["EVALSHA", sha1_hex(), "2"]);
    assert_eq!(
        text(&words)[3..],
        [
            "rl:{z:k}:60:6000",
            "rl:{z:k}:60:5940",
            "1",
            "250",
            "5",
            "60000",
            "120",
            "3",
            "1",
            "6000750",
            "2",
            "0",
            "3",
            "-1"
        ]
    );
    let (mut out, mut want) = (Vec::new(), Vec::new());
    c.write(&mut out, &mut Texts::default());
    resp::command(&mut want, &words);
    assert_eq!(out, want);
    let first = [Group { window: 0, requests: &[], ..groups[0] }];
    let first = Call { now_ms: 5, groups: first.iter().copied(), ..c };
    assert_eq!(first.words()[4], b"rl:{z:k}:60:0");
    // written as the words say, also where the two windows' starts
    // have different lengths (10000 and 9990) and for long names
    let long = vec![b'k'; 300];
    for (period, window, tag) in
        [(10, 1000, &b"z:k"[..]), (1, 1, b"z:k"), (3600, 7, b""), (60, 100, &long[..])]
    {
        let g = [Group { period, window, tag, ..groups[0] }];
        let c = Call { groups: g.iter().copied(), now_ms: window * u64::from(period) * 1000, ..c };
        let (mut out, mut want) = (b"+".to_vec(), b"+".to_vec());
        c.write(&mut out, &mut Texts::default());
        resp::command(&mut want, &c.words());
        assert_eq!(out, want, "{period} {window}");
    }
}

#[test]
fn a_call_of_several_groups_has_their_keys_then_their_arguments() {
    let long = vec![b'q'; 200];
    let groups = [
        group(&[1], &[0]),
        Group {
            tag: b"z:other",
            period: 1,
            window: 6_000_001,
            limit: 3,
            ..group(&[2, 0], &[0, 0])
        },
        Group { tag: &long, ..group(&[1], &[COUNTED]) },
    ];
    let c = Call {
        prefix: b"p:",
        now_ms: 6_000_001_400,
        clock_offset_ms: Some(0),
        holder: 0,
        groups: groups.iter().copied(),
    };
    let words = text(&c.words());
    assert_eq!(words[2], "6", "two keys a group");
    assert_eq!(words[3..5], ["p:{z:k}:60:6000", "p:{z:k}:60:5940"]);
    assert_eq!(words[5..7], ["p:{z:other}:1:6000001", "p:{z:other}:1:6000000"]);
    assert!(words[7].starts_with("p:{qqq") && words[8].ends_with("}:60:5940"));
    assert_eq!(words[9], "0", "no request has a deadline: no TIME");
    assert_eq!(words[10..16], ["60000", "100", "60000", "120", "1", "1"]);
    assert_eq!(words[17..26], ["400", "3", "1000", "2", "2", "2", "0", "0", "0"]);
    assert_eq!(words[26..], ["60000", "100", "60000", "120", "1", "1", "-1"]);
    let (mut out, mut want) = (Vec::new(), Vec::new());
    c.write(&mut out, &mut Texts::default());
    resp::command(&mut want, &c.words());
    assert_eq!(out, want);
    // a group of the same limit, period and window as the one before it
    // names them by `SAME_AS_BEFORE`
    let pair = [groups[0], groups[2]];
    let words = text(&Call { groups: pair.iter().copied(), ..c }.words());
    assert_eq!(words[8..], ["60000", "100", "60000", "120", "1", "1", "0", "=", "1", "1", "-1"]);
    // such groups next to each other, others between and after them
    let other = Group { tag: b"z:third", ..groups[1] };
    // the window before (1 000 ms into it, not 400)
    let before = Group { tag: b"z:fourth", window: groups[1].window - 1, ..groups[1] };
    // the same window index and period, another limit; the same window
    // index and limit, another period
    let tighter = Group { tag: b"z:fifth", limit: 7, ..before };
    let longer = Group { tag: b"z:sixth", period: 2, ..tighter };
    let mixed = [groups[0], groups[2], groups[1], other, before, tighter, longer, groups[0]];
    for n in 1..=mixed.len() {
        let c = Call { groups: mixed[..n].iter().copied(), ..c };
        let (mut out, mut want) = (Vec::new(), Vec::new());
        c.write(&mut out, &mut Texts::default());
        resp::command(&mut want, &c.words());
        assert_eq!(out, want, "{n} groups");
    }
    // a deadline in one group reads TIME for the call; none without the
    // clock's offset
    let timed = [groups[0], Group { requests: reqs(&[1], &[9]), ..groups[2] }];
    assert_eq!(text(&Call { groups: timed.iter().copied(), ..c }.words())[7], "1");
    let unknown = Call { groups: timed.iter().copied(), clock_offset_ms: None, ..c };
    assert_eq!(text(&unknown.words())[7], "0");
}

#[test]
fn deadlines_move_into_redis_clock_only_when_its_offset_is_known() {
    assert_eq!(redis_deadline(10_000, Some(250)), 10_250);
    assert_eq!(redis_deadline(10_000, Some(-250)), 9_750);
    assert_eq!(redis_deadline(10_000, None), 0);
    assert_eq!(redis_deadline(0, Some(5)), 0);
    assert_eq!(redis_deadline(COUNTED, Some(-5)), COUNTED, "a count stays a count");
    assert_eq!(redis_deadline(COUNTED, None), COUNTED);
    assert_eq!(redis_deadline(100, Some(-1_000)), 1, "never 0 (none) for a request that has one");
}

#[test]
fn the_clock_offset_is_read_at_the_middle_of_the_exchange() {
    // Redis said 1000.250 s while we read 999_900 ms then 1_000_100 ms
    assert_eq!(clock_offset(1000, 250_999, 999_900, 1_000_100), 250);
    assert_eq!(clock_offset(1000, 0, 1_000_500, 1_000_500), -500);
    assert_eq!(clock_offset(1, 0, 1001, 1002), -1);
}

#[test]
fn text_kept_from_one_call_is_written_as_it_would_be_again() {
    // one writer's calls: the text of a rate or of a window kept from a
    // call serves the next groups of that rate or window only
    let a = group(&[1], &[0]);
    let tighter = Group { limit: 7, tag: b"z:t", ..a };
    let shorter = Group { period: 1, window: 6000, tag: b"z:s", ..a };
    let huge = Group { limit: u32::MAX, period: u32::MAX, window: 1, tag: b"z:h", ..a };
    let next = Group { window: a.window + 1, ..a };
    // the first window (its previous one starts at 0 too), and one whose
    // start has a digit more than its previous one's
    let first = Group { window: 0, tag: b"z:f", ..a };
    let longer = Group { period: 10, window: 1000, ..a };
    let costly = Group { requests: reqs(&[9], &[0]), ..a };
    let counted = Group { requests: reqs(&[10], &[COUNTED]), ..a };
    // calls of one group copy their text up to the arguments from the
    // last such call when nothing of it changed
    let timed = Group { requests: reqs(&[1], &[9]), ..a };
    let two = Group { requests: reqs(&[1, 2], &[0, 0]), ..a };
    let same_length = Group { tag: b"z:j", ..a };
    // groups whose key names their tag: found by it
    let (ka, kj) = (
        Group { key: Some(EntryId([1, 2])), ..a },
        Group { key: Some(EntryId([1, 3])), ..same_length },
    );
    let calls: [&[Group]; 31] = [
        &[a],
        &[a],
        &[tighter],
        &[a, tighter],
        &[shorter, shorter, a],
        &[shorter],
        &[huge, a],
        &[huge],
        &[a],
        &[next, a],
        &[first],
        &[longer, first],
        &[longer],
        &[costly, counted],
        &[Group { requests: reqs(&[9], &[COUNTED]), ..costly }],
        &[a],
        &[timed],
        &[a],
        &[two],
        &[a],
        &[same_length],
        &[a],
        &[a], // another prefix (below)
        &[a],
        &[ka],
        &[ka],
        &[kj],
        &[ka],
        &[a],
        &[ka],
        &[same_length],
    ];
    let mut texts = Texts::default();
    for (i, groups) in calls.iter().enumerate() {
        let c = Call {
            prefix: if i == 22 { b"rm:" } else { b"rl:" },
            now_ms: 6_000_500 + i as u64,
            clock_offset_ms: Some(0),
            holder: 0,
            groups: groups.iter().copied(),
        };
        let (mut out, mut want) = (Vec::new(), Vec::new());
        c.write(&mut out, &mut texts);
        resp::command(&mut want, &c.words());
        assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&want), "call {i}");
    }
}

#[test]
fn a_bucket_group_names_its_bucket_and_reads_the_time() {
    let g = Group { kind: Kind::Bucket(20), limit: 10, period: 1, window: 0, ..group(&[1], &[]) };
    // its first argument is the mark and its burst, whatever the time
    assert_eq!(collect(&g, 6_001_500, None), [BUCKET_MARK + 20, 10, 1000, 2, 1, 1, 0]);
    let groups = [g];
    let call = Call {
        prefix: b"rl:",
        now_ms: 6_001_500,
        clock_offset_ms: None,
        holder: 0,
        groups: groups.iter().copied(),
    };
    let words = call.words();
    let text: Vec<String> = words.iter().map(|w| String::from_utf8_lossy(w).into_owned()).collect();
    assert_eq!(&text[2..6], ["2", "rl:{z:k}:1:b10", "rl:{z:k}:1:b10", "1"], "{text:?}");
    // written as RESP, the same words
    let mut out = Vec::new();
    call.write(&mut out, &mut Texts::default());
    let mut again = Vec::new();
    crate::resp::array(&mut again, words.len());
    for w in &words {
        crate::resp::bulk(&mut again, w);
    }
    assert_eq!(String::from_utf8_lossy(&out), String::from_utf8_lossy(&again));
    // a window's group after it is not "the same as before"
    let both = [g, group(&[1], &[])];
    let call = Call { groups: both.iter().copied(), ..call };
    let text: Vec<String> =
        call.words().iter().map(|w| String::from_utf8_lossy(w).into_owned()).collect();
    assert!(!text.contains(&"=".to_string()), "{text:?}");
    assert_eq!(
        text[3..7],
        ["rl:{z:k}:1:b10", "rl:{z:k}:1:b10", "rl:{z:k}:60:6000", "rl:{z:k}:60:5940"]
    );
}
