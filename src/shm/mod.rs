//! The shared memory behind a `redis_ratelimit_zone`: one slab allocation
//! holding the counter table (see `table.rs`), found again through the slab
//! pool's `data` pointer when nginx reuses the zone across a reload.
//!
//! Region layout: `[u64 length][table header][bucket heads][entries]`, then
//! the zone's controls `[controls header][slots]` (`ratelimit_core::control`)
//! and its busiest keys `[top header][slots]` (`ratelimit_core::top`),
//! and for a zone with Redis `[ring header][ring data]` at its end (the
//! queue from every worker's thread to the node's sender:
//! `backend::RingRef`).
//! The length comes first and never moves, so a region written by another
//! version of the module can still be measured and formatted anew.

use std::ffi::c_void;
use std::io::Read;
use std::ptr;

use nginx_sys::{
    ngx_log_t, ngx_pagesize, ngx_shm_zone_t, ngx_shmtx_lock, ngx_shmtx_unlock, ngx_slab_alloc,
    ngx_slab_pool_t, NGX_LOG_EMERG, NGX_LOG_NOTICE,
};
use ngx::{ngx_log_debug, ngx_log_error};

use ratelimit_core::control::{self, Controls};
use ratelimit_core::key::{IdHasher, Namespace};
use ratelimit_core::ring::ring_bytes;
use ratelimit_core::stats::Stats;
use ratelimit_core::table::{Entry, Header, Layout, Table};
use ratelimit_core::top::{self, Top};

use crate::backend::{RingHeader, RingRef};

const LEN_PREFIX: usize = 8;

/// A zone's mapped table (same address in every worker).
pub struct Shared {
    pool: *mut ngx_slab_pool_t,
    table: *mut u8,
    layout: Layout,
    /// Where the bucket heads and the entries start (cut once, not at every
    /// lock).
    buckets: *mut u32,
    entries: *mut Entry,
    /// Entry ids for this zone's seed (process-local, set up once).
    pub ids: IdHasher,
    /// The zone's name as a namespace, hashed once (`redis_ratelimit` lines
    /// count their keys under it).
    pub name: Namespace,
    /// A zone with Redis: its ring (header, data, data's length).
    ring: Option<(*mut RingHeader, *mut u8, usize)>,
    /// The zone's controls: header, slots, how many.
    controls: (*mut control::Header, *mut control::Slot, usize),
    /// The zone's busiest keys: header, slots, how many.
    top: (*mut top::Header, *mut top::Slot, usize),
}

/// The table (and the zone's controls and busiest keys, cut from the
/// region when asked for), locked for the lifetime of this guard.
pub struct Locked<'a> {
    pool: *mut ngx_slab_pool_t,
    pub table: Table<'a>,
    shared: &'a Shared,
}

impl Locked<'_> {
    /// The zone's controls (`ratelimit_core::control`).
    pub fn controls(&mut self) -> Controls<'_> {
        let (h, slots, n) = self.shared.controls;
        // SAFETY: the lock is held for as long as `self` (borrowed
        // mutably here); the parts were cut from the region by `attach`.
        unsafe { Controls::attach(&mut *h, std::slice::from_raw_parts_mut(slots, n)) }
    }

    /// The zone's busiest keys (`ratelimit_core::top`).
    pub fn top(&mut self) -> Top<'_> {
        let (h, slots, n) = self.shared.top;
        // SAFETY: as for `controls`.
        unsafe { Top::attach(&mut *h, std::slice::from_raw_parts_mut(slots, n)) }
    }
}

impl Drop for Locked<'_> {
    fn drop(&mut self) {
        // SAFETY: the mutex was locked by `Shared::lock` in this process.
        unsafe { ngx_shmtx_unlock(&mut (*self.pool).mutex) };
    }
}

impl Shared {
    /// Where the zone lies in shared memory: locks of several zones are
    /// taken in this order, which every process agrees on.
    pub fn order(&self) -> usize {
        self.pool as usize
    }

    /// The zone's decision counters: atomics in its shared memory, read and
    /// counted without the lock.
    pub fn stats(&self) -> &Stats {
        // SAFETY: the table's header starts the region (after the length)
        // for as long as the zone is mapped, which outlives `self`; `Stats`
        // is made of atomics, safe to share between processes and threads.
        unsafe { &(*self.table.cast::<Header>()).stats }
    }

    /// Whether the zone has any control (blocked or overridden keys): read
    /// without the lock, so a zone without costs its requests nothing more.
    #[inline(always)]
    pub fn has_controls(&self) -> bool {
        // SAFETY: the controls' header lies in the zone's region for as
        // long as it is mapped, which outlives `self`; `live` is atomic.
        unsafe { (*self.controls.0).live.load(std::sync::atomic::Ordering::Relaxed) > 0 }
    }

