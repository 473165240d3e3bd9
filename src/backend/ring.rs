//! A zone's ring and sender's lease in its shared memory, from the threads'
//! side (`ratelimit_core::ring`): one thread of the node holds the lease
//! and sends the zone's counts; the others forward theirs into the ring.
//! The shared-memory layer lays the header and the data out
//! (`shm::attach`); the threads lock them with a spin lock of their own
//! (a thread never calls nginx), for as long as a record takes to copy.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use ratelimit_core::batch::{Batch, Item, ItemId};
use ratelimit_core::ring::{may_take, Forwarded, Ring, RingState};

use super::clock::unix_ms;
use super::event::ZoneSpec;
use super::event::{Event, Level};
use super::process::{own_pid, process_alive};
use super::retry::Retry;
use super::server::Server;

/// The ring's header, at the start of its part of the zone's memory.
#[repr(C)]
pub struct RingHeader {
    lock: AtomicU32,
    /// Bumped by every thread that forwards (and by the sender's own
    /// worker, when it wakes its thread): the sender sleeps on it (a futex
    /// word in shared memory, so another process's thread can wake it).
    seq: AtomicU32,
    /// The process whose thread holds the sender's lease (0: none), and
    /// when it last renewed it (ms since the epoch).
    holder: AtomicU64,
    renewed_ms: AtomicU64,
    /// When a thread last forwarded into the ring (ms since the epoch):
    /// the sender looks at the ring often while others forward.
    forwarded_ms: AtomicU64,
    state: UnsafeCell<RingState>,
}

impl RingHeader {
    pub const SIZE: usize = std::mem::size_of::<RingHeader>();

    /// A header for an empty ring that nobody holds.
    pub fn new() -> RingHeader {
        RingHeader {
            lock: AtomicU32::new(0),
            seq: AtomicU32::new(0),
            holder: AtomicU64::new(0),
            renewed_ms: AtomicU64::new(0),
            forwarded_ms: AtomicU64::new(0),
            state: UnsafeCell::new(RingState::default()),
        }
    }
}

impl Default for RingHeader {
    fn default() -> RingHeader {
        RingHeader::new()
    }
}

/// A zone's ring as a thread reaches it.
#[derive(Clone, Copy, Debug)]
pub struct RingRef {
    hdr: *const RingHeader,
    data: *mut u8,
    len: usize,
}

// SAFETY: the ring lies in the zone's shared memory, mapped at one address
// for the worker's whole life; the thread that holds this is joined
// (`exit_process`) before the worker unmaps anything, and every access to
// the state and the data is under the ring's lock.
unsafe impl Send for RingRef {}

impl RingRef {
    /// # Safety
    /// `hdr` points at a `RingHeader` and `data` at `len` bytes after it,
    /// in shared memory that stays mapped while the reference is used.
    pub unsafe fn new(hdr: *const RingHeader, data: *mut u8, len: usize) -> RingRef {
        RingRef { hdr, data, len }
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: see `new` and the `Send` impl.
        unsafe { &*self.hdr }
    }

    /// Runs `f` on the ring under its lock, which holds the process id of
    /// its holder: a process killed while it held it (a few microseconds)
    /// is found gone, and the lock taken from it.
    pub fn with<R>(
        &self,
        me: u32,
        alive: impl Fn(u64) -> bool,
        f: impl FnOnce(&mut Ring<'_>) -> R,
    ) -> R {
        let h = self.header();
        let mut spins = 0u32;
        loop {
            let held = h.lock.load(Ordering::Relaxed);
            let free = held == 0 || spins >= 4096 && !alive(u64::from(held));
            if free
                && h.lock
                    .compare_exchange_weak(held, me, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                break;
            }
            spins += 1;
            if spins.is_multiple_of(64) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        // SAFETY: the lock is held: no other thread or process touches the
        // state or the data until it is released below.
        let out = unsafe {
            let data = std::slice::from_raw_parts_mut(self.data, self.len);
            let mut ring = Ring::attach(&mut *h.state.get(), data);
            f(&mut ring)
        };
        h.lock.store(0, Ordering::Release);
        out
    }

    /// Takes or renews the sender's lease for process `me` at `now_ms`;
    /// returns whether it holds it, and the process it took it from (0:
    /// none, or nobody held it).
    pub fn lease(&self, me: u64, now_ms: u64, alive: impl Fn(u64) -> bool) -> (bool, u64) {
        let h = self.header();
        let holder = h.holder.load(Ordering::Acquire);
        if holder == me {
            h.renewed_ms.store(now_ms, Ordering::Release);
            return (true, 0);
        }
        if !may_take(holder, h.renewed_ms.load(Ordering::Acquire), me, now_ms, alive) {
            return (false, 0);
        }
        if h.holder.compare_exchange(holder, me, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            h.renewed_ms.store(now_ms, Ordering::Release);
            return (true, holder);
        }
        (false, 0)
    }

    /// The process that holds the lease (0: none).
    pub fn holder(&self) -> u64 {
        self.header().holder.load(Ordering::Acquire)
    }

    /// Gives the lease back (the holder's thread stops).
    pub fn release(&self, me: u64) {
        let _ = self.header().holder.compare_exchange(me, 0, Ordering::AcqRel, Ordering::Acquire);
    }
}

impl RingRef {
    /// Notes that a thread forwarded just now, and wakes the sender.
    fn forwarded_now(&self, now_ms: u64) {
        self.header().forwarded_ms.store(now_ms, Ordering::Relaxed);
        self.wake();
    }

    /// The word the sender sleeps on.
    pub fn seq(&self) -> &AtomicU32 {
        &self.header().seq
    }

    /// Wakes the thread that sleeps on the ring (`sleep`), in any process.
    pub fn wake(&self) {
        let seq = self.seq();
        seq.fetch_add(1, Ordering::AcqRel);
        // SAFETY: FUTEX_WAKE on a 4-byte aligned word of shared memory that
        // stays mapped; it reads nothing else. Shared (not private): the
        // sleeper may be another process.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                seq.as_ptr(),
                libc::FUTEX_WAKE,
                i32::MAX,
                0usize,
                0usize,
                0u32,
            )
        };
    }

