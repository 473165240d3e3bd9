//! Unit tests of `batch.rs`.
use super::*;
use crate::key::EntryId;

/// `Batch::add` with a due time as before carries (0: at once).
#[allow(clippy::too_many_arguments)]
fn add(
    b: &mut Batch,
    id: ItemId,
    ns: &[u8],
    key: &[u8],
    period: u32,
    limit: u32,
    n: u32,
    due: u64,
) -> bool {
    let send = if due == 0 { Due::Now } else { Due::By(due) };
    b.add(id, &Increment { namespace: ns, key, period, limit, n, fresh: Fresh::No }, send).is_some()
}

/// An increment of `n` for the key (`ns`, `key`) under a period, for the
/// tightest limit `limit`.
fn inc<'a>(
    ns: &'a [u8],
    key: &'a [u8],
    period: u32,
    limit: u32,
    n: u32,
    fresh: Fresh,
) -> Increment<'a> {
    Increment { namespace: ns, key, period, limit, n, fresh }
}

fn id(zone: u32, e: u64, window: u64) -> ItemId {
    ItemId { zone, entry: EntryId([e, 0]), window }
}

/// Lua's reset of key `ns:key` (entry `[entry, 0]` of zone 0) for the
/// thread to send.
fn delete_of(entry: u64, ns: &[u8], key: &[u8], period: u32, window: u64) -> Delete {
    Delete {
        zone: 0,
        entry: EntryId([entry, 0]),
        tag: redis_tag(ns, key),
        period,
        window,
        bucket: None,
        command: true,
    }
}

#[test]
fn coalesces_per_key_and_window() {
    let mut b = Batch::new(10, 1 << 20);
    for _ in 0..1000 {
        assert!(add(&mut b, id(0, 1, 5), b"z", b"hot", 1, 100, 1, 0));
    }
    assert!(add(&mut b, id(0, 1, 6), b"z", b"hot", 1, 100, 1, 0));
    assert!(add(&mut b, id(1, 1, 5), b"z", b"hot", 1, 50, 1, 0));
    assert_eq!(b.len(), 3);
    let mut items = b.drain().0;
    items.sort_by_key(|(i, _)| (i.zone, i.window));
    assert_eq!(items[0].1.n, 1000);
    assert_eq!(&*items[0].1.tag, b"z:hot");
    assert_eq!(items[1].1.n, 1);
    assert_eq!(items[2].1.limit, 50);
    assert!(b.is_empty());
}

#[test]
fn keeps_the_tightest_limit() {
    let mut b = Batch::new(10, 1 << 20);
    add(&mut b, id(0, 1, 5), b"z", b"k", 60, 100, 1, 0);
    add(&mut b, id(0, 1, 5), b"z", b"k", 60, 10, 1, 0);
    add(&mut b, id(0, 1, 5), b"z", b"k", 60, 50, 1, 0);
    assert_eq!(b.drain().0[0].1.limit, 10);
}

#[test]
fn drops_new_items_when_full_but_still_coalesces() {
    let mut b = Batch::new(2, 1 << 20);
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 1, 1, 1, 0));
    assert!(add(&mut b, id(0, 2, 0), b"z", b"b", 1, 1, 1, 0));
    assert!(!add(&mut b, id(0, 3, 0), b"z", b"c", 1, 1, 1, 0));
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 1, 1, 1, 0));
    assert_eq!(b.dropped, 1);
    assert_eq!(b.drain().0.len(), 2);
    assert!(add(&mut b, id(0, 3, 0), b"z", b"c", 1, 1, 1, 0));
}

#[test]
fn bounded_in_bytes_whatever_the_key_size() {
    // 5 000 distinct 7 KB keys: each item holds a 73-byte tag, and the
    // byte bound stops the batch long before the keys' own size would
    let mut b = Batch::new(1 << 16, 64 * 1024);
    let mut kept = 0;
    for n in 0..5000u64 {
        let mut key = vec![b'k'; 7000];
        key.extend_from_slice(&n.to_le_bytes());
        if add(&mut b, id(0, n, 0), b"z", &key, 60, 10, 1, 0) {
            kept += 1;
        }
    }
    assert!(b.bytes() <= 64 * 1024, "{}", b.bytes());
    assert_eq!(kept, 64 * 1024 / (ITEM_OVERHEAD + 2 + 71));
    assert_eq!(b.dropped, 5000 - kept as u64);
    b.drain();
    assert_eq!(b.bytes(), 0);
}

