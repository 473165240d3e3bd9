//! Configuration, the lowest layer of the glue but for the shared zone it
//! names: what the directives store, and how a location inherits from its
//! server and http levels (here); the directives' handlers and `[emerg]`
//! refusals (`directives.rs`); the module as the rest of the glue reaches
//! it, with its configurations (`module.rs`); the files a zone names,
//! read and checked (`zone_files.rs`).

pub mod directives;
pub mod module;
pub mod zone_files;

use nginx_sys::{
    ngx_conf_full_name, ngx_conf_t, ngx_cycle_t, ngx_flag_t, ngx_http_complex_value_t, ngx_int_t,
    ngx_str_t, ngx_uint_t, NGX_CONF_UNSET, NGX_LOG_ERR, NGX_OK,
};
use ngx::http::{Merge, MergeConfigError};
use ratelimit_core::bucket::Bucket;
use ratelimit_core::params::ZoneParams;
use ratelimit_core::rate::{Rate, RateCache};

use crate::shm::Shared;

/// One `redis_ratelimit_zone`. Boxed in `MainConf::zones` so that the shared
/// memory zone can point at it while the list grows.
pub struct ZoneConf {
    pub name: String,
    /// False while only `redis_ratelimit` lines have named it.
    pub declared: bool,
    /// Where it was first used, for the "unknown zone" error.
    pub used_at: String,
    /// The parsed parameters; the Redis backend reads them.
    pub params: Option<ZoneParams>,
    /// The key: one variable read by its index (`$binary_remote_addr`: a
    /// complex value would copy it into the pool on every request), or text
    /// with variables.
    pub key: Source,
    /// The key is `$binary_remote_addr`: the API writes and reads its keys
    /// as addresses in text.
    pub binary_addr: bool,
    /// The distinct fixed rates (and buckets) of the `redis_ratelimit`
    /// lines that use the zone: what the API shows of a key and resets.
    pub lines: Vec<(Rate, Option<Bucket>)>,
    /// The cycle being configured (its log is the one `error_log` set up
    /// by the time the zone's memory is initialised).
    pub cycle: *mut ngx_cycle_t,
    /// Set when nginx has mapped and initialised the shared memory.
    pub shared: Option<Shared>,
    /// Where a `strict` limit first used it (it then needs `redis=`).
    pub strict_at: Option<String>,
    /// Where a concurrency limit (`redis_ratelimit_conn`) first used it,
    /// and where one first gave it a `lease=`.
    pub conn_at: Option<String>,
    pub lease_at: Option<String>,
}

#[derive(Default)]
pub struct MainConf {
    /// Boxed: each shared memory zone keeps a pointer to its `ZoneConf`,
    /// which must not move when the list grows.
    #[allow(clippy::vec_box)]
    pub zones: Vec<Box<ZoneConf>>,
    /// Some limit has `count_if=`: the log phase handler is installed.
    pub count_if: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Limit {
    pub zone: usize,
    pub rate: RateSpec,
    /// `cost=`: what a request weighs under this limit.
    pub cost: Cost,
    /// `count_if=`: checked in preaccess, counted in the log phase when
    /// this value is neither empty nor `0`.
    pub count_if: Option<Source>,
    /// `strict`: the decision waits for Redis (`strict.rs`).
    pub strict: bool,
    /// `burst=`, `delay=`, `nodelay`: the line is limit_req's bucket, not
    /// a sliding window.
    pub bucket: Option<Bucket>,
    /// `block=`: a key this line rejects is blocked in the zone for this
    /// long (ms; 0: not).
    pub block_ms: u64,
    /// The last rate read from variables, by its text: a `map` gives the
    /// same few values again and again (read and written by the worker's
    /// own thread only).
    pub cache: RateCache,
}

/// One `redis_ratelimit_conn`: at most `max` requests of the zone's key in
/// flight.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnLimit {
    pub zone: usize,
    pub max: u32,
    /// How long a holder's lease of the key's slots lives in Redis
    /// unrenewed (a zone with `redis=`), ms.
    pub lease_ms: u32,
    /// `strict`: each slot is taken in Redis (no spare leased ahead).
    pub strict: bool,
}

/// A value given with variables, read per request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Source {
    /// One variable (`$plan_rate`): read by its index, no copy.
    Index(ngx_uint_t),
    /// Text with variables (`${n}r/m`): a complex value.
    Complex(*mut ngx_http_complex_value_t),
}

/// A limit's rate: written out (`10r/s`), or from variables (tiers from a
/// `map`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RateSpec {
    Fixed(Rate),
    Var(Source),
}

