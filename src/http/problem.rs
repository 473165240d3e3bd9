//! A rejection answered with problem details (`redis_ratelimit_problem
//! on`, RFC 9457): the status, `application/problem+json` and a body of
//! type `quota-exceeded` naming the policies the request broke
//! (`ratelimit_core::problem`). The module sends it and finalizes the
//! request itself, so nginx's own page for the status (and `error_page`)
//! does not apply; a subrequest's rejection stays a status.

use nginx_sys::{
    ngx_chain_t, ngx_create_temp_buf, ngx_http_discard_request_body, ngx_http_finalize_request,
    ngx_http_output_filter, ngx_http_request_t, ngx_http_send_header, ngx_int_t, ngx_str_t,
    NGX_DONE, NGX_ERROR, NGX_OK,
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
        let ctype = problem::MEDIA_TYPE.as_bytes();
        r.headers_out.status = status.into();
        r.headers_out.content_length_n = body.len() as i64;
        r.headers_out.content_type_len = ctype.len();
        r.headers_out.content_type =
            ngx_str_t { len: ctype.len(), data: ctype.as_ptr().cast_mut() };
        r.headers_out.content_type_lowcase = std::ptr::null_mut();
        let mut rc = ngx_http_send_header(r);
        if !(rc == NGX_ERROR as ngx_int_t || rc > NGX_OK as ngx_int_t || r.header_only() != 0) {
            let b = ngx_create_temp_buf(r.pool, body.len());
            let Some(buf) = b.as_mut() else {
                return Err(Failure::NoMemory);
            };
            std::ptr::copy_nonoverlapping(body.as_ptr(), buf.last, body.len());
            buf.last = buf.last.add(body.len());
            buf.set_last_buf(1);
            buf.set_last_in_chain(1);
            let mut out = ngx_chain_t { buf: b, next: std::ptr::null_mut() };
            rc = ngx_http_output_filter(r, &mut out);
        }
        ngx_http_finalize_request(r, rc);
    }
    Ok(NGX_DONE as ngx_int_t)
}