    /// The id of a key's controls, from the key as Redis names it
    /// (`control::key_form`: what the fleet's nodes share).
    #[inline]
    pub fn control_id(&self, part: &[u8]) -> ratelimit_core::key::EntryId {
        self.ids.id_in(self.name, 0, part)
    }

    /// The zone's ring, for its Redis thread (a zone with Redis).
    pub fn ring(&self) -> Option<RingRef> {
        // SAFETY: the header and the data were laid out by `attach` in the
        // zone's shared memory, mapped for the worker's whole life.
        self.ring.map(|(h, d, n)| unsafe { RingRef::new(h, d, n) })
    }

    /// Takes the zone's lock (nginx's slab mutex, which the master releases
    /// should a worker die holding it) and returns the table.
    #[inline(always)]
    pub fn lock(&self) -> Locked<'_> {
        // SAFETY: `pool` is the slab pool nginx initialised for this zone; its
        // mutex is valid in every process that maps the zone.
        unsafe { ngx_shmtx_lock(&mut (*self.pool).mutex) };
        // SAFETY: the lock is held, so no other process or thread touches the
        // table until `Locked` drops; the parts lie inside the region as
        // `parts` cut them by the layout the table was formatted or checked
        // with.
        let table = unsafe {
            Table::attach(
                &mut *self.table.cast::<Header>(),
                std::slice::from_raw_parts_mut(self.buckets, self.layout.nbuckets as usize),
                std::slice::from_raw_parts_mut(self.entries, self.layout.capacity as usize),
            )
        };
        Locked { pool: self.pool, table, shared: self }
    }
}

/// Cuts the region at `base` into the three parts the table is made of.
///
/// # Safety
/// `base` must point at a region of at least `layout.total()` bytes, 8-byte
/// aligned, that nothing else accesses while the parts are in use.
unsafe fn parts<'a, R>(
    base: *mut u8,
    layout: Layout,
    f: impl FnOnce(&'a mut Header, &'a mut [u32], &'a mut [Entry]) -> R,
) -> R {
    // SAFETY: per the function's contract; offsets come from `layout` and are
    // aligned for their types.
    unsafe {
        let hdr = &mut *base.cast::<Header>();
        let buckets = std::slice::from_raw_parts_mut(
            base.add(layout.buckets_offset()).cast::<u32>(),
            layout.nbuckets as usize,
        );
        let entries = std::slice::from_raw_parts_mut(
            base.add(layout.entries_offset()).cast::<Entry>(),
            layout.capacity as usize,
        );
        f(hdr, buckets, entries)
    }
}

fn random_seed() -> [u64; 2] {
    let mut buf = [0u8; 16];
    if std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut buf)).is_ok() {
        let a = u64::from_ne_bytes(buf[..8].try_into().unwrap_or_default());
        let b = u64::from_ne_bytes(buf[8..].try_into().unwrap_or_default());
        return [a, b];
    }
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    [t, u64::from(std::process::id()) ^ 0x9e37_79b9_7f4a_7c15]
}

