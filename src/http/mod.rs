//! The HTTP phases, the top layer of the glue: the preaccess handler that
//! evaluates keys and asks the engine (`handler.rs`), the strict request's
//! wait for Redis (`strict.rs`), the log phase that counts `count_if=`
//! limits (`count.rs`), concurrency limits' slots (`conn.rs`), how a
//! decided request is answered (`answer.rs`),
//! the `$redis_ratelimit_*` variables (`vars.rs`), what a request's
//! variables give a limit (`values.rs`) and the metrics page
//! (`metrics.rs`).

use nginx_sys::{
    ngx_http_request_t, ngx_int_t, ngx_log_t, NGX_HTTP_INTERNAL_SERVER_ERROR, NGX_LOG_ERR,
};
use ngx::ngx_log_error;

pub mod answer;
pub mod api;
pub mod conn;
pub mod count;
pub mod delay;
pub mod handler;
pub mod metrics;
pub mod problem;
pub mod respond;
pub mod strict;
pub mod values;
pub mod vars;

/// Why a request could not be limited: the preaccess handler logs it and
/// answers 500 (`handler::preaccess`, the one place that turns it into a
/// status), as nginx does when a request's pool or variables fail.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// nginx gave no memory (the request's pool, a cleanup, a header).
    NoMemory,
    /// A variable of the zone's key, the rate or the cost could not be
    /// evaluated.
    Variable,
    /// The zone is not in this configuration's shared memory.
    NoZone,
    /// The request could not be made to wait (its read event).
    Event,
    /// The decision names a limit the request does not have.
    NoLimit,
}

impl From<crate::engine::NoZone> for Failure {
    fn from(_: crate::engine::NoZone) -> Failure {
        Failure::NoZone
    }
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Failure::NoMemory => "out of memory",
            Failure::Variable => "a variable could not be evaluated",
            Failure::NoZone => "the zone has no shared memory",
            Failure::Event => "the request could not wait for Redis",
            Failure::NoLimit => "the decision names no limit of the request",
        })
    }
}

/// A request that could not be limited: said in the error log, answered
/// 500.
#[cold]
#[inline(never)]
pub fn failed(r: &ngx_http_request_t, why: Failure) -> ngx_int_t {
    ngx_log_error!(
        NGX_LOG_ERR,
        request_log(r),
        "redis_ratelimit: the request could not be limited: {}",
        why
    );
    NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t
}

/// The request's log (its connection's).
pub fn request_log(r: &ngx_http_request_t) -> *mut ngx_log_t {
    // SAFETY: a request being processed has its connection.
    unsafe { (*r.connection).log }
}
