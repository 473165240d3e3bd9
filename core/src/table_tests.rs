//! Unit tests of `table.rs`.
use super::*;
use crate::key::EntryId;

struct Owned {
    hdr: Header,
    buckets: Vec<u32>,
    entries: Vec<Entry>,
}

fn owned(capacity: usize, nbuckets: usize) -> Owned {
    Owned {
        hdr: Header {
            magic: 0,
            version: 0,
            capacity: 0,
            nbuckets: 0,
            len: 0,
            lru_head: 0,
            lru_tail: 0,
            free_head: 0,
            _pad: 0,
            seed: [0; 2],
            evictions: 0,
            evictions_counting: 0,
            evictions_counting_noted: 0,
            pressure_logged_sec: 0,
            region_len: 0,
            error_logged_sec: 0,
            notice_logged_sec: 0,
            stats: Stats::default(),
        },
        buckets: vec![0; nbuckets],
        entries: vec![Entry::default(); capacity],
    }
}

fn id(n: u64) -> EntryId {
    // small bucket numbers collide on purpose
    EntryId([n, n.wrapping_mul(0x9e37_79b9_7f4a_7c15)])
}

#[test]
fn layout_fits_and_is_aligned() {
    assert_eq!(Layout::ENTRY, 64);
    for bytes in [Layout::HEADER + 200, 4096, 32768, 10 << 20, (10 << 20) + 13] {
        let l = Layout::for_region(bytes).unwrap();
        assert!(l.total() <= bytes, "{bytes}: {l:?}");
        assert_eq!(l.entries_offset() % 8, 0);
        assert!(l.nbuckets.is_power_of_two());
        assert!(l.nbuckets <= l.capacity.max(2));
    }
    assert_eq!(Layout::for_region(10), None);
    // 10 MB holds well over 150 000 keys (about 60 bytes each)
    let l = Layout::for_region(10 << 20).unwrap();
    assert!(l.capacity > 150_000, "{l:?}");
}

#[test]
fn insert_find_and_reuse_least_recently_used() {
    let mut o = owned(4, 2);
    let mut t = Table::format(&mut o.hdr, &mut o.buckets, &mut o.entries, [1, 2], 0);
    for n in 0..4 {
        let (_, new) = t.get_or_insert(id(n), 0);
        assert!(new);
    }
    assert_eq!(t.len(), 4);
    // touch 0 so that 1 is now the least recently used
    let (i0, new) = t.get_or_insert(id(0), 0);
    assert!(!new);
    t.entry_mut(i0).cur = 42;
    let (_, new) = t.get_or_insert(id(9), 0);
    assert!(new);
    assert_eq!(t.evictions(), 1);
    assert_eq!(t.len(), 4);
    assert!(t.find(id(1)).is_none(), "LRU entry evicted");
    for n in [0, 2, 3, 9] {
        assert!(t.find(id(n)).is_some(), "{n} kept");
    }
    assert_eq!(t.entry(t.find(id(0)).unwrap()).cur, 42);
    // a re-inserted key starts from zero
    let (i1, new) = t.get_or_insert(id(1), 0);
    assert!(new);
    assert_eq!(t.entry(i1).cur, 0);
}

#[test]
fn remove_relinks_chains() {
    let mut o = owned(8, 2);
    let mut t = Table::format(&mut o.hdr, &mut o.buckets, &mut o.entries, [0, 0], 0);
    for n in 0..8 {
        t.get_or_insert(id(n), 0);
    }
    assert!(t.remove(id(4)));
    assert!(!t.remove(id(4)));
    assert!(t.remove(id(0)));
    assert_eq!(t.len(), 6);
    for n in [1, 2, 3, 5, 6, 7] {
        assert!(t.find(id(n)).is_some());
    }
    // freed entries are reused before anything is evicted
    t.get_or_insert(id(100), 0);
    t.get_or_insert(id(101), 0);
    assert_eq!(t.evictions(), 0);
    assert_eq!(t.len(), 8);
}

