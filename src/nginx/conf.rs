//! Configuration: what the directives store (see `directives.rs` for how
//! they are read), and how a location inherits from its server and http
//! levels.

use nginx_sys::{ngx_cycle_t, ngx_http_complex_value_t, ngx_uint_t, NGX_LOG_ERR};
use ngx::http::{Merge, MergeConfigError};
use ratelimit_core::params::ZoneParams;
use ratelimit_core::rate::Rate;

use super::zone::Shared;

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
    pub key: *mut ngx_http_complex_value_t,
    /// The cycle being configured (its log is the one `error_log` set up
    /// by the time the zone's memory is initialised).
    pub cycle: *mut ngx_cycle_t,
    /// Set when nginx has mapped and initialised the shared memory.
    pub shared: Option<Shared>,
}

#[derive(Default)]
pub struct MainConf {
    /// Boxed: each shared memory zone keeps a pointer to its `ZoneConf`,
    /// which must not move when the list grows.
    #[allow(clippy::vec_box)]
    pub zones: Vec<Box<ZoneConf>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limit {
    pub zone: usize,
    pub rate: Rate,
}

/// http, server and location level settings; `None` means "not set here".
#[derive(Default)]
pub struct LocConf {
    /// `Some(empty)` after `redis_ratelimit off`.
    pub limits: Option<Vec<Limit>>,
    pub off: bool,
    pub status: Option<u16>,
    pub dry_run: Option<bool>,
    pub log_level: Option<ngx_uint_t>,
    pub headers: Option<bool>,
}

pub const DEFAULT_STATUS: u16 = 429;
pub const DEFAULT_LOG_LEVEL: ngx_uint_t = NGX_LOG_ERR as ngx_uint_t;

impl Merge for LocConf {
    fn merge(&mut self, prev: &LocConf) -> Result<(), MergeConfigError> {
        if self.limits.is_none() {
            self.limits = prev.limits.clone();
        }
        self.status = self.status.or(prev.status);
        self.dry_run = self.dry_run.or(prev.dry_run);
        self.log_level = self.log_level.or(prev.log_level);
        self.headers = self.headers.or(prev.headers);
        Ok(())
    }
}
