//! The nginx glue: everything that touches nginx's types or calls its API.
//!
//! | file | what it holds |
//! |---|---|
//! | `module.rs` | the module as the glue knows it: `Module`, its configurations |
//! | `conf.rs` | what the directives store; location inheritance |
//! | `directives.rs` | one handler per directive; `[emerg]` refusals |
//! | `zone.rs` | a zone's shared memory: mapping, locking |
//! | `zone_files.rs` | the files a zone names (`password_file=`, `ssl_*=`), read and checked |
//! | `handler.rs` | the preaccess handler: evaluates keys, asks the engine |
//! | `answer.rs` | how a decided request is answered: log line, state for the variables, headers, status |
//! | `count.rs` | the log phase handler: counts `count_if=` limits after the response |
//! | `strict.rs` | strict limits: the request waits for Redis's decision, the worker does not |
//! | `waits.rs` | strict requests that wait, by ticket; answers wake them |
//! | `reply.rs` | Redis's answers applied on the worker's thread (thread and links) |
//! | `link.rs` | strict links: the worker's own connection for strict calls, on its event loop |
//! | `metrics.rs` | `redis_ratelimit_metrics`: the figures page |
//! | `vars.rs` | `$redis_ratelimit_*` variables |
//! | `channel.rs` | the worker's channel to its Redis thread |
//! | `worker.rs` | the worker's side of the Redis thread: start, stop, replies |
//! | `time.rs` | nginx's cached clock |

pub mod answer;
pub mod channel;
pub mod conf;
pub mod count;
pub mod directives;
pub mod handler;
pub mod link;
pub mod metrics;
pub mod module;
pub mod reply;
pub mod strict;
pub mod time;
pub mod vars;
pub mod waits;
pub mod worker;
pub mod zone;
pub mod zone_files;