#[test]
fn deletes_drop_pending_increments_of_their_key() {
    let mut b = Batch::new(4, 1 << 20);
    assert!(b.is_empty());
    assert!(add(&mut b, id(0, 9, 7), b"ns", b"k", 60, 5, 1, 0));
    assert!(add(&mut b, id(0, 8, 7), b"ns", b"other", 60, 5, 1, 0));
    let d = delete_of(9, b"ns", b"k", 60, 7);
    assert!(b.delete(d.clone()));
    assert!(!b.is_empty());
    let (items, deletes) = b.drain();
    assert_eq!(items.len(), 1, "the deleted key's pending increment is gone");
    assert_eq!(&*items[0].1.tag, b"ns:other");
    assert_eq!(deletes, vec![d]);
    assert!(b.is_empty());
}

#[test]
fn items_wait_until_due_and_go_at_the_earlier_time_once_coalesced() {
    let mut b = Batch::new(100, 1 << 20);
    assert_eq!(b.next_due(), None);
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 60, 100, 1, 5_000));
    assert!(add(&mut b, id(0, 2, 0), b"z", b"b", 60, 100, 1, 3_000));
    assert_eq!(b.next_due(), Some(3_000));
    let (items, _) = b.drain_due(2_999, usize::MAX, 1 << 20);
    assert!(items.is_empty());
    let (items, _) = b.drain_due(3_000, usize::MAX, 1 << 20);
    assert_eq!(items.len(), 1);
    assert_eq!(&*items[0].1.tag, b"z:b");
    assert_eq!(b.next_due(), Some(5_000));
    // a later request of `a` that must go at once takes the rest with it
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 60, 100, 2, 0));
    assert_eq!(b.next_due(), Some(0));
    let (items, _) = b.drain_due(3_001, usize::MAX, 1 << 20);
    assert_eq!(items.len(), 1);
    assert_eq!(items[0].1.n, 3);
    assert!(b.is_empty());
    // its old entry is skipped, not sent again
    assert_eq!(b.next_due(), None);
    assert_eq!(b.bytes(), 0);
}

#[test]
fn waiting_is_bounded_by_bytes_and_entries() {
    let mut b = Batch::new(1 << 16, 1 << 20);
    for n in 0..100u64 {
        assert!(add(&mut b, id(0, n, 0), b"z", &n.to_le_bytes(), 60, 100, 1, 10_000 + n));
    }
    let held = b.bytes();
    // under the hold budget nothing is due yet
    assert!(b.drain_due(1, usize::MAX, held).0.is_empty());
    // past it, the earliest due go until a quarter of the budget is free
    let per = held / 100;
    let (items, _) = b.drain_due(1, usize::MAX, 80 * per);
    assert_eq!(items.len(), 40, "down to 60 items: three quarters of 80");
    let dues: Vec<u64> = items.iter().map(|(_, i)| i.due).collect();
    assert_eq!(dues, (10_000..10_040).collect::<Vec<u64>>(), "the earliest due first");
    assert_eq!(b.bytes(), 60 * per);
    let (items, _) = b.drain_due(1, usize::MAX, 1);
    assert_eq!(items.len(), 60);
    assert_eq!(b.bytes(), 0);
    // items sent at once leave stale entries behind: compacted
    for round in 0..50u64 {
        for n in 0..10u64 {
            assert!(add(&mut b, id(0, n, round), b"z", b"k", 60, 100, 1, 50_000));
            assert!(add(&mut b, id(0, n, round), b"z", b"k", 60, 100, 1, 0));
        }
        assert_eq!(b.drain_due(1, usize::MAX, 1 << 20).0.len(), 10);
    }
    assert!(b.later.len() <= 64 + 2 * b.len(), "{} entries", b.later.len());
}

#[test]
fn deletes_are_due_at_once_and_keep_the_byte_count_true() {
    let mut b = Batch::new(100, 1 << 20);
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 60, 100, 1, 9_000));
    assert!(add(&mut b, id(0, 2, 0), b"z", b"b", 60, 100, 1, 9_000));
    let one = b.bytes() / 2;
    let d = delete_of(1, b"z", b"a", 60, 0);
    assert!(b.delete(d));
    assert_eq!(b.next_due(), Some(0));
    let (items, deletes) = b.drain_due(1, usize::MAX, 1 << 20);
    assert!(items.is_empty());
    assert_eq!(deletes.len(), 1);
    assert_eq!(b.bytes(), one);
    assert_eq!(b.next_due(), Some(9_000));
}

