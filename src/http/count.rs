//! The log phase handler: counts the `count_if=` limits of a request that
//! passed, once its response is known. The preaccess handler only checked
//! them (a request is still rejected once the key has reached its limit)
//! and kept each one's key and rate in the request's state; here each
//! `count_if` value is read (`$status`, `$upstream_http_*` are known now),
//! and when it is neither empty nor `0` the request is counted under the
//! key and rate that were checked, with its cost evaluated now, through the
//! same engine. The key is not read again: after an internal redirect
//! (`error_page`, a named location, `try_files`) the URI, the arguments
//! and variables built from them may differ, and a key that changed (or
//! became empty) would let failures go uncounted. The count of a limit
//! Redis decides (`strict`, a small limit) goes down the worker's strict
//! link, where the worker's next check of the key follows it.

use nginx_sys::{ngx_http_request_t, ngx_int_t, NGX_OK};
use ngx::http::{HttpModuleMainConf, Request};
use smallvec::SmallVec;

use crate::conf::module::Module;
use crate::engine::{self, Ask, Strict, Take};
use crate::http::answer::{ask, debug_log, state};
use crate::http::handler::cost;
use crate::http::values::read;
use crate::worker::time::now_ms;

pub unsafe extern "C" fn log_phase(r: *mut ngx_http_request_t) -> ngx_int_t {
    // SAFETY: nginx calls log handlers with a valid request.
    let r = unsafe { &mut *r };
    // a subrequest logged with `log_subrequest on` is not the request that
    // was decided
    if !std::ptr::eq(r.main, r) {
        return NGX_OK as ngx_int_t;
    }
    let Some(deferred) = state(r).map(|s| s.deferred).filter(|d| !d.is_null()) else {
        return NGX_OK as ngx_int_t;
    };
    // SAFETY: written by `defer` in the main request's pool; the location's
    // configuration belongs to the cycle the request runs in, which lives
    // until the request is freed.
    let (deferred, lcf) = unsafe { (&*deferred, &*(*deferred).lcf) };
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let Some(mcf) = Module::main_conf(req) else {
        return NGX_OK as ngx_int_t;
    };
    let Some(limits) = lcf.limits.as_deref() else {
        return NGX_OK as ngx_int_t;
    };
    let mut asks: SmallVec<[Ask<'_>; 4]> = SmallVec::new();
    for d in deferred.counts() {
        let Some(l) = limits.get(d.line as usize) else {
            continue;
        };
        let Some(src) = l.count_if else {
            continue;
        };
        match read(r, src) {
            Ok(v) if !v.is_empty() && v != b"0" => {}
            _ => continue,
        }
        let Ok(cost) = cost(r, mcf, l) else {
            continue;
        };
        let mut a = ask(mcf, l, d.line, d.key(), d.rate, cost);
        if crate::http::handler::in_redis(mcf, l, d.rate) {
            // the next strict decision must see it
            a.strict = Strict::CountOnly;
        }
        asks.push(a);
    }
    if !asks.is_empty() {
        // counted whatever the estimate says now: the request was let
        // through, so it happened
        let now = now_ms();
        let _ = engine::decide(mcf, &asks, now, Take::Always, debug_log(r));
    }
    NGX_OK as ngx_int_t
}
