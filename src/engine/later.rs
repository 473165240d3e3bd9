//! Counts of limits Redis decides (`strict`, a small limit) that are not
//! waited for: a `count_if=` count after the response, a Lua caller's
//! request (Lua never waits). The engine counts them here in flight
//! (`Strict::CountOnly`) and, once it counted them, sends them down the zone's
//! strict link, the connection this worker's strict checks take: there
//! they reach Redis before the worker's next check of the key, which could
//! otherwise run ahead of an increment still queued for the Redis thread
//! and let the key's last request through twice.

use ratelimit_core::batch::ItemId;
use ratelimit_core::key::EntryId;
use ratelimit_core::rate::Rate;
use ratelimit_core::strict::{self, Kind};
use ratelimit_core::window::window_index;

use super::{Ask, Strict};
use crate::conf::MainConf;
use crate::worker::{link, waits};

/// Whether Redis decides a limit of `rate` in `zone` for the directive
/// although it is not `strict`: a small limit (`strict::small`) or a
/// bucket (`bucket`: the fleet's level is Redis's), on a zone with Redis.
#[inline]
pub fn in_redis(mcf: &MainConf, zone: usize, rate: Rate, bucket: bool) -> bool {
    (bucket || strict::small(rate))
        && mcf
            .zones
            .get(zone)
            .is_some_and(|z| z.params.as_ref().is_some_and(|p| p.backend.is_some()))
}

/// Sends what this node owes Redis of a fleet's bucket (`milli`
/// thousandths, `bucket::fleet`) down the zone's strict link, as a count
/// no request waits for: ahead of the worker's next request of the key
/// that asks Redis.
pub fn owe(a: &Ask<'_>, id: EntryId, milli: u64) {
    let Some(ch) = crate::worker::channel::channel() else {
        return;
    };
    let count = link::Ask {
        ticket: waits::NO_TICKET,
        id: ItemId { zone: a.zone as u32, entry: id, window: 0 },
        namespace: a.namespace,
        key: a.key,
        period: a.rate.period,
        limit: a.rate.limit,
        kind: Kind::of_burst(a.bucket.map(|b| b.burst)),
        cost: u32::try_from(milli).unwrap_or(u32::MAX),
        deadline_ms: strict::COUNTED,
    };
    link::send_one(ch, &count);
}

/// Sends the counts of the `Strict::CountOnly` limits among `asks` (the engine
/// counted them in flight; `ids`: their entries) down their zones' strict
/// links. One per entry, at the heaviest cost of the limits sharing it, as
/// the engine counted it; an entry whose first limit is decided in the
/// background went with the thread's increments.
pub(super) fn send(asks: &[Ask<'_>], ids: &[EntryId], now: u64) {
    let Some(ch) = crate::worker::channel::channel() else {
        return;
    };
    let entry = |i: usize| (asks[i].zone, ids[i]);
    for (i, a) in asks.iter().enumerate() {
        // the first limit of the entry sends, if Redis decides it
        if a.strict != Strict::CountOnly || (0..i).any(|j| entry(j) == entry(i)) {
            continue;
        }
        let cost = (0..asks.len())
            .filter(|&j| entry(j) == entry(i))
            .map(|j| asks[j].cost)
            .max()
            .unwrap_or(a.cost);
        if cost == 0 {
            continue;
        }
        let count = link::Ask {
            ticket: waits::NO_TICKET,
            id: ItemId {
                zone: a.zone as u32,
                entry: ids[i],
                window: window_index(now, a.rate.period_ms()),
            },
            namespace: a.namespace,
            key: a.key,
            period: a.rate.period,
            limit: a.rate.limit,
            kind: Kind::Window,
            cost,
            deadline_ms: strict::COUNTED,
        };
        link::send_one(ch, &count);
    }
}
