//! The HTTP phases, the top layer of the glue: the preaccess handler that
//! evaluates keys and asks the engine (`handler.rs`), the strict request's
//! wait for Redis (`strict.rs`), the log phase that counts `count_if=`
//! limits (`count.rs`), how a decided request is answered (`answer.rs`),
//! the `$redis_ratelimit_*` variables (`vars.rs`) and the metrics page
//! (`metrics.rs`).

pub mod answer;
pub mod count;
pub mod handler;
pub mod metrics;
pub mod strict;
pub mod vars;
