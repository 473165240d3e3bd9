//! The worker's side of its Redis thread: the channel between them
//! (`channel.rs`), Redis's answers applied on the worker's thread
//! (`reply.rs`), the strict requests that wait, by ticket (`waits.rs`), the
//! worker's own connection for strict calls (`link/`), its leases of the
//! fleet's concurrency limits (`holdings.rs`), the thread's start
//! and stop and the notifications that bring answers (`process.rs`), and
//! nginx's cached clock (`time.rs`). Below the engine and the HTTP phases;
//! above the configuration, the shared zone and the thread.

pub mod channel;
pub mod controls;
pub mod holdings;
pub mod link;
pub mod process;
pub mod reply;
pub mod time;
pub mod waits;
