//! Key handling: the identity of a (namespace, key, period) counter in a
//! zone's table, and the Redis key it is stored under.

use sha2::{Digest, Sha256};

/// Keys longer than this are replaced by a digest in Redis key names.
pub const MAX_KEY_BYTES: usize = 256;

/// 128-bit keyed hash of (namespace, period, key), one pass over the bytes
/// in two lanes: each 8-byte word is folded into both lanes by a 64×64→128
/// multiply with a secret of the zone (the folded multiply of wyhash and
/// aHash's fallback): the namespace's length and bytes first (`namespace`,
/// which a zone does once for its own name), then the period and the key's
/// length, the key's bytes, a final mix per lane (`id_in`). The secrets
/// come from the zone's random seed, so clients can neither see nor aim at
/// hash values (one bucket), and two keys share a counter only if both
/// 64-bit lanes collide. It runs on every request, so it hashes the zone's
/// name once (`namespace`) and each key in one pass of two lanes, where two
/// aHash runs would hash both every time (docs/performance.md).
#[derive(Clone)]
pub struct IdHasher([u64; 4]);

/// The folded multiply: the 128-bit product's halves xored.
#[inline(always)]
fn mum(a: u64, b: u64) -> u64 {
    let r = u128::from(a) * u128::from(b);
    (r as u64) ^ ((r >> 64) as u64)
}

/// 8 bytes as a little-endian word.
#[inline(always)]
fn word8(b: &[u8]) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[..8]);
    u64::from_le_bytes(w)
}

/// The last 1 to 7 bytes as a word, by reads that may overlap (wyhash's
/// way: no byte loop, no copy); the lengths hashed first tell inputs of
/// different lengths apart.
#[inline(always)]
fn tail(b: &[u8]) -> u64 {
    let n = b.len();
    if n >= 4 {
        let lo = u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
        let hi = u32::from_le_bytes([b[n - 4], b[n - 3], b[n - 2], b[n - 1]]);
        u64::from(lo) | u64::from(hi) << 32
    } else if n > 0 {
        u64::from(b[0]) << 16 | u64::from(b[n / 2]) << 8 | u64::from(b[n - 1])
    } else {
        0
    }
}

impl IdHasher {
    pub fn new(seed: [u64; 2]) -> IdHasher {
        let [a, b] = seed;
        // spread the seed into four odd secrets (odd: the multiplies keep
        // every bit of the state)
        let secret = |x: u64, k: u64| mum(x ^ k, 0x9e37_79b9_7f4a_7c15) | 1;
        IdHasher([
            secret(a, 0x243f_6a88_85a3_08d3),
            secret(b, 0x1319_8a2e_0370_7344),
            secret(a ^ b, 0xa409_3822_299f_31d0),
            secret(b.rotate_left(32), 0x082e_fa98_ec4e_6c89),
        ])
    }

    /// The hash of (namespace, period, key).
    #[inline]
    pub fn id(&self, namespace: &[u8], period: u32, key: &[u8]) -> EntryId {
        self.id_in(self.namespace(namespace), period, key)
    }

    /// The first part of every id under `namespace`: its length and bytes
    /// folded into both lanes. A zone hashes its own name once, not on every
    /// request (`id_in`).
    #[inline]
    pub fn namespace(&self, namespace: &[u8]) -> Namespace {
        let [s0, s1, s2, s3] = self.0;
        let len = namespace.len() as u64;
        let mut lanes = [mum(s0 ^ len, s2), mum(s1 ^ len, s3)];
        self.absorb(&mut lanes, namespace);
        Namespace(lanes)
    }

    /// The hash of (namespace, period, key), the namespace hashed already:
    /// the period and the key's length, then its bytes, then a final mix
    /// per lane.
    #[inline(always)]
    pub fn id_in(&self, namespace: Namespace, period: u32, key: &[u8]) -> EntryId {
        let [s0, s1, s2, s3] = self.0;
        let lens = (key.len() as u64) | u64::from(period) << 40;
        let [a, b] = namespace.0;
        let mut lanes = [mum(a ^ lens, s2), mum(b ^ lens, s3)];
        self.absorb(&mut lanes, key);
        let [a, b] = lanes;
        EntryId([mum(a ^ s1, s0 ^ s3), mum(b ^ s0, s1 ^ s2)])
    }

