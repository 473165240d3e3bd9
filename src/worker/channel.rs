//! Where a worker keeps its channel to its Redis thread (`worker.rs` starts
//! the thread and sets it; the engine and strict requests read it).

use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Arc, OnceLock};

use nginx_sys::ngx_cycle_t;

use crate::backend::Channel;

static CHANNEL: OnceLock<Arc<Channel>> = OnceLock::new();
/// The cycle the thread was started for. A worker keeps its cycle for life,
/// but nginx without a master process (`master_process off`) reloads in
/// place, without `init_process`: the thread's zones are then stale, and
/// the zones fall back to counting on this node.
static CYCLE: AtomicPtr<ngx_cycle_t> = AtomicPtr::new(ptr::null_mut());

/// This worker's channel to its background thread, if it has one for the
/// current cycle.
pub fn channel() -> Option<&'static Arc<Channel>> {
    // SAFETY: reads nginx's current cycle pointer on the worker's thread.
    let current = unsafe { nginx_sys::ngx_cycle };
    if CYCLE.load(Ordering::Relaxed) != current {
        return None;
    }
    CHANNEL.get()
}

/// The channel, whatever the cycle (to stop the thread, to drop answers
/// for a configuration that is gone).
pub fn any() -> Option<&'static Arc<Channel>> {
    CHANNEL.get()
}

/// Records the channel of the thread started for `cycle`.
pub fn set(cycle: *mut ngx_cycle_t, channel: Arc<Channel>) {
    CYCLE.store(cycle, Ordering::Release);
    let _ = CHANNEL.set(channel);
}