#[test]
fn deletes_taken_alone_leave_the_items_and_their_bytes() {
    let mut b = Batch::new(100, 1 << 20);
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 60, 100, 1, 9_000));
    assert!(add(&mut b, id(0, 2, 0), b"z", b"b", 60, 100, 1, 9_000));
    let one = b.bytes() / 2;
    let tag = redis_tag(b"z", b"a");
    let d = Delete {
        zone: 0,
        entry: EntryId([1, 0]),
        tag,
        period: 60,
        window: 0,
        bucket: None,
        command: false,
    };
    assert!(b.delete(d.clone()));
    assert!(b.bytes() > one, "the delete holds bytes until it is taken");
    assert_eq!(b.take_deletes(), vec![d]);
    assert_eq!(b.bytes(), one);
    assert_eq!(b.len(), 1, "the other key's increment still waits");
    assert_eq!(b.next_due(), Some(9_000));
    assert!(b.take_deletes().is_empty());
}

#[test]
fn a_backlog_goes_in_chunks_and_what_is_urgent_never_waits_behind_it() {
    let mut b = Batch::new(1 << 16, 1 << 20);
    for n in 0..1000u64 {
        assert!(add(&mut b, id(0, n, 0), b"z", &n.to_le_bytes(), 1, 100, 1, 500 + n));
    }
    assert!(add(&mut b, id(0, 5000, 0), b"z", b"hot", 1, 100, 1, 0));
    let (items, _) = b.drain_due(10_000, 300, 1 << 20);
    assert_eq!(items.len(), 301, "the urgent item and the 300 earliest");
    assert_eq!(&*items[0].1.tag, b"z:hot");
    assert_eq!(items[1].1.due, 500);
    assert_eq!(b.len(), 700);
    assert_eq!(b.next_due(), Some(800));
}

#[test]
fn pending_increments_by_zone() {
    let mut b = Batch::new(100, 1 << 20);
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 60, 100, 3, 9_000));
    assert!(add(&mut b, id(0, 1, 0), b"z", b"a", 60, 100, 2, 9_000));
    assert!(add(&mut b, id(2, 1, 0), b"y", b"a", 60, 100, 1, 0));
    assert_eq!((b.pending(0), b.pending(1), b.pending(2)), (5, 0, 1));
    b.drain_due(1, usize::MAX, 1 << 20);
    assert_eq!((b.pending(0), b.pending(2)), (5, 0));
    let d = delete_of(1, b"z", b"a", 60, 0);
    assert!(b.delete(d));
    assert_eq!(b.pending(0), 0);
    assert!(add(&mut b, id(0, 2, 0), b"z", b"b", 60, 100, 4, 9_000));
    b.drain();
    assert_eq!(b.pending(0), 0);
}

#[test]
fn a_quiet_key_carries_what_it_holds_into_the_next_window() {
    let mut b = Batch::new(100, 1 << 20);
    // window 5: three held requests (room 10)
    for due in [5_000, 5_100, 5_200] {
        assert!(b
            .add(id(0, 1, 5), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(due, 10))
            .is_some());
    }
    // window 6: the new item takes them over, keeps the earlier due time
    assert_eq!(
        b.add(id(0, 1, 6), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(6_000, 9)),
        Some(5_000)
    );
    assert_eq!(b.len(), 1);
    assert_eq!(b.pending(0), 4);
    // ... and carries them again into window 8 (a window without requests)
    assert!(b
        .add(id(0, 1, 8), &inc(b"z", b"k", 1, 100, 2, Fresh::No), Due::Hold(8_000, 4))
        .is_some());
    let (out, _) = b.drain_due(5_000, 100, 1 << 20);
    assert_eq!(out.len(), 1);
    let (got, item) = &out[0];
    assert_eq!((got.window, item.n, item.carried, item.total(), item.due), (8, 2, 4, 6, 5_000));
    assert_eq!(b.pending(0), 0);
}