    /// Folds `bytes` into both lanes, 8 at a time, the last 1 to 7 as one
    /// word.
    #[inline(always)]
    fn absorb(&self, lanes: &mut [u64; 2], bytes: &[u8]) {
        let [_, _, s2, s3] = self.0;
        let [mut a, mut b] = *lanes;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = word8(c);
            a = mum(a ^ w, s2);
            b = mum(b ^ w, s3);
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let w = tail(rest);
            a = mum(a ^ w, s2);
            b = mum(b ^ w, s3);
        }
        *lanes = [a, b];
    }
}

/// A key's entry id: its zone's namespace, the period and the key bytes
/// hashed into 128 bits (`IdHasher::id`). The shared table, the batch, the
/// ring and Redis's answers name a key's entry by it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
#[repr(transparent)]
pub struct EntryId(pub [u64; 2]);

/// A namespace as hashed by one zone's `IdHasher::namespace`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Namespace([u64; 2]);

/// What marks a key part made of a digest (`redis_key_part`).
const DIGEST: &[u8] = b"sha256:";

/// The key bytes as they appear inside a Redis key name: as given, but
/// for `%` and `}` (`%25`, `%7D`: no byte of a key can end the hash tag,
/// which would put every key that begins with `}` on one cluster slot)
/// and the `:` of a key that begins `sha256:` (`%3A`: no key can name a
/// digest's counter); `sha256:<hex>` of the key when that is longer than
/// `MAX_KEY_BYTES`. Keys without those bytes are written as they are.
pub fn redis_key_part(key: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    let digest_like = key.starts_with(DIGEST);
    let plain = !digest_like && !key.iter().any(|&b| b == b'%' || b == b'}');
    if plain && key.len() <= MAX_KEY_BYTES {
        return std::borrow::Cow::Borrowed(key);
    }
    if !plain {
        let mut out = Vec::with_capacity(key.len() + 8);
        for (i, &b) in key.iter().enumerate() {
            match b {
                b'%' => out.extend_from_slice(b"%25"),
                b'}' => out.extend_from_slice(b"%7D"),
                b':' if digest_like && i + 1 == DIGEST.len() => out.extend_from_slice(b"%3A"),
                _ => out.push(b),
            }
        }
        if out.len() <= MAX_KEY_BYTES {
            return std::borrow::Cow::Owned(out);
        }
    }
    let digest = Sha256::digest(key);
    let mut out = Vec::with_capacity(DIGEST.len() + 64);
    out.extend_from_slice(DIGEST);
    for b in digest {
        out.extend_from_slice(format!("{b:02x}").as_bytes());
    }
    std::borrow::Cow::Owned(out)
}

