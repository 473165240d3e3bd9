//! A concurrency limit (`redis_ratelimit_conn`), as `limit_conn` keeps
//! one: the requests of a key in flight on this node, in the key's entry of
//! the zone's table (its `cur`), taken when a request passes the preaccess
//! phase and given back when it ends. Pure logic over `table::Entry`.

use crate::table::Entry;

/// What a key's concurrency entry id is made with in place of a period
/// (the table's ids hash a namespace, a period and a key): a value no
/// window's period (1, 60, 3600, 86 400) and no bucket's
/// (`bucket::id_period`, the top bit set) takes, so a key's slots, its
/// windows and its buckets never share an entry.
pub const CONN_PERIOD: u32 = 1 << 30;

/// The most requests in flight a limit takes (`number`).
pub const MAX_CONN: u32 = 1_000_000;

/// How long a holder's lease of a key's slots lives in Redis unrenewed
/// (`lease=`, a zone with `redis=`; `conn_fleet`), by default and at
/// least and most (ms): a holder renews it every third, so a second is
/// the least that leaves room for a round trip, and a minute is as long
/// as a dead node's slots should stay counted.
pub const LEASE_MS: u32 = 10_000;
pub const MIN_LEASE_MS: u64 = 1_000;
pub const MAX_LEASE_MS: u64 = 60_000;

/// Takes a slot of a key that may have `max` requests in flight: false
/// (nothing taken) when all are taken.
#[inline]
pub fn take(e: &mut Entry, max: u32) -> bool {
    if e.cur >= max {
        return false;
    }
    e.cur += 1;
    true
}

/// Gives a slot back (a request that held one ended).
#[inline]
pub fn give(e: &mut Entry) {
    e.cur = e.cur.saturating_sub(1);
}

/// The key's requests in flight.
#[inline]
pub fn in_flight(e: &Entry) -> u32 {
    e.cur
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_taken_up_to_the_number_and_given_back() {
        let mut e = Entry::default();
        assert!(take(&mut e, 2) && take(&mut e, 2));
        assert!(!take(&mut e, 2), "two in flight: the third is refused");
        assert_eq!(in_flight(&e), 2, "a refused request takes nothing");
        give(&mut e);
        assert!(take(&mut e, 2), "one ended: one more");
        give(&mut e);
        give(&mut e);
        give(&mut e);
        assert_eq!(in_flight(&e), 0, "never below none");
    }

    #[test]
    fn the_conn_period_is_no_window_s_nor_bucket_s() {
        for p in [1u32, 60, 3600, 86_400] {
            assert_ne!(p, CONN_PERIOD);
        }
        assert_eq!(CONN_PERIOD >> 31, 0, "a bucket's id period has the top bit set");
    }
}
