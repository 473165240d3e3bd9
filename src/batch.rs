//! Coalescing of increments between a worker and its background thread:
//! every request allowed for the same (zone, key, period, window) adds to one
//! pending item, so a hot key costs one `INCRBY` per flush, not per request.
//! Bounded: once `capacity` distinct items wait, new ones are dropped (and
//! counted), never blocking the worker.

use std::collections::HashMap;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct ItemId {
    pub zone: u32,
    pub entry: [u64; 2],
    pub window: u64,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// The namespace of the Redis key: the zone name for directives, the
    /// caller's for Lua.
    pub namespace: Vec<u8>,
    /// The key bytes as the request produced them.
    pub key: Vec<u8>,
    pub period: u32,
    /// The tightest limit that counted this item (for the breaker).
    pub limit: u32,
    /// Increments coalesced into this item.
    pub n: u32,
}

/// A key to forget in Redis (both windows around `window`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Delete {
    pub zone: u32,
    /// The table entry of the key (drops its pending increments).
    pub entry: [u64; 2],
    pub namespace: Vec<u8>,
    pub key: Vec<u8>,
    pub period: u32,
    pub window: u64,
}

#[derive(Debug)]
pub struct Batch {
    items: HashMap<ItemId, Item>,
    deletes: Vec<Delete>,
    capacity: usize,
    /// Increments dropped because the batch was full.
    pub dropped: u64,
}

impl Batch {
    pub fn new(capacity: usize) -> Batch {
        Batch {
            items: HashMap::new(),
            deletes: Vec::new(),
            capacity,
            dropped: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.items.is_empty() && self.deletes.is_empty()
    }

    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Queues a delete. Increments of the key still waiting were counted
    /// before it and are dropped with it; deletes are sent before the
    /// increments of the same flush, so what is counted after it stays.
    pub fn delete(&mut self, d: Delete) -> bool {
        if self.deletes.len() >= self.capacity {
            self.dropped += 1;
            return false;
        }
        self.items
            .retain(|id, _| !(id.zone == d.zone && id.entry == d.entry));
        self.deletes.push(d);
        true
    }

    /// Adds one increment; false if it had to be dropped.
    pub fn add(
        &mut self,
        id: ItemId,
        namespace: &[u8],
        key: &[u8],
        period: u32,
        limit: u32,
    ) -> bool {
        if let Some(item) = self.items.get_mut(&id) {
            item.n = item.n.saturating_add(1);
            item.limit = item.limit.min(limit);
            return true;
        }
        if self.items.len() >= self.capacity {
            self.dropped += 1;
            return false;
        }
        self.items.insert(
            id,
            Item {
                namespace: namespace.to_vec(),
                key: key.to_vec(),
                period,
                limit,
                n: 1,
            },
        );
        true
    }

    /// Takes every pending item, leaving the batch empty (its allocation is
    /// kept for the next round).
    pub fn drain(&mut self) -> (Vec<(ItemId, Item)>, Vec<Delete>) {
        (
            self.items.drain().collect(),
            std::mem::take(&mut self.deletes),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(zone: u32, e: u64, window: u64) -> ItemId {
        ItemId {
            zone,
            entry: [e, 0],
            window,
        }
    }

    #[test]
    fn coalesces_per_key_and_window() {
        let mut b = Batch::new(10);
        for _ in 0..1000 {
            assert!(b.add(id(0, 1, 5), b"z", b"hot", 1, 100));
        }
        assert!(b.add(id(0, 1, 6), b"z", b"hot", 1, 100));
        assert!(b.add(id(1, 1, 5), b"z", b"hot", 1, 50));
        assert_eq!(b.len(), 3);
        let mut items = b.drain().0;
        items.sort_by_key(|(i, _)| (i.zone, i.window));
        assert_eq!(items[0].1.n, 1000);
        assert_eq!(items[0].1.key, b"hot");
        assert_eq!(items[1].1.n, 1);
        assert_eq!(items[2].1.limit, 50);
        assert!(b.is_empty());
    }

    #[test]
    fn keeps_the_tightest_limit() {
        let mut b = Batch::new(10);
        b.add(id(0, 1, 5), b"z", b"k", 60, 100);
        b.add(id(0, 1, 5), b"z", b"k", 60, 10);
        b.add(id(0, 1, 5), b"z", b"k", 60, 50);
        assert_eq!(b.drain().0[0].1.limit, 10);
    }

    #[test]
    fn drops_new_items_when_full_but_still_coalesces() {
        let mut b = Batch::new(2);
        assert!(b.add(id(0, 1, 0), b"z", b"a", 1, 1));
        assert!(b.add(id(0, 2, 0), b"z", b"b", 1, 1));
        assert!(!b.add(id(0, 3, 0), b"z", b"c", 1, 1));
        assert!(b.add(id(0, 1, 0), b"z", b"a", 1, 1));
        assert_eq!(b.dropped, 1);
        assert_eq!(b.drain().0.len(), 2);
        assert!(b.add(id(0, 3, 0), b"z", b"c", 1, 1));
    }

    #[test]
    fn deletes_drop_pending_increments_of_their_key() {
        let mut b = Batch::new(4);
        assert!(b.is_empty());
        assert!(b.add(id(0, 9, 7), b"ns", b"k", 60, 5));
        assert!(b.add(id(0, 8, 7), b"ns", b"other", 60, 5));
        let d = Delete {
            zone: 0,
            entry: [9, 0],
            namespace: b"ns".to_vec(),
            key: b"k".to_vec(),
            period: 60,
            window: 7,
        };
        assert!(b.delete(d.clone()));
        assert!(!b.is_empty());
        let (items, deletes) = b.drain();
        assert_eq!(
            items.len(),
            1,
            "the deleted key's pending increment is gone"
        );
        assert_eq!(items[0].1.key, b"other");
        assert_eq!(deletes, vec![d]);
        assert!(b.is_empty());
    }
}
