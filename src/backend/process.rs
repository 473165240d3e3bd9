//! This worker's process, and whether another worker's still runs (a
//! sender's lease and a thread's slot in a zone's waiting gauge are held
//! by process id).

/// This worker's process id.
pub(super) fn own_pid() -> u64 {
    // SAFETY: getpid() has no preconditions.
    u64::from(unsafe { libc::getpid() }.unsigned_abs())
}

/// Whether process `pid` still runs: `kill(pid, 0)` succeeds, or is
/// refused for lack of permission (it exists).
pub fn process_alive(pid: u64) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    if pid <= 0 {
        return false; // 0 would ask about the whole process group
    }
    // SAFETY: signal 0 sends nothing; it only checks that the process exists.
    let sent = unsafe { libc::kill(pid, 0) } == 0;
    sent || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// What names this worker as a holder of leases of a concurrency limit's
/// slots in Redis (`conn_fleet`): one number per worker process, its pid
/// and start time mixed with a random key (workers forked of one master
/// share that key; a pid is not unique across nodes, nor across a
/// restart).
pub fn holder() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static HOLDER: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *HOLDER.get_or_init(|| {
        let mut h = std::collections::hash_map::RandomState::new().build_hasher();
        h.write_u64(own_pid());
        let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        h.write_u128(since.map_or(0, |d| d.as_nanos()));
        h.finish()
    })
}
