//! The Redis thread takes no signals: they are the worker's (nginx's
//! handlers run on the worker's thread), so the thread is spawned with
//! every signal blocked.

/// Blocks every signal in the calling thread; returns the previous mask.
pub(super) fn block_all() -> libc::sigset_t {
    // SAFETY: plain libc calls on local signal sets.
    unsafe {
        let mut all: libc::sigset_t = std::mem::zeroed();
        let mut old: libc::sigset_t = std::mem::zeroed();
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
        old
    }
}

/// Restores a mask `block_all` returned.
pub(super) fn restore(old: &libc::sigset_t) {
    // SAFETY: restores a mask returned by `block_all`.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, old, std::ptr::null_mut());
    }
}
