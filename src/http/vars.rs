//! `$redis_ratelimit_status`, `$redis_ratelimit_remaining` and
//! `$redis_ratelimit_conn_status`.

use nginx_sys::{
    ngx_conf_t, ngx_http_add_variable, ngx_http_request_t, ngx_http_variable_value_t, ngx_int_t,
    ngx_pnalloc, ngx_str_t, ngx_uint_t, NGX_ERROR, NGX_HTTP_VAR_NOCACHEABLE, NGX_OK,
};

use crate::http::answer::state;

const STATUS: usize = 0;
const REMAINING: usize = 1;
const CONN_STATUS: usize = 2;

/// Registers the variables (preconfiguration).
pub unsafe extern "C" fn add(cf: *mut ngx_conf_t) -> ngx_int_t {
    for (name, which) in [
        (&b"redis_ratelimit_status"[..], STATUS),
        (b"redis_ratelimit_remaining", REMAINING),
        (b"redis_ratelimit_conn_status", CONN_STATUS),
    ] {
        let mut n = ngx_str_t { len: name.len(), data: name.as_ptr().cast_mut() };
        // SAFETY: `cf` is valid during preconfiguration; nginx copies the name.
        let v =
            unsafe { ngx_http_add_variable(cf, &mut n, NGX_HTTP_VAR_NOCACHEABLE as ngx_uint_t) };
        if v.is_null() {
            return NGX_ERROR as ngx_int_t;
        }
        // SAFETY: `v` was just returned by nginx.
        unsafe {
            (*v).get_handler = Some(get);
            (*v).data = which;
        }
    }
    NGX_OK as ngx_int_t
}

fn set(v: &mut ngx_http_variable_value_t, data: *mut u8, len: usize) {
    v.set_len(len as u32);
    v.set_valid(1);
    v.set_no_cacheable(0);
    v.set_not_found(0);
    v.data = data;
}

unsafe extern "C" fn get(
    r: *mut ngx_http_request_t,
    v: *mut ngx_http_variable_value_t,
    data: usize,
) -> ngx_int_t {
    // SAFETY: nginx calls variable handlers with a valid request and value.
    let (r, v) = unsafe { (&mut *r, &mut *v) };
    if data == CONN_STATUS {
        // as `$limit_conn_status`: not found where no concurrency limit applied
        match crate::http::conn::held(r) {
            Some(h) => {
                let s = h.outcome.as_str();
                set(v, s.as_ptr().cast_mut(), s.len());
            }
            None => {
                set(v, std::ptr::null_mut(), 0);
                v.set_not_found(1);
            }
        }
        return NGX_OK as ngx_int_t;
    }
    let Some(st) = state(r) else {
        // No limit applied to this request: the status is not found (`-`
        // in a log, as `$limit_req_status`), the remaining count empty.
        set(v, std::ptr::null_mut(), 0);
        if data == STATUS {
            v.set_not_found(1);
        }
        return NGX_OK as ngx_int_t;
    };
    match data {
        STATUS => {
            let s = st.outcome.as_str();
            set(v, s.as_ptr().cast_mut(), s.len());
        }
        _ => {
            let text = st.remaining().to_string();
            // SAFETY: allocates from the request pool, which outlives the value.
            let p = unsafe { ngx_pnalloc(r.pool, text.len()) }.cast::<u8>();
            if p.is_null() {
                return NGX_ERROR as ngx_int_t;
            }
            // SAFETY: `p` has room for `text`.
            unsafe { std::ptr::copy_nonoverlapping(text.as_ptr(), p, text.len()) };
            set(v, p, text.len());
        }
    }
    NGX_OK as ngx_int_t
}
