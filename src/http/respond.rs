//! A content handler's answer: a status, a media type and a body, sent
//! (the metrics page, the API, a rejection's problem details).

use nginx_sys::{
    ngx_chain_t, ngx_create_temp_buf, ngx_http_output_filter, ngx_http_request_t,
    ngx_http_send_header, ngx_int_t, ngx_str_t, NGX_ERROR, NGX_HTTP_INTERNAL_SERVER_ERROR, NGX_OK,
};

/// Sends the headers and `body`; what nginx's output returned.
pub fn send(
    r: &mut ngx_http_request_t,
    status: u16,
    ctype: &'static str,
    body: &[u8],
) -> ngx_int_t {
    let ctype = ctype.as_bytes();
    r.headers_out.status = usize::from(status);
    r.headers_out.content_length_n = body.len() as i64;
    r.headers_out.content_type_len = ctype.len();
    r.headers_out.content_type = ngx_str_t { len: ctype.len(), data: ctype.as_ptr().cast_mut() };
    r.headers_out.content_type_lowcase = std::ptr::null_mut();
    // SAFETY: the request is valid and its headers are set.
    let rc = unsafe { ngx_http_send_header(r) };
    if rc == NGX_ERROR as ngx_int_t || rc > NGX_OK as ngx_int_t || r.header_only() != 0 {
        return rc;
    }
    // SAFETY: a buffer from the request's pool, as large as the body.
    let b = unsafe { ngx_create_temp_buf(r.pool, body.len().max(1)) };
    // SAFETY: `ngx_create_temp_buf` returns null or a valid buffer.
    let Some(buf) = (unsafe { b.as_mut() }) else {
        return NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t;
    };
    // SAFETY: the buffer holds at least `body.len()` bytes from `last`.
    unsafe {
        std::ptr::copy_nonoverlapping(body.as_ptr(), buf.last, body.len());
        buf.last = buf.last.add(body.len());
    }
    buf.set_last_buf(u32::from(std::ptr::eq(r, r.main)));
    buf.set_last_in_chain(1);
    let mut out = ngx_chain_t { buf: b, next: std::ptr::null_mut() };
    // SAFETY: the chain and its buffer live in this frame and the request's
    // pool; nginx copies what it keeps.
    unsafe { ngx_http_output_filter(r, &mut out) }
}
