//! A rejection answered with problem details (`redis_ratelimit_problem
//! on`, RFC 9457): the status, `application/problem+json` and a body of
//! type `quota-exceeded` naming the policies the request broke
//! (`ratelimit_core::problem`). The module sends it and finalizes the
//! request itself, so nginx's own page for the status (and `error_page`)
//! does not apply; a subrequest's rejection stays a status.

use nginx_sys::{
    ngx_http_discard_request_body, ngx_http_finalize_request, ngx_http_request_t, ngx_int_t,
    NGX_DONE, NGX_OK,
};
use ratelimit_core::problem;

use crate::conf::LocConf;
use crate::http::Failure;

/// The answer to a rejected request: its status, or with
/// `redis_ratelimit_problem on` the problem details sent (`NGX_DONE`: the
/// request is finalized, the caller touches it no more).
pub fn reject(
    r: &mut ngx_http_request_t,
    lcf: &LocConf,
    policies: impl FnOnce() -> Vec<String>,
) -> Result<ngx_int_t, Failure> {
    if lcf.problem != 1 || !std::ptr::eq(r, r.main) {
        return Ok(lcf.status);
    }
    let status = u16::try_from(lcf.status).unwrap_or(429);
    let body = problem::body(status, &policies());
    // SAFETY: the request is valid; what follows is what a content
    // handler does with it (the metrics page's), then the request is
    // finalized with the output's result, once.
    unsafe {
        let rc = ngx_http_discard_request_body(r);
        if rc != NGX_OK as ngx_int_t {
            return Ok(rc);
        }
        let rc = crate::http::respond::send(r, status, problem::MEDIA_TYPE, body.as_bytes());
        ngx_http_finalize_request(r, rc);
    }
    Ok(NGX_DONE as ngx_int_t)
}
