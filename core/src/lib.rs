//! The pure core of ngx_http_redis_ratelimit: everything that decides or
//! lays out, with no nginx and no I/O, so that it is unit-tested with a
//! plain `cargo test -p ratelimit-core`.
//!
//! | module | what it holds |
//! |---|---|
//! | `rate` | `10r/s`, `100r/m`: parsing and printing |
//! | `cost` | what a request weighs: `cost=N`, or a variable's value per request |
//! | `window` | window index, the previous/current sliding estimate |
//! | `counter` | one key's counts: check, count, apply a Redis reply, roll |
//! | `decide` | the decision for a request: its limits against their entries, what it counts and pushes |
//! | `table` | the shared-memory table: layout, buckets, LRU, ids |
//! | `key` | key hashing, Redis key format, hash tags |
//! | `batch` | the coalescing batch a worker hands its Redis thread |
//! | `ring` | the queue in a zone's shared memory from every worker's thread to the node's sender, and the sender's lease |
//! | `sync` | when a counted request goes to Redis: at once near the limit, later far from it |
//! | `metrics` | the metrics page: Prometheus text and JSON |
//! | `params` | `redis_ratelimit_zone` parameters |
//! | `health` | backoff, idle checks, refresh budget, log gate |
//! | `stats` | a zone's figures in shared memory (atomics) |
//! | `slots` | Redis Cluster slot → master map |
//! | `strict` | strict mode: the script that decides in Redis, its arguments and answer |
//! | `calls` | a strict link's calls: one out per key, answers in order |
//! | `tickets` | the numbers that find a waiting strict request again |
//! | `text` | outside text made safe for one log line |
//! | `tls` | the `ssl_*=` parameters, a certificate's validity |
//! | `resp` | the Redis protocol for a strict link: commands, bounded reply parsing |
//! | `sha1` | SHA-1, the name Redis gives the strict script |

pub mod api;
pub mod batch;
pub mod bucket;
pub mod calls;
pub mod conn;
pub mod conn_fleet;
pub mod control;
pub mod cost;
pub mod counter;
pub mod decide;
pub mod health;
pub mod key;
pub mod metrics;
pub mod params;
pub mod problem;
pub mod rate;
pub mod resp;
pub mod ring;
pub mod sha1;
pub mod share;
pub mod slots;
pub mod stats;
pub mod strict;
pub mod sync;
pub mod table;
pub mod text;
pub mod tickets;
pub mod tls;
pub mod top;
pub mod window;
