use super::*;

fn table(n: usize) -> (Box<Header>, Vec<Slot>) {
    let hdr = Box::new(Header { live: AtomicU32::new(0), slots: 0, synced_ms: AtomicU64::new(0) });
    (hdr, vec![Slot::EMPTY; n])
}

fn id(n: u64) -> EntryId {
    EntryId([n, n.wrapping_mul(31)])
}

const R: Rate = Rate { limit: 1000, period: 60 };

#[test]
fn a_block_and_an_override_hold_until_their_end() {
    let (mut h, mut s) = table(16);
    let mut c = Controls::format(&mut h, &mut s);
    c.set(id(1), b"k", Kind::Block, 2000, true, 1000).unwrap();
    c.set(id(1), b"k", Kind::Override(R), 3000, false, 1000).unwrap();
    assert_eq!(c.len(), 1);
    let slot = c.get(id(1)).unwrap();
    assert_eq!(slot.key(), b"k");
    assert_eq!(slot.blocked(1999), Some(2000));
    assert_eq!(slot.blocked(2000), None);
    assert_eq!(slot.rate(2999), Some(R));
    assert_eq!(slot.rate(3000), None);
    assert!(c.get(id(2)).is_none());
}

#[test]
fn keys_on_one_probe_chain_survive_removals() {
    for n in [16, 14] {
        probe_chain(n);
    }
}

/// ids with the same home slot (wrapping past the end with 14 slots: 12,
/// 13, 0, ...), and ids next to them.
fn probe_chain(n: usize) {
    let (mut h, mut s) = table(n);
    let mut c = Controls::format(&mut h, &mut s);
    let ids: Vec<EntryId> =
        (0..10).map(|i| EntryId([if i < 6 { n as u64 - 2 } else { i }, i])).collect();
    for (i, &x) in ids.iter().enumerate() {
        c.set(x, format!("k{i}").as_bytes(), Kind::Block, 5000, false, 0).unwrap();
    }
    assert_eq!(c.len(), 10);
    for &gone in &[ids[0], ids[3], ids[7]] {
        assert!(c.clear(gone, b"x", Kind::Block, false, 0));
    }
    assert_eq!(c.len(), 7);
    for (i, &x) in ids.iter().enumerate() {
        let found = c.get(x).map(|s| s.key().to_vec());
        if [0, 3, 7].contains(&i) {
            assert_eq!(found, None);
        } else {
            assert_eq!(found, Some(format!("k{i}").into_bytes()), "key {i}");
        }
    }
}

#[test]
fn a_full_table_refuses_until_controls_end() {
    let (mut h, mut s) = table(16);
    let mut c = Controls::format(&mut h, &mut s);
    for i in 0..capacity(16) as u64 {
        c.set(id(i), b"k", Kind::Block, 1000 + i, false, 0).unwrap();
    }
    assert_eq!(c.set(id(99), b"k", Kind::Block, 5000, false, 0), Err(Full));
    // once the first has ended, its slot is taken
    c.set(id(99), b"k", Kind::Block, 5000, false, 1000).unwrap();
    assert!(c.get(id(0)).is_none());
    assert!(c.get(id(99)).is_some());
}

#[test]
fn a_read_of_redis_replaces_what_is_not_this_nodes_pending_change() {
    let (mut h, mut s) = table(32);
    let mut c = Controls::format(&mut h, &mut s);
    // from an older read: gone from Redis now
    c.set(id(1), b"old", Kind::Block, 9000, false, 0).unwrap();
    // this node's, not written yet: kept whatever Redis says
    c.set(id(2), b"mine", Kind::Block, 9000, true, 0).unwrap();
    // this node's lift of an override, written as version 7
    c.set(id(3), b"lift", Kind::Override(R), 9000, false, 0).unwrap();
    c.clear(id(3), b"lift", Kind::Override(R), true, 0);
    c.written(id(3), Kind::Override(R), 7);
    let held = |k: &[u8], kind| Held { key: k.to_vec(), kind, left_ms: 1000 };
    let redis = vec![
        (id(3), held(b"lift", Kind::Override(R))),
        (id(4), held(b"new", Kind::Override(R))),
        (id(2), held(b"mine", Kind::Override(R))),
    ];
    // a read older than the lift's write: the lift stands
    c.apply(&redis, 6, 100);
    assert!(c.get(id(1)).is_none());
    assert_eq!(c.get(id(2)).unwrap().blocked(100), Some(9000));
    assert_eq!(c.get(id(2)).unwrap().rate(100), Some(R), "its override is Redis's");
    assert_eq!(c.get(id(3)).and_then(|s| s.rate(100)), None);
    assert_eq!(c.get(id(4)).unwrap().rate(100), Some(R));
    assert_eq!(c.get(id(4)).unwrap().override_until, 1100);
    // a read as new as the write: Redis's word (it still had it)
    c.apply(&redis, 7, 100);
    assert_eq!(c.get(id(3)).unwrap().rate(100), Some(R));
    assert!(!c.get(id(3)).unwrap().override_pending());
    assert_eq!(c.unwritten(100).len(), 1, "the unwritten block stays to be written");
}

#[test]
fn unwritten_changes_carry_their_time_left_and_lifts() {
    let (mut h, mut s) = table(16);
    let mut c = Controls::format(&mut h, &mut s);
    c.set(id(1), b"a", Kind::Block, 5000, true, 1000).unwrap();
    c.set(id(2), b"b", Kind::Override(R), 5000, false, 1000).unwrap();
    c.clear(id(2), b"b", Kind::Override(R), true, 1000);
    let mut ch = c.unwritten(2000);
    ch.sort_by(|a, b| a.key.cmp(&b.key));
    assert_eq!(ch[0], Change { key: b"a".to_vec(), kind: Kind::Block, left_ms: Some(3000) });
    assert_eq!(ch[1].key, b"b");
    assert_eq!(ch[1].left_ms, None);
    c.written(id(1), Kind::Block, 3);
    assert_eq!(c.unwritten(2000).len(), 1);
    // Redis lost everything: what is in force is written again
    c.rewrite_all(2000);
    let ch = c.unwritten(2000);
    assert_eq!(ch.len(), 2);
}

#[test]
fn fields_and_what_the_read_script_answers() {
    let ch = Change { key: b"k:1".to_vec(), kind: Kind::Override(R), left_ms: Some(5) };
    assert_eq!(ch.field(), b"o:k:1");
    assert_eq!(ch.payload(), "1000r/m");
    assert_eq!(
        held(b"o:k:1", 5, b"1000r/m"),
        Some(Held { key: b"k:1".to_vec(), kind: Kind::Override(R), left_ms: 5 })
    );
    assert_eq!(
        held(b"b:k", 9, b""),
        Some(Held { key: b"k".to_vec(), kind: Kind::Block, left_ms: 9 })
    );
    assert_eq!(held(b"o:k", 9, b"fast"), None);
    assert_eq!(held(b"x:k", 9, b""), None);
    assert_eq!(held(b"b:", 9, b""), None);
    assert_eq!(held(b"b:k", 0, b""), None);
    assert_eq!(redis_key(b"rl:", "login", false), b"rl:{login}:ctl");
    assert_eq!(redis_key(b"rl:", "login", true), b"rl:{login}:ctl:v");
}

#[test]
fn the_layout_fits_its_zone() {
    for len in [32 * 1024, 1 << 20, 10 << 20, 1 << 30] {
        let (bytes, slots) = layout(len);
        assert!(slots >= 16);
        assert!(bytes <= len / 4, "{len}: {bytes}");
    }
}