#[test]
fn held_increments_past_the_room_or_near_the_limit_are_not_carried() {
    let mut b = Batch::new(100, 1 << 20);
    for _ in 0..5 {
        b.add(id(0, 1, 5), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(9_000, 10));
    }
    // room 4 < 5 held: a new item, and the old one goes with the next flush
    assert_eq!(
        b.add(id(0, 1, 6), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(9_500, 4)),
        Some(1)
    );
    let (out, _) = b.drain_due(2, 100, 1 << 20);
    assert_eq!(out.iter().map(|(i, it)| (i.window, it.total())).collect::<Vec<_>>(), [(5, 5)]);
    // an item with a push near the limit is never carried
    b.add(id(0, 2, 5), &inc(b"z", b"j", 1, 100, 1, Fresh::No), Due::Hold(9_000, 10));
    b.add(id(0, 2, 5), &inc(b"z", b"j", 1, 100, 1, Fresh::No), Due::Now);
    b.add(id(0, 2, 6), &inc(b"z", b"j", 1, 100, 1, Fresh::No), Due::Hold(9_000, 10));
    assert_eq!(b.len(), 3, "window 6 of k, windows 5 and 6 of j");
    // a carried amount that no longer fits the room: the next flush
    let mut b = Batch::new(100, 1 << 20);
    b.add(id(0, 1, 5), &inc(b"z", b"k", 1, 100, 3, Fresh::No), Due::Hold(9_000, 10));
    b.add(id(0, 1, 6), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(9_500, 6));
    assert_eq!(
        b.add(id(0, 1, 6), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(9_500, 2)),
        Some(1)
    );
    let (out, _) = b.drain_due(2, 100, 1 << 20);
    assert_eq!(out.len(), 1);
    assert_eq!((out[0].1.n, out[0].1.carried), (2, 3));
}

#[test]
fn a_delete_drops_carried_increments_too() {
    let mut b = Batch::new(100, 1 << 20);
    b.add(id(0, 1, 5), &inc(b"z", b"k", 1, 100, 2, Fresh::No), Due::Hold(9_000, 10));
    b.add(id(0, 1, 6), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(9_000, 10));
    assert_eq!(b.pending(0), 3);
    let tag = redis_tag(b"z", b"k");
    assert!(b.delete(Delete {
        zone: 0,
        entry: EntryId([1, 0]),
        tag,
        period: 1,
        window: 6,
        bucket: None,
        command: true
    }));
    assert_eq!((b.len(), b.pending(0)), (0, 0));
}

#[test]
fn bounds_follow_the_zones_size() {
    // small zones: the floor (2 MiB held, 4 MiB and 65 536 items in all)
    let small = Bounds::for_zones(1 << 20);
    assert_eq!((small.hold, small.bytes, small.items), (2 << 20, 4 << 20, 1 << 16));
    // a 16 MiB zone: 16 MiB held, enough items for ~100 000 keys
    let big = Bounds::for_zones(16 << 20);
    assert_eq!((big.hold, big.bytes), (16 << 20, 32 << 20));
    assert!(big.items >= 300_000, "{}", big.items);
}

#[test]
fn a_push_near_the_limit_sends_what_the_key_held_of_earlier_windows_with_it() {
    let mut b = Batch::new(100, 1 << 20);
    b.add(id(0, 1, 5), &inc(b"z", b"k", 1, 100, 3, Fresh::No), Due::Hold(9_000, 10));
    assert_eq!(b.add(id(0, 1, 6), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Now), Some(0));
    let (out, _) = b.drain_due(0, 100, 1 << 20);
    let mut got: Vec<(u64, u32)> = out.iter().map(|(i, it)| (i.window, it.total())).collect();
    got.sort_unstable();
    assert_eq!(got, [(5, 3), (6, 1)], "both at once, each in its own window");
}

#[test]
fn an_item_is_far_from_its_limit_until_a_push_is_near_it() {
    let mut b = Batch::new(100, 1 << 20);
    b.add(id(0, 1, 5), &inc(b"z", b"far", 1, 100, 1, Fresh::Maybe), Due::Hold(9_000, 10));
    b.add(id(0, 1, 5), &inc(b"z", b"far", 1, 100, 1, Fresh::Maybe), Due::By(2_000));
    b.add(id(0, 2, 5), &inc(b"z", b"near", 1, 100, 1, Fresh::Alone), Due::Hold(9_000, 10));
    b.add(id(0, 2, 5), &inc(b"z", b"near", 1, 100, 1, Fresh::Alone), Due::Now);
    b.add(id(0, 3, 5), &inc(b"z", b"mixed", 1, 100, 1, Fresh::Alone), Due::Hold(9_000, 10));
    b.add(id(0, 3, 5), &inc(b"z", b"mixed", 1, 100, 1, Fresh::Maybe), Due::Hold(9_000, 10));
    let (items, _) = b.drain();
    let got = |e: u64| items.iter().find(|(i, _)| i.entry.0[0] == e).map(|(_, it)| it.clone());
    let far = got(1).expect("far item");
    assert!(far.far() && !far.quiet, "past its allowance but far: may guess its counter new");
    assert_eq!(far.fresh, Fresh::Maybe);
    assert!(!got(2).expect("near item").far(), "a push near the limit: INCRBY");
    assert_eq!(got(3).expect("mixed item").fresh, Fresh::Maybe, "the least sure push decides");
}