/// Maps a zone's table: on a fresh zone, allocates the region and formats
/// the table; on a zone kept across a reload, finds the region again and
/// keeps its counts unless the layout changed. `None` (logged) when the
/// zone cannot hold a table.
///
/// # Safety
/// `shm_zone` is the zone nginx initialises, its memory starting with the
/// slab pool nginx set up; `data` is what nginx passes to the zone's `init`;
/// `log` is valid.
pub unsafe fn attach(
    shm_zone: *mut ngx_shm_zone_t,
    data: *mut c_void,
    name: &str,
    ring: bool,
    log: *mut ngx_log_t,
) -> Option<Shared> {
    // SAFETY: per the function's contract.
    let pool = unsafe { (*shm_zone).shm.addr.cast::<ngx_slab_pool_t>() };

    // SAFETY: the pool is valid; `data` is non-null on a reused zone.
    let reused = !data.is_null() || unsafe { !(*pool).data.is_null() };
    let region: *mut u8;
    let region_len: usize;
    if reused {
        // SAFETY: we stored the region there when the zone was first set up.
        region = unsafe { (*pool).data.cast::<u8>() };
        // SAFETY: the first 8 bytes of the region always hold its length.
        region_len = unsafe { ptr::read(region.cast::<u64>()) } as usize;
    } else {
        // SAFETY: nothing else allocates from this pool; every free page is
        // handed to the table.
        let bytes = unsafe { (*pool).pfree * ngx_pagesize };
        // SAFETY: the pool is initialised by nginx before `init` runs.
        region = unsafe { ngx_slab_alloc(pool, bytes) }.cast::<u8>();
        if region.is_null() {
            ngx_log_error!(
                NGX_LOG_EMERG,
                log,
                "redis_ratelimit_zone: cannot allocate {} bytes in zone \"{}\"",
                bytes,
                name
            );
            return None;
        }
        region_len = bytes;
        // SAFETY: the region is ours and at least 8 pages long.
        unsafe {
            ptr::write(region.cast::<u64>(), bytes as u64);
            (*pool).data = region.cast();
        }
    }

    // the ring at the end, 8-byte aligned
    let ring_len = if ring { ring_bytes(region_len) & !7 } else { 0 };
    let ring_part = if ring { RingHeader::SIZE + ring_len } else { 0 };
    let (controls_len, slots) = control::layout(region_len);
    let (top_len, top_slots) = top::layout(slots);
    let extras = controls_len + top_len;
    let table_bytes = region_len.saturating_sub(LEN_PREFIX + ring_part + extras) & !7;
    let Some(layout) = Layout::for_region(table_bytes) else {
        ngx_log_error!(NGX_LOG_EMERG, log, "redis_ratelimit_zone: zone \"{}\" is too small", name);
        return None;
    };
    // SAFETY: the region is page-aligned, so the table after the 8-byte length
    // prefix is 8-byte aligned.
    let table = unsafe { region.add(LEN_PREFIX) };
    let table_len = table_bytes as u64;

    // SAFETY: during `init` only the master runs, single-threaded: nothing
    // else reads or writes the region.
    let kept = reused && unsafe { Table::is_valid(&*table.cast::<Header>(), layout, table_len) };
    if !kept {
        if reused {
            ngx_log_error!(
                NGX_LOG_NOTICE,
                log,
                "redis_ratelimit_zone: zone \"{}\" was written by another module version, counters reset",
                name
            );
        }
        let seed = random_seed();
        // SAFETY: as above, the master has the region to itself.
        unsafe {
            parts(table, layout, |h, b, e| {
                Table::format(h, b, e, seed, table_len);
            })
        };
        // SAFETY: the controls lie after the table, inside the region,
        // 8-byte aligned; the master has the region to itself.
        unsafe {
            let (h, s) = controls_at(table.add(table_bytes));
            Controls::format(&mut *h, std::slice::from_raw_parts_mut(s, slots as usize));
            let (h, s) = top_at(table.add(table_bytes + controls_len));
            Top::format(&mut *h, std::slice::from_raw_parts_mut(s, top_slots as usize));
        }
        if ring {
            // SAFETY: the ring's header lies after the controls, inside
            // the region, 8-byte aligned; the master has the region to
            // itself.
            unsafe {
                ptr::write(table.add(table_bytes + extras).cast::<RingHeader>(), RingHeader::new())
            };
        }
    }
    let ring = ring.then(|| {
        // SAFETY: as just laid out (or kept from the previous cycle with the
        // same layout: the table's check covers the region's length).
        unsafe {
            let h = table.add(table_bytes + extras).cast::<RingHeader>();
            (h, table.add(table_bytes + extras + RingHeader::SIZE), ring_len)
        }
    });
    // SAFETY: as laid out above.
    let (ch, cs) = unsafe { controls_at(table.add(table_bytes)) };
    let controls = (ch, cs, slots as usize);
    // SAFETY: as laid out above.
    let (th, ts) = unsafe { top_at(table.add(table_bytes + controls_len)) };
    let top = (th, ts, top_slots as usize);
    ngx_log_debug!(
        log,
        "redis_ratelimit: zone \"{}\" {}: {} entries in {} bytes",
        name,
        match (reused, kept) {
            (false, _) => "fresh",
            (true, true) => "kept from the previous cycle",
            (true, false) => "reset",
        },
        layout.capacity,
        table_len
    );
    // SAFETY: the table was formatted or checked above; the seed never
    // changes after formatting.
    let seed = unsafe { (*table.cast::<Header>()).seed };
    let ids = IdHasher::new(seed);
    let name = ids.namespace(name.as_bytes());
    // SAFETY: the region holds the table as checked or formatted above.
    let (buckets, entries) =
        unsafe { parts(table, layout, |_, b, e| (b.as_mut_ptr(), e.as_mut_ptr())) };
    Some(Shared { pool, table, layout, buckets, entries, ids, name, ring, controls, top })
}

/// The controls' header and slots at `at`.
///
/// # Safety
/// `at` is 8-byte aligned, with `control::layout`'s bytes after it inside
/// the region.
unsafe fn controls_at(at: *mut u8) -> (*mut control::Header, *mut control::Slot) {
    // SAFETY: per the function's contract; the header's size keeps the
    // slots 8-byte aligned.
    unsafe { (at.cast::<control::Header>(), at.add(std::mem::size_of::<control::Header>()).cast()) }
}

/// The busiest keys' header and slots at `at`.
///
/// # Safety
/// `at` is 8-byte aligned, with `top::layout`'s bytes after it inside the
/// region.
unsafe fn top_at(at: *mut u8) -> (*mut top::Header, *mut top::Slot) {
    // SAFETY: per the function's contract; the header's size keeps the
    // slots 8-byte aligned.
    unsafe { (at.cast::<top::Header>(), at.add(std::mem::size_of::<top::Header>()).cast()) }
}
