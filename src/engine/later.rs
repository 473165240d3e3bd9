//! Counts of limits Redis decides (`strict`, a small limit) that are not
//! waited for: a `count_if=` count after the response, a Lua caller's
//! request (Lua never waits). The engine counts them here in flight
//! (`Strict::Later`) and they go down the zone's strict link, the
//! connection this worker's strict checks take: there they reach Redis
//! before the worker's next check of the key, which could otherwise run
//! ahead of an increment still queued for the Redis thread and let the
//! key's last request through twice.

use ratelimit_core::batch::ItemId;
use ratelimit_core::key::redis_tag_inline;
use ratelimit_core::rate::Rate;
use ratelimit_core::strict;
use ratelimit_core::window::window_index;
use smallvec::SmallVec;

use super::{entry_id, Ask, Strict};
use crate::backend::StrictAsk;
use crate::conf::MainConf;
use crate::worker::waits;

/// Whether Redis decides a limit of `rate` in `zone` for the directive
/// although it is not `strict`: a small limit (`strict::small`) on a zone
/// with Redis.
#[inline]
pub fn small_in_redis(mcf: &MainConf, zone: usize, rate: Rate) -> bool {
    strict::small(rate)
        && mcf
            .zones
            .get(zone)
            .is_some_and(|z| z.params.as_ref().is_some_and(|p| p.backend.is_some()))
}

/// An entry of a zone: its index and the entry's id.
type Entry = (usize, [u64; 2]);

/// Sends the counts of the `Strict::Later` limits among `asks` (the engine
/// counted them in flight) down their zones' strict links. One per entry,
/// at the heaviest cost of the limits sharing it, as the engine counted
/// it; an entry whose first limit is decided in the background went with
/// the thread's increments.
pub fn send_later(mcf: &MainConf, asks: &[Ask<'_>], now: u64) {
    let Some(ch) = crate::worker::channel::channel() else {
        return;
    };
    // each ask's entry (zone, id), hashed once
    let entries: SmallVec<[Option<Entry>; 4]> = asks
        .iter()
        .map(|a| {
            let shared = mcf.zones.get(a.zone)?.shared.as_ref()?;
            Some((a.zone, entry_id(shared, a)))
        })
        .collect();
    let mut sends = Vec::new();
    for (i, a) in asks.iter().enumerate() {
        let Some(here) = entries[i] else {
            continue;
        };
        // the first limit of the entry sends, if Redis decides it
        if entries[..i].contains(&Some(here)) || a.strict != Strict::Later {
            continue;
        }
        let cost = asks
            .iter()
            .zip(&entries)
            .filter(|(_, e)| **e == Some(here))
            .map(|(o, _)| o.cost)
            .max()
            .unwrap_or(a.cost);
        if cost == 0 {
            continue;
        }
        sends.push(StrictAsk {
            ticket: waits::NO_TICKET,
            id: ItemId {
                zone: a.zone as u32,
                entry: here.1,
                window: window_index(now, a.rate.period_ms()),
            },
            tag: redis_tag_inline(a.namespace, a.key),
            period: a.rate.period,
            limit: a.rate.limit,
            cost,
            deadline_ms: strict::COUNTED,
        });
    }
    if !sends.is_empty() {
        crate::worker::link::send(ch, sends.drain(..));
    }
}