/// The most `strict` limits at one level (a request's wait tells them
/// apart by the low bits of its tickets: a power of two).
pub const MAX_STRICT: usize = 16;

pub use ratelimit_core::cost::{parse as parse_cost, MAX_COST};

/// `cost=N` or `cost=$variable` (evaluated per request).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Cost {
    Fixed(u32),
    Var(Source),
}

/// http, server and location level settings. The simple directives are
/// read by nginx's own slots (`ngx_conf_set_flag_slot`,
/// `ngx_conf_set_num_slot`) at these fields' offsets, so they have nginx's
/// types and "unset" values, and are merged as nginx merges them.
pub struct LocConf {
    /// `None`: not set here; `Some(empty)` after `redis_ratelimit off`.
    pub limits: Option<Vec<Limit>>,
    /// `redis_ratelimit_conn` lines (`None`: not set here; inherited).
    pub conns: Option<Vec<ConnLimit>>,
    pub off: bool,
    /// `redis_ratelimit_status` (400 to 599).
    pub status: ngx_int_t,
    /// `redis_ratelimit_dry_run` (1 on, 0 off).
    pub dry_run: ngx_flag_t,
    /// `redis_ratelimit_log_level`.
    pub log_level: ngx_uint_t,
    /// `redis_ratelimit_headers`: `HEADERS_OFF`, `_ON` or `_LEGACY`.
    pub headers: ngx_uint_t,
    /// `redis_ratelimit_problem` (1 on, 0 off).
    pub problem: ngx_flag_t,
    /// `redis_ratelimit_api` here: 0 (none), `API_READ` or `API_WRITE`
    /// (not inherited: the directive's location answers).
    pub api: u8,
}

/// `redis_ratelimit_api` (`write=off`): reads only.
pub const API_READ: u8 = 1;
/// `redis_ratelimit_api write=on`.
pub const API_WRITE: u8 = 2;

const UNSET: isize = NGX_CONF_UNSET as isize;
/// nginx's `NGX_CONF_UNSET_UINT` (a macro, not in the bindings).
pub const UNSET_UINT: ngx_uint_t = ngx_uint_t::MAX;

impl Default for LocConf {
    fn default() -> LocConf {
        LocConf {
            limits: None,
            conns: None,
            off: false,
            status: UNSET,
            dry_run: UNSET,
            log_level: UNSET_UINT,
            headers: UNSET_UINT,
            problem: UNSET,
            api: 0,
        }
    }
}

/// `redis_ratelimit_headers off`: no rate limit headers.
pub const HEADERS_OFF: ngx_uint_t = 0;
/// `on`: the IETF draft's `RateLimit-Policy` and `RateLimit`.
pub const HEADERS_ON: ngx_uint_t = 1;
/// `legacy`: `X-RateLimit-Limit`, `-Remaining`, `-Reset`.
pub const HEADERS_LEGACY: ngx_uint_t = 2;

/// nginx's `ngx_conf_merge_value`: unset here takes the outer level's
/// value, or the default.
fn merge<T: Copy + PartialEq>(v: &mut T, prev: T, unset: T, default: T) {
    if *v == unset {
        *v = if prev == unset { default } else { prev };
    }
}

impl Merge for LocConf {
    fn merge(&mut self, prev: &LocConf) -> Result<(), MergeConfigError> {
        if self.limits.is_none() {
            self.limits = prev.limits.clone();
        }
        if self.conns.is_none() {
            self.conns = prev.conns.clone();
        }
        merge(&mut self.status, prev.status, UNSET, 429);
        merge(&mut self.dry_run, prev.dry_run, UNSET, 0);
        merge(&mut self.log_level, prev.log_level, UNSET_UINT, NGX_LOG_ERR as ngx_uint_t);
        merge(&mut self.headers, prev.headers, UNSET_UINT, HEADERS_OFF);
        merge(&mut self.problem, prev.problem, UNSET, 0);
        Ok(())
    }
}

/// A file name as nginx reads one: relative to the configuration prefix
/// (`ngx_conf_full_name`). `None` when nginx could not make it.
///
/// # Safety
/// `cf` is the configuration being read.
pub unsafe fn full_name(cf: *mut ngx_conf_t, name: &[u8]) -> Option<Vec<u8>> {
    // SAFETY: copies the name into the configuration pool, where nginx
    // makes the full name; both are read back at once.
    unsafe {
        let mut s = ngx_str_t::from_bytes((*cf).pool, name)?;
        if ngx_conf_full_name((*cf).cycle, &mut s, 1) != NGX_OK as ngx_int_t {
            return None;
        }
        Some(s.as_bytes().to_vec())
    }
}
