//! Which cluster node serves a key: the slot (the `redis` crate's own slot
//! hashing) and a copy of the slot ranges `CLUSTER SLOTS` reported. The
//! thread sends one pipeline per node with it, so that a node that hangs or
//! is gone delays only the keys of its own slots. The `redis` crate still
//! routes every command by its own map (and follows MOVED/ASK): a stale copy
//! here only groups commands less well.

use std::collections::HashMap;
use std::sync::OnceLock;

use redis::cluster_routing::Slot;
use redis::Value;

const SLOTS: u16 = 16384;

/// The slot number of a key. `Slot` keeps its number to itself, so the
/// 16 384 slots are numbered once.
pub fn slot(key: &[u8]) -> u16 {
    static NUMBERS: OnceLock<HashMap<Slot, u16>> = OnceLock::new();
    let numbers =
        NUMBERS.get_or_init(|| (0..SLOTS).filter_map(|n| Slot::new(n).map(|s| (s, n))).collect());
    numbers.get(&Slot::for_key(key)).copied().unwrap_or(0)
}

/// Slot ranges and the address (`host:port`) of the master serving each.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Topology {
    ranges: Vec<(u16, u16, String)>,
}

impl Topology {
    /// From a `CLUSTER SLOTS` reply: `[[start, end, [host, port, ...], ...], ...]`,
    /// asked of the server at `asked` (its host). As Redis documents the
    /// endpoint: empty is "the host you asked" (a one-node cluster, or
    /// nodes that announce no address), `?` is not known yet (that range
    /// is left out: its keys go through the cluster connection, which
    /// follows redirections). `None` if it is not a reply of that form.
    pub fn parse(v: &Value, asked: &str) -> Option<Topology> {
        let Value::Array(entries) = v else {
            return None;
        };
        let mut ranges = Vec::with_capacity(entries.len());
        for e in entries {
            let Value::Array(parts) = e else {
                return None;
            };
            let (Some(Value::Int(start)), Some(Value::Int(end)), Some(Value::Array(master))) =
                (parts.first(), parts.get(1), parts.get(2))
            else {
                return None;
            };
            let host = match master.first() {
                Some(Value::BulkString(h)) => String::from_utf8_lossy(h).into_owned(),
                Some(Value::SimpleString(h)) => h.clone(),
                _ => return None,
            };
            let Some(Value::Int(port)) = master.get(1) else {
                return None;
            };
            let start = u16::try_from(*start).ok()?;
            let end = u16::try_from(*end).ok()?;
            let host = match host.as_str() {
                "" => asked.to_string(),
                "?" => continue,
                _ => host,
            };
            ranges.push((start, end, format!("{host}:{port}")));
        }
        ranges.sort();
        Some(Topology { ranges })
    }

    /// The master serving `key`, if the copy knows it.
    pub fn node(&self, key: &[u8]) -> Option<&str> {
        let s = slot(key);
        let i = self.ranges.partition_point(|(start, _, _)| *start <= s);
        let (start, end, addr) = self.ranges.get(i.checked_sub(1)?)?;
        (*start <= s && s <= *end).then_some(addr.as_str())
    }

    /// The masters.
    pub fn nodes(&self) -> impl Iterator<Item = &str> {
        let mut seen: Vec<&str> = self.ranges.iter().map(|(_, _, a)| a.as_str()).collect();
        seen.sort_unstable();
        seen.dedup();
        seen.into_iter()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn range(start: i64, end: i64, host: &str, port: i64) -> Value {
        Value::Array(vec![
            Value::Int(start),
            Value::Int(end),
            Value::Array(vec![
                Value::BulkString(host.into()),
                Value::Int(port),
                Value::BulkString(b"id".to_vec()),
            ]),
        ])
    }

    #[test]
    fn slots_are_redis_cluster_slots() {
        // values from the Redis Cluster specification and `CLUSTER KEYSLOT`
        assert_eq!(slot(b"foo"), 12182);
        assert_eq!(slot(b"123456789"), 12739);
        // the hash tag decides: both windows of a key share a slot
        assert_eq!(slot(b"rl:{z:a}:60:120"), slot(b"rl:{z:a}:60:60"));
        assert_eq!(slot(b"rl:{z:a}:60:120"), slot(b"z:a"));
    }

    #[test]
    fn keys_map_to_the_master_of_their_slot() {
        let v = Value::Array(vec![
            range(10923, 16383, "127.0.0.1", 7002),
            range(0, 5460, "127.0.0.1", 7000),
            range(5461, 10922, "127.0.0.1", 7001),
        ]);
        let t = Topology::parse(&v, "127.0.0.1").unwrap();
        assert_eq!(t.node(b"foo"), Some("127.0.0.1:7002"));
        assert_eq!(t.node(b"{z:a}"), t.node(b"rl:{z:a}:1:5"));
        assert_eq!(t.nodes().count(), 3);
        // a slot no range covers
        let part = Topology::parse(&Value::Array(vec![range(0, 8191, "h", 1)]), "h").unwrap();
        assert_eq!(part.node(b"foo"), None);
        assert!(Topology::parse(&Value::Int(3), "h").is_none());
    }

    #[test]
    fn an_empty_host_is_the_one_asked_and_an_unknown_one_is_left_out() {
        // a one-node cluster holding every slot names itself with ""
        let one = Value::Array(vec![range(0, 16383, "", 7000)]);
        let t = Topology::parse(&one, "10.1.2.3").unwrap();
        assert_eq!(t.node(b"foo"), Some("10.1.2.3:7000"));
        assert_eq!(t.nodes().collect::<Vec<_>>(), ["10.1.2.3:7000"]);
        let partly = Value::Array(vec![range(0, 8191, "?", 7000), range(8192, 16383, "h2", 7001)]);
        let t = Topology::parse(&partly, "h1").unwrap();
        assert_eq!(t.node(b"foo"), Some("h2:7001"), "slot 12182");
        assert_eq!(t.node(b"123456789"), Some("h2:7001"), "slot 12739");
        let low = (0..).map(|i| format!("k{i}")).find(|k| slot(k.as_bytes()) < 8192).unwrap();
        assert_eq!(t.node(low.as_bytes()), None, "a slot whose master is not known yet");
        // hostnames and IPv6 addresses are kept as announced
        let named = Value::Array(vec![range(0, 16383, "redis-0.example", 7000)]);
        assert_eq!(Topology::parse(&named, "h").unwrap().node(b"x"), Some("redis-0.example:7000"));
        let v6 = Value::Array(vec![range(0, 16383, "::1", 7000)]);
        assert_eq!(Topology::parse(&v6, "h").unwrap().node(b"x"), Some("::1:7000"));
    }
}