#[test]
fn forwarded_items_coalesce_with_the_senders_own_and_keep_their_times() {
    // two workers' batches and the node's sender: each worker forwards
    // everything of the zone it holds, the sender merges
    let held = |room| Due::Hold(5_000, room);
    let mut a = Batch::new(100, 1 << 20);
    let mut b = Batch::new(100, 1 << 20);
    let mut sender = Batch::new(100, 1 << 20);
    for _ in 0..3 {
        a.add(id(0, 1, 7), &inc(b"z", b"k", 60, 100, 1, Fresh::Maybe), held(10));
    }
    b.add(id(0, 1, 7), &inc(b"z", b"k", 60, 80, 2, Fresh::No), held(4));
    b.add(id(1, 9, 7), &inc(b"y", b"other", 60, 80, 1, Fresh::No), held(4));
    sender.add(id(0, 1, 7), &inc(b"z", b"k", 60, 100, 1, Fresh::Maybe), Due::By(9_000));
    let (from_a, _) = a.drain_zone(0);
    let (from_b, _) = b.drain_zone(0);
    assert!(a.is_empty() && b.len() == 1 && b.has_zone(1) && !b.has_zone(0), "zone 1 stays");
    for (fid, item) in from_a.into_iter().chain(from_b) {
        assert!(sender.merge(fid, item).is_some());
    }
    assert_eq!(sender.pending(0), 6);
    assert_eq!(sender.next_due(), Some(5_000), "the earliest time of the three");
    assert!(sender.drain_due(4_999, 10, 1 << 20).0.is_empty(), "held until due");
    let out = sender.drain_due(5_000, 10, 1 << 20).0;
    assert_eq!(out.len(), 1);
    let item = &out[0].1;
    assert_eq!((item.n, item.limit, item.fresh, &*item.tag), (6, 80, Fresh::No, &b"z:k"[..]));
    assert!(!item.quiet, "one push was not held");
}

#[test]
fn a_forwarded_quiet_item_carries_what_the_sender_holds_of_the_window_before() {
    let mut sender = Batch::new(100, 1 << 20);
    sender.add(id(0, 1, 7), &inc(b"z", b"k", 1, 100, 2, Fresh::No), Due::Hold(5_000, 10));
    let mut w = Batch::new(100, 1 << 20);
    w.add(id(0, 1, 8), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(6_000, 10));
    let (fwd, _) = w.drain_zone(0);
    for (fid, item) in fwd {
        assert_eq!(item.room, 10, "the room of its push goes with it");
        sender.merge(fid, item);
    }
    let (out, _) = sender.drain();
    assert_eq!(out.len(), 1, "carried into the later window: one item");
    assert_eq!((out[0].0.window, out[0].1.n, out[0].1.carried), (8, 1, 2));
    // no room: the held one goes with the next flush instead
    let mut sender = Batch::new(100, 1 << 20);
    sender.add(id(0, 1, 7), &inc(b"z", b"k", 1, 100, 5, Fresh::No), Due::Hold(5_000, 10));
    let mut w = Batch::new(100, 1 << 20);
    w.add(id(0, 1, 8), &inc(b"z", b"k", 1, 100, 1, Fresh::No), Due::Hold(6_000, 2));
    for (fid, item) in w.drain_zone(0).0 {
        sender.merge(fid, item);
    }
    assert_eq!(sender.len(), 2);
    assert_eq!(sender.next_due(), Some(1));
}

#[test]
fn a_delete_names_both_windows_or_the_bucket() {
    let d = delete_of(1, b"z", b"k", 60, 100);
    let keys: Vec<String> =
        d.keys(b"rl:").iter().map(|k| String::from_utf8_lossy(k).into()).collect();
    assert_eq!(keys, ["rl:{z:k}:60:6000", "rl:{z:k}:60:5940"]);
    let b = Delete { bucket: Some(10), ..d };
    let keys: Vec<String> =
        b.keys(b"rl:").iter().map(|k| String::from_utf8_lossy(k).into()).collect();
    assert_eq!(keys, ["rl:{z:k}:60:b10"]);
}
