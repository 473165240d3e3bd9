//! Forgetting a key's counts (Lua's `reset`, the API's `DELETE` of a key):
//! its entry on this node and its keys in Redis.

use ratelimit_core::batch::Delete;
use ratelimit_core::bucket;
use ratelimit_core::key::redis_tag;
use ratelimit_core::rate::Rate;
use ratelimit_core::window::window_index;

use crate::conf::MainConf;
use crate::worker::time::now_ms;

/// Forgets `key` (in namespace `ns`) of zone `index`: its windows of
/// `period`, or with `bucket` its bucket of that many requests per
/// period (nothing when the zone has no shared memory here).
pub fn reset(
    mcf: &MainConf,
    index: usize,
    ns: &[u8],
    key: &[u8],
    period: u32,
    bucket: Option<u32>,
) {
    let Some(z) = mcf.zones.get(index) else {
        return;
    };
    let Some(shared) = z.shared.as_ref() else {
        return;
    };
    let entry_period = match bucket {
        Some(limit) => bucket::entry_period(Rate { limit, period }),
        None => period,
    };
    let id = {
        let mut locked = shared.lock();
        let id = shared.ids.id(ns, entry_period, key);
        locked.table.remove(id);
        id
    };
    if z.params.as_ref().is_none_or(|p| p.backend.is_none()) {
        return;
    }
    if let Some(ch) = crate::worker::channel::channel() {
        let window = window_index(now_ms(), u64::from(period) * 1000);
        let mut d = Delete {
            zone: index as u32,
            entry: id,
            tag: redis_tag(ns, key),
            period,
            window,
            bucket,
            command: true,
        };
        // on a zone with a strict link the `DEL` goes down it, in order
        // with the worker's strict calls and counts of the key (the
        // thread then only forgets what it holds of the key)
        d.command = !crate::worker::link::reset(index, &d);
        ch.delete(d);
    }
}
