//! The wall clock the Redis thread works with: windows are aligned to the
//! epoch, and Redis's counters are named by their window's start.

/// Milliseconds since the epoch (0 before it: a clock that broken counts
/// in the first window).
pub(super) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as u64)
        .unwrap_or(0)
}