/// A namespace (the zone's name, or a Lua caller's) as it appears in a
/// hash tag: `%`, `}` and `:` escaped as in `redis_key_part`, so that the
/// first `:` of a tag ends the namespace (namespace `a:b` with key `c`
/// and namespace `a` with key `b:c` are two counters). A zone's name
/// holds none of them.
fn namespace_part(namespace: &[u8]) -> std::borrow::Cow<'_, [u8]> {
    if !namespace.iter().any(|b| b"%}:".contains(b)) {
        return std::borrow::Cow::Borrowed(namespace);
    }
    let mut out = Vec::with_capacity(namespace.len() + 8);
    for &b in namespace {
        match b {
            b'%' => out.extend_from_slice(b"%25"),
            b'}' => out.extend_from_slice(b"%7D"),
            b':' => out.extend_from_slice(b"%3A"),
            _ => out.push(b),
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Most bytes of a namespace (the zone name, or a Lua caller's): with the
/// key part (at most `MAX_KEY_BYTES`) it bounds a Redis key's hash tag
/// (three times as many once escaped), and so what the background thread
/// holds per pending key.
pub const MAX_NAMESPACE_BYTES: usize = 128;

/// The hash tag of a key's Redis counters: `<namespace>:<key part>`, both
/// escaped (`namespace_part`, `redis_key_part`). This is what the
/// background thread keeps per pending key (at most
/// `3 × MAX_NAMESPACE_BYTES + 1 + MAX_KEY_BYTES` bytes), never the raw key.
pub fn redis_tag(namespace: &[u8], key: &[u8]) -> Box<[u8]> {
    let namespace = &namespace_part(namespace)[..];
    let part = redis_key_part(key);
    let mut out = Vec::with_capacity(namespace.len() + 1 + part.len());
    for p in [namespace, &b":"[..], &part[..]] {
        out.extend_from_slice(p);
    }
    out.into_boxed_slice()
}

/// A hash tag held in place when it is short: a strict request's, which
/// lives only while its script call is out (no allocation for the common
/// key).
pub type Tag = smallvec::SmallVec<[u8; 48]>;

/// `redis_tag` as a `Tag`.
pub fn redis_tag_inline(raw_namespace: &[u8], key: &[u8]) -> Tag {
    let ns = namespace_part(raw_namespace);
    let namespace = &ns[..];
    let part = redis_key_part(key);
    let len = namespace.len() + 1 + part.len();
    let mut buf = [0u8; 48];
    if len > buf.len() {
        return Tag::from_vec(redis_tag(raw_namespace, key).into_vec());
    }
    buf[..namespace.len()].copy_from_slice(namespace);
    buf[namespace.len()] = b':';
    buf[namespace.len() + 1..len].copy_from_slice(&part);
    Tag::from_buf_and_len(buf, len)
}

/// `<prefix>{<zone>}:nodes`: the sorted set of the nodes that count a
/// zone through this Redis (`on_error=share`), each scored by when it last
/// said so (ms since the epoch, its clock).
pub fn nodes_key(prefix: &[u8], zone: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + zone.len() + 8);
    out.extend_from_slice(prefix);
    out.push(b'{');
    out.extend_from_slice(zone.as_bytes());
    out.extend_from_slice(b"}:nodes");
    out
}

/// `<prefix>{<tag>}:<period>:<window start>`: the hash tag keeps both
/// windows of one key on one cluster slot.
pub fn redis_key_for_tag(prefix: &[u8], tag: &[u8], period: u32, window_start: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(prefix.len() + tag.len() + 32);
    write_key_for_tag(&mut out, prefix, tag, period, window_start);
    out
}

/// The same name, appended to `out`.
pub fn write_key_for_tag(out: &mut Vec<u8>, prefix: &[u8], tag: &[u8], period: u32, start: u64) {
    write_period_for_tag(out, prefix, tag, period);
    out.push(b':');
    crate::resp::push_u64(out, start);
}

/// A bucket's Redis key (`redis_ratelimit ... burst=`): the fleet's level
/// of the key's bucket of `limit` requests per `period`,
/// `<prefix>{<tag>}:<period>:b<limit>` (the `b` keeps it apart from the
/// key's window counters, which end in a number).
pub fn write_bucket_key_for_tag(
    out: &mut Vec<u8>,
    prefix: &[u8],
    tag: &[u8],
    period: u32,
    limit: u32,
) {
    write_period_for_tag(out, prefix, tag, period);
    out.extend_from_slice(b":b");
    crate::resp::push_u64(out, u64::from(limit));
}

/// A concurrency limit's Redis key (`redis_ratelimit_conn`): the hash of
/// the leases of the key's slots in flight, one field per holder,
/// `<prefix>{<tag>}:conn`.
pub fn write_conn_key_for_tag(out: &mut Vec<u8>, prefix: &[u8], tag: &[u8]) {
    out.extend_from_slice(prefix);
    out.push(b'{');
    out.extend_from_slice(tag);
    out.extend_from_slice(b"}:conn");
}

/// `<prefix>{<tag>}:<period>`, what a key's names begin with.
fn write_period_for_tag(out: &mut Vec<u8>, prefix: &[u8], tag: &[u8], period: u32) {
    out.extend_from_slice(prefix);
    out.push(b'{');
    out.extend_from_slice(tag);
    out.extend_from_slice(b"}:");
    crate::resp::push_u64(out, u64::from(period));
}

/// `<prefix>{<namespace>:<key>}:<period>:<window start>` (the format the
/// tests check; the thread builds names from a tag).
#[cfg(test)]
pub fn redis_key(
    prefix: &[u8],
    namespace: &[u8],
    key: &[u8],
    period: u32,
    window_start: u64,
) -> Vec<u8> {
    redis_key_for_tag(prefix, &redis_tag(namespace, key), period, window_start)
}

/// A Redis key for a log line: printable ASCII as is, other bytes escaped,
/// cut after 120 bytes.
pub fn show_key(key: &[u8]) -> String {
    let cut = &key[..key.len().min(120)];
    let mut s = cut.escape_ascii().to_string();
    if key.len() > cut.len() {
        s.push_str("...");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_separate_namespace_period_and_key() {
        let s = [1, 2];
        let entry_id = |seed, ns: &[u8], p, k: &[u8]| IdHasher::new(seed).id(ns, p, k);
        let a = entry_id(s, b"login", 1, b"k");
        assert_eq!(a, entry_id(s, b"login", 1, b"k"));
        assert_ne!(a, entry_id(s, b"login", 60, b"k"));
        assert_ne!(a, entry_id(s, b"api", 1, b"k"));
        assert_ne!(a, entry_id(s, b"login", 1, b"k2"));
        assert_ne!(a, entry_id([3, 4], b"login", 1, b"k"));
        // the namespace length is hashed, so bytes cannot move across it
        assert_ne!(entry_id(s, b"ab", 1, b"c"), entry_id(s, b"a", 1, b"bc"));
        // binary keys are fine
        assert_ne!(entry_id(s, b"z", 1, &[0, 255]), entry_id(s, b"z", 1, &[0, 254]));
        // zero padding of a short word does not hide a trailing zero byte
        assert_ne!(entry_id(s, b"z", 1, b"ab"), entry_id(s, b"z", 1, b"ab\0"));
        assert_ne!(entry_id(s, b"z", 1, b""), entry_id(s, b"z", 1, b"\0"));
    }

    #[test]
    fn a_namespace_hashed_once_gives_the_same_ids() {
        let h = IdHasher::new([5, 6]);
        let login = h.namespace(b"login");
        assert_eq!(login, h.namespace(b"login"));
        assert_ne!(login, h.namespace(b"logi"));
        assert_ne!(login, IdHasher::new([5, 7]).namespace(b"login"));
        for key in [&b""[..], b"k", b"1.2.3.4", b"a key of more than eight bytes"] {
            for period in [1, 60, 86_400] {
                assert_eq!(h.id_in(login, period, key), h.id(b"login", period, key));
            }
        }
    }

    #[test]
    fn ids_of_many_similar_keys_neither_collide_nor_cluster() {
        // 4-byte addresses and counter-like text keys: what clients send
        let h = IdHasher::new([0x1234_5678, 0x9abc_def0]);
        let mut lo = std::collections::HashSet::new();
        let mut hi = std::collections::HashSet::new();
        let mut buckets = vec![0u32; 1024];
        let n = 200_000u32;
        for i in 0..n {
            let k4 = i.to_be_bytes();
            let text = format!("user-{i}");
            for key in [&k4[..], text.as_bytes()] {
                let EntryId([a, b]) = h.id(b"api", 60, key);
                assert!(lo.insert(a), "lane 0 collides at {i}");
                assert!(hi.insert(b), "lane 1 collides at {i}");
                buckets[(a % 1024) as usize] += 1;
            }
        }
        // 400 000 ids in 1024 buckets: ~391 each; a fair hash stays
        // within a few standard deviations (sigma ~ 20)
        let (min, max) = (buckets.iter().min().unwrap(), buckets.iter().max().unwrap());
        assert!(*min > 290 && *max < 490, "buckets from {min} to {max}");
    }

    #[test]
    fn redis_key_format() {
        assert_eq!(
            redis_key(b"rl:", b"login", b"1.2.3.4", 60, 1_700_000_040),
            b"rl:{login:1.2.3.4}:60:1700000040".to_vec()
        );
        let bin = redis_key(b"rl:", b"z", &[0, 10, 13, 255], 1, 5);
        assert_eq!(bin, [&b"rl:{z:"[..], &[0, 10, 13, 255], b"}:1:5"].concat());
    }

    /// The slot-deciding hash tag of a key name, as Redis Cluster reads it:
    /// from the first `{` to the first `}` after it, if not empty.
    fn hash_tag(name: &[u8]) -> &[u8] {
        if let Some(open) = name.iter().position(|&b| b == b'{') {
            if let Some(len) = name[open + 1..].iter().position(|&b| b == b'}') {
                if len > 0 {
                    return &name[open + 1..open + 1 + len];
                }
            }
        }
        name
    }

    #[test]
    fn both_windows_share_a_slot_whatever_the_key_bytes() {
        for key in [&b"plain"[..], b"a}b", b"}", b"{", b"{x}", b"\r\n*3", &[0, 255, b'}', b'{']] {
            let cur = redis_key(b"rl:", b"z", key, 60, 120);
            let prev = redis_key(b"rl:", b"z", key, 60, 60);
            assert_eq!(hash_tag(&cur), hash_tag(&prev), "{:?}", String::from_utf8_lossy(key));
            // the tag always starts with the namespace: a key cannot move
            // its counter to another zone's tag
            assert!(hash_tag(&cur).starts_with(b"z:"));
        }
    }

    #[test]
    fn tags_are_bounded_whatever_the_key() {
        let huge = vec![b'x'; 7000];
        let tag = redis_tag(b"z", &huge);
        assert_eq!(tag.len(), 2 + 7 + 64);
        // held in place or not, the same tag
        for key in [&b"k"[..], &[7u8; 47], &[7u8; 200], &huge] {
            assert_eq!(&redis_tag_inline(b"z", key)[..], &redis_tag(b"z", key)[..]);
        }
        assert_eq!(
            redis_key_for_tag(b"rl:", &tag, 60, 120),
            redis_key(b"rl:", b"z", &huge, 60, 120)
        );
        assert_eq!(show_key(b"a\x00b"), "a\\x00b");
        assert!(show_key(&huge).ends_with("..."));
    }

    #[test]
    fn no_key_ends_the_tag_names_a_digest_or_crosses_a_namespace() {
        // a key that begins with `}` keeps its own slot
        let a = redis_key(b"rl:", b"z", b"}a", 60, 0);
        let b = redis_key(b"rl:", b"z", b"}b", 60, 0);
        assert_eq!(a, b"rl:{z:%7Da}:60:0");
        assert_ne!(hash_tag(&a), hash_tag(&b));
        for key in [&b"}"[..], b"a}b}", b"%", b"%7D", b"\xff}%"] {
            let name = redis_key(b"rl:", b"z", key, 60, 0);
            let tag = hash_tag(&name);
            assert_eq!(&name[3..name.len() - 5], &[b"{", tag, b"}"].concat()[..], "{key:?}");
            assert!(!tag.contains(&b'}'));
        }
        // escapes are escaped: "%" and "%7D" and "}" are three counters
        let names: Vec<_> =
            [&b"}"[..], b"%7D", b"%"].iter().map(|k| redis_key(b"rl:", b"z", k, 60, 0)).collect();
        assert!(names[0] != names[1] && names[1] != names[2] && names[0] != names[2]);
        // a key written like a digest is not the digest's counter
        let long = vec![b'q'; 300];
        let digest = redis_key_part(&long).into_owned();
        assert!(digest.starts_with(b"sha256:"));
        assert_ne!(redis_key_part(&digest).as_ref(), &digest[..]);
        assert!(redis_key_part(&digest).starts_with(b"sha256%3A"));
        // namespaces: `a:b` + `c` is not `a` + `b:c`
        assert_ne!(redis_tag(b"a:b", b"c"), redis_tag(b"a", b"b:c"));
        assert_eq!(&redis_tag(b"a:b", b"c")[..], b"a%3Ab:c");
        assert_eq!(&redis_tag_inline(b"a:b%}", b"}")[..], &redis_tag(b"a:b%}", b"}")[..]);
        // plain keys and names are written as they always were
        assert_eq!(redis_key(b"rl:", b"login", b"10.0.0.1", 60, 0), b"rl:{login:10.0.0.1}:60:0");
        // a key that grows past the bound once escaped is digested
        let braces = vec![b'}'; 100];
        assert!(redis_key_part(&braces).starts_with(b"sha256:"));
        assert_eq!(redis_key_part(&[b'}'; 85]).len(), 255);
    }

    #[test]
    fn long_keys_become_a_digest() {
        let k256 = vec![b'a'; 256];
        assert_eq!(redis_key_part(&k256).as_ref(), &k256[..]);
        let k257 = vec![b'a'; 257];
        let d = redis_key_part(&k257);
        assert!(d.starts_with(b"sha256:"));
        assert_eq!(d.len(), 7 + 64);
        assert_ne!(redis_key_part(&vec![b'b'; 257]), d);
    }
}
