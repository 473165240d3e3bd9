//! nginx's clock, as the module reads it.

use std::ptr;

use nginx_sys::{ngx_cached_time, ngx_current_msec};

/// Wall-clock milliseconds from nginx's cached time (windows are aligned to
/// the epoch, so every node agrees on them).
pub fn now_ms() -> u64 {
    // SAFETY: nginx keeps `ngx_cached_time` pointing at a valid slot; reading
    // it through a volatile load is how nginx itself reads it.
    unsafe {
        let tp = ptr::read_volatile(ptr::addr_of!(ngx_cached_time));
        ((*tp).sec as u64) * 1000 + (*tp).msec as u64
    }
}

/// nginx's monotonic milliseconds, as the event loop last read them
/// (timers run on it): nothing read per call.
pub fn mono_ms() -> u64 {
    // SAFETY: a word nginx updates on this thread, read as nginx reads it.
    unsafe { ptr::read_volatile(ptr::addr_of!(ngx_current_msec)) as u64 }
}

/// A monotonic clock in microseconds (a strict call's round trip), read
/// straight from `clock_gettime`.
pub fn mono_us() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes the timespec it is given; the monotonic
    // clock is always there on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64) * 1_000_000 + (ts.tv_nsec as u64) / 1000
}
