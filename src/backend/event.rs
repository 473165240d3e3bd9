//! What a worker and its Redis thread say to each other: the zones the
//! thread serves (`ZoneSpec`), and what it hands back (`Event`): Redis's
//! counts, increments that stay local, log lines.

use std::time::Duration;

use ratelimit_core::batch::ItemId;
use ratelimit_core::counter::Confirmation;
use ratelimit_core::stats::Stats;

/// Items per pipeline.
pub const PIPELINE_ITEMS: usize = 1024;

/// A zone with a Redis backend, as the thread needs it.
#[derive(Clone, Debug)]
pub struct ZoneSpec {
    pub index: u32,
    pub name: String,
    pub urls: Vec<String>,
    pub cluster: bool,
    pub prefix: Vec<u8>,
    pub timeout: Duration,
    /// The zone's figures in shared memory (`None`: not mapped here).
    pub stats: Option<StatsRef>,
}

/// A zone's figures in shared memory, for its Redis thread to count in.
#[derive(Clone, Copy, Debug)]
pub struct StatsRef(*const Stats);

// SAFETY: the figures are atomics in the zone's shared memory, mapped at one
// address for the worker's whole life; the thread that holds this is joined
// (`exit_process`) before the worker unmaps anything.
unsafe impl Send for StatsRef {}

impl StatsRef {
    pub fn new(stats: &Stats) -> StatsRef {
        StatsRef(stats)
    }

    pub fn get(&self) -> &Stats {
        // SAFETY: see the `Send` impl: the pointer stays valid while the
        // thread runs.
        unsafe { &*self.0 }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Error,
    Notice,
}

#[derive(Debug)]
pub enum Event {
    /// Redis's counts for an item.
    Confirmed {
        id: ItemId,
        period: u32,
        limit: u32,
        confirmation: Confirmation,
    },
    /// Redis did not take these increments (an error reply for the key, or
    /// the connection was lost with their fate unknown): they stay counted
    /// on this node only.
    KeepLocal {
        id: ItemId,
        sent: u32,
    },
    Log {
        zone: u32,
        level: Level,
        message: String,
    },
}
