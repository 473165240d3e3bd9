//! Lua's `reset` of a key on a zone whose strict link is up: its `DEL` is
//! written down the link, between the calls before it and after it.

use ratelimit_core::batch::Delete;
use ratelimit_core::resp;

use super::made;
use crate::worker::reply::main_conf;
use crate::worker::time::mono_us;

/// Lua's `reset` of a key (`d`: both windows, or its bucket), down the
/// zone's link when it has one: the `DEL` is then in
/// Redis after the strict calls this worker made before it and before
/// those it makes after, which the thread's own `DEL` would not be.
/// `false`: no link (or it failed on the way, or asks wait with the
/// thread: `thread_first`), the thread deletes, before the strict calls it
/// sends next. Either way a count made before the reset that is still held
/// back (behind its key's call out, or with the thread) reaches Redis
/// after the `DEL` and outlives the reset: stricter by that count, never
/// looser.
pub fn reset(zone: usize, d: &Delete) -> bool {
    let Some(params) = main_conf().and_then(|m| m.zones.get(zone)?.params.as_ref()) else {
        return false;
    };
    let Some(l) = made(zone) else {
        return false;
    };
    // SAFETY: links live for the worker's life; this thread only.
    let link = unsafe { &mut *l };
    if link.c.is_null() || link.thread_first() {
        return false;
    }
    if link.calls.has_waiting() {
        link.write_waiting();
        if link.c.is_null() {
            return false; // it failed writing them
        }
    }
    let keys = d.keys(&params.prefix);
    resp::array(&mut link.out, 1 + keys.len());
    resp::bulk(&mut link.out, b"DEL");
    for k in &keys {
        resp::bulk(&mut link.out, k);
    }
    link.calls.other(mono_us());
    link.arm();
    link.write_out();
    !link.c.is_null()
}