#[test]
fn many_keys_in_a_small_table_keep_the_hot_one() {
    let mut o = owned(64, 32);
    let mut t = Table::format(&mut o.hdr, &mut o.buckets, &mut o.entries, [0, 0], 0);
    let hot = id(u64::MAX);
    let (h, _) = t.get_or_insert(hot, 0);
    t.entry_mut(h).cur = 7;
    for n in 0..10_000 {
        t.get_or_insert(id(n), 0);
        if n % 16 == 0 {
            t.get_or_insert(hot, 0);
        }
        assert!(t.len() <= 64);
    }
    let h = t.find(hot).expect("hot key survives");
    assert_eq!(t.entry(h).cur, 7);
    assert!(t.evictions() > 9000);
    // every present entry is findable: chains and LRU are consistent
    let mut seen = 0;
    for n in 0..10_000 {
        if t.find(id(n)).is_some() {
            seen += 1;
        }
    }
    assert_eq!(seen + 1, t.len());
}

#[test]
fn validity_check() {
    let mut o = owned(16, 8);
    let l = Layout { capacity: 16, nbuckets: 8 };
    assert!(!Table::is_valid(&o.hdr, l, 99));
    Table::format(&mut o.hdr, &mut o.buckets, &mut o.entries, [5, 6], 99);
    assert!(Table::is_valid(&o.hdr, l, 99));
    assert!(!Table::is_valid(&o.hdr, l, 100));
    o.hdr.version = VERSION + 1;
    assert!(!Table::is_valid(&o.hdr, l, 99));
}

#[test]
fn a_flood_of_new_keys_evicts_its_own_keys_not_one_that_counts() {
    let mut o = owned(64, 64);
    let mut t = Table::format(&mut o.hdr, &mut o.buckets, &mut o.entries, [1, 2], 0);
    let key = id(1_000_000);
    let (k, _) = t.get_or_insert(key, 0);
    t.entry_mut(k).cur = 25;
    let blocked = id(2_000_000);
    let (b, _) = t.get_or_insert(blocked, 0);
    t.entry_mut(b).blocked_until_ms = 5_000;
    // the flood: each key once, counted once; the table turns over many
    // times, and the key comes back only now and then
    for n in 0..10_000u64 {
        let (i, new) = t.get_or_insert(id(n), 1_000);
        assert!(new);
        t.entry_mut(i).inflight = 1;
    }
    assert_eq!(t.entry(t.find(key).expect("the key that counts stays")).cur, 25);
    assert!(t.find(blocked).is_some(), "an open breaker stays");
    assert!(t.evictions() >= 10_000 - 62);
    assert_eq!(t.evictions_counting(), t.evictions(), "each evicted flood key held its count");
    // said once a minute, with the count since the last line
    let n = t.claim_pressure_note(100, 60).expect("said");
    assert_eq!(n, t.evictions_counting());
    assert_eq!(t.claim_pressure_note(120, 60), None);
    t.get_or_insert(id(99_999), 1_000);
    assert_eq!(t.claim_pressure_note(161, 60), Some(1));
    // a breaker that closed weighs only its counts; a flood heavier than
    // the key evicts it (it pays as many requests per key)
    for n in 20_000..30_000u64 {
        let (i, _) = t.get_or_insert(id(n), 10_000);
        t.entry_mut(i).cur = 30;
    }
    assert!(t.find(key).is_none() && t.find(blocked).is_none());
}

#[test]
fn keys_without_counts_are_evicted_least_recently_used_first() {
    let mut o = owned(4, 4);
    let mut t = Table::format(&mut o.hdr, &mut o.buckets, &mut o.entries, [1, 2], 0);
    for n in 0..4 {
        t.get_or_insert(id(n), 0);
    }
    t.get_or_insert(id(0), 0);
    t.get_or_insert(id(9), 0);
    assert!(t.find(id(1)).is_none(), "the oldest of equals");
    assert_eq!(t.evictions_counting(), 0);
    assert_eq!(t.claim_pressure_note(100, 60), None, "nothing that counted was lost");
}