    /// Sleeps until the ring's word moves from `seen` (a wake) or `for_`
    /// passes; returns at once when it has moved already.
    pub fn sleep(&self, seen: u32, for_: std::time::Duration) {
        let ts = libc::timespec {
            tv_sec: for_.as_secs().min(i64::MAX as u64) as libc::time_t,
            tv_nsec: libc::c_long::from(for_.subsec_nanos() as i32),
        };
        // SAFETY: FUTEX_WAIT on a 4-byte aligned word of shared memory
        // that stays mapped, with a relative timeout from our stack; it
        // returns at once (EAGAIN) when the word is not `seen` any more,
        // and on a signal (the thread blocks them all) or the timeout.
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                self.seq().as_ptr(),
                libc::FUTEX_WAIT,
                seen,
                &raw const ts,
                0usize,
                0u32,
            )
        };
    }

    /// When a thread last forwarded (ms since the epoch; 0: never).
    pub fn forwarded_ms(&self) -> u64 {
        self.header().forwarded_ms.load(Ordering::Relaxed)
    }
}

/// The most records a sender takes out of a ring at a time (what follows
/// waits for the next turn, milliseconds later).
const TAKE_MAX: usize = 4096;

/// This thread's part in sending a zone: whether it holds the zone's
/// lease (it sends the node's counts of the zone, its worker's and those
/// the other workers forward) or forwards its worker's counts into the
/// zone's ring.
pub(super) struct Lease {
    ring: Option<RingRef>,
    holds: bool,
}

impl Lease {
    pub(super) fn new(ring: Option<RingRef>) -> Lease {
        Lease { ring, holds: false }
    }

    /// Whether this thread sends the zone's counts to Redis: it holds the
    /// lease, or the zone has no ring here.
    pub(super) fn sends(&self) -> bool {
        self.holds || self.ring.is_none()
    }

    /// The zone's ring, if it has one here.
    pub(super) fn ring(&self) -> Option<RingRef> {
        self.ring
    }

    /// The ring a sender sleeps on (the other workers wake it there).
    pub(super) fn sender_ring(&self) -> Option<RingRef> {
        self.ring.filter(|_| self.holds)
    }

    /// Takes the zone's sender lease, or keeps it; says when this worker
    /// takes it from another that stopped renewing it (died, or stalled),
    /// or loses it so (a lease taken from nobody, at a start or after a
    /// sender that exited, goes unsaid).
    pub(super) fn renew(&mut self, spec: &ZoneSpec, events: &mut Vec<Event>) {
        let Some(ring) = self.ring else {
            return;
        };
        let was = self.holds;
        let (holds, from) = ring.lease(own_pid(), unix_ms(), process_alive);
        self.holds = holds;
        let what = if holds && from != 0 {
            format!("takes over sending the node's counts to Redis from worker process {from}")
        } else if was && !holds {
            "stopped sending the node's counts to Redis: another worker took over".to_string()
        } else {
            return;
        };
        events.push(Event::Log {
            zone: spec.index,
            level: Level::Handover,
            message: format!("redis_ratelimit: zone \"{}\": this worker {}", spec.name, what),
        });
    }

    /// The thread stops: the lease is free for another worker at once.
    pub(super) fn release(&mut self) {
        if let (Some(ring), true) = (self.ring, self.holds) {
            ring.release(own_pid());
            self.holds = false;
        }
    }

    /// The sender: takes what the other workers forwarded into `batch`,
    /// where it coalesces with this worker's counts and waits for its time.
    /// What the batch has no room for stays counted on the node (dropped).
    /// Returns whether any of it is to go at once (a key near its limit:
    /// no flush pacing for it, as for the sender's own worker's).
    pub(super) fn take_forwarded(
        &mut self,
        batch: &mut Batch,
        retry: &mut Retry,
        server: &Server,
        events: &mut Vec<Event>,
    ) -> bool {
        let (Some(ring), true) = (self.ring, self.holds) else {
            return false;
        };
        let mut got = Vec::new();
        ring.with(own_pid() as u32, process_alive, |r| {
            while got.len() < TAKE_MAX {
                match r.pop() {
                    Some(f) => got.push(f),
                    None => break,
                }
            }
        });
        let zone = server.spec.index;
        let mut now = false;
        for f in got {
            let id = f.id(zone);
            now |= f.item.due == 0;
            if batch.merge(id, f.item.clone()).is_none() {
                retry.undelivered(id, &f.item, server, events);
            }
        }
        now
    }

    /// Not the sender: hands `items` (and what waited for room before) to
    /// the node's sender through the zone's ring, with their due times.
    pub(super) fn forward(
        &self,
        items: Vec<(ItemId, Item)>,
        retry: &mut Retry,
        server: &Server,
        events: &mut Vec<Event>,
    ) {
        let Some(ring) = self.ring else {
            return;
        };
        let items = retry.with(items);
        if items.is_empty() {
            return;
        }
        let mut left = Vec::new();
        ring.with(own_pid() as u32, process_alive, |r| {
            for (id, item) in items {
                let f = Forwarded { entry: id.entry, window: id.window, item };
                if !r.push(&f) {
                    left.push((id, f.item));
                }
            }
        });
        ring.forwarded_now(unix_ms());
        retry.keep(&left, server, events);
    }
}
