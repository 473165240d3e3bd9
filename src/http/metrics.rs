//! `redis_ratelimit_metrics`: a content handler, like `stub_status`, that
//! answers with every zone's figures (`ratelimit_core::metrics`): the
//! Prometheus text format, or JSON with `?format=json`. The figures live in
//! each zone's shared memory, so any worker answers the same.

use std::ffi::{c_char, c_void};

use nginx_sys::{
    ngx_command_t, ngx_conf_t, ngx_http_discard_request_body, ngx_http_request_t, ngx_int_t,
    NGX_HTTP_GET, NGX_HTTP_HEAD, NGX_HTTP_INTERNAL_SERVER_ERROR, NGX_HTTP_NOT_ALLOWED, NGX_HTTP_OK,
    NGX_OK,
};
use ngx::core::{NGX_CONF_ERROR, NGX_CONF_OK};
use ngx::http::{HttpModuleLocationConf, HttpModuleMainConf, NgxHttpCoreModule, Request};
use ratelimit_core::metrics::{self, Zone};
use ratelimit_core::params::OnError;
use ratelimit_core::stats::Stats;

use crate::conf::module::Module;
use crate::conf::MainConf;
use crate::worker::time::now_ms;

/// `redis_ratelimit_metrics;` in a location: its content handler.
pub extern "C" fn cmd_metrics(
    cf: *mut ngx_conf_t,
    _cmd: *mut ngx_command_t,
    _conf: *mut c_void,
) -> *mut c_char {
    // SAFETY: nginx calls directive handlers with the configuration being
    // read; the core module's location configuration exists at this level.
    let Some(clcf) = NgxHttpCoreModule::location_conf_mut(unsafe { &*cf }) else {
        return NGX_CONF_ERROR;
    };
    clcf.handler = Some(handler);
    NGX_CONF_OK
}

/// Every zone's figures, read from its shared memory at `now_ms`.
fn collect(mcf: &MainConf, now_ms: u64) -> Vec<Zone> {
    let mut out = Vec::with_capacity(mcf.zones.len());
    for z in &mcf.zones {
        let Some(shared) = z.shared.as_ref() else {
            continue;
        };
        let now = now_ms;
        let (keys, capacity, evictions, blocked_keys, overridden_keys) = {
            let mut locked = shared.lock();
            let (len, capacity) = (locked.table.len(), locked.table.capacity());
            let evictions = locked.table.evictions();
            let c = locked.controls();
            (
                len,
                capacity,
                evictions,
                c.iter().filter(|s| s.blocked(now).is_some()).count() as u64,
                c.iter().filter(|s| s.rate(now).is_some()).count() as u64,
            )
        };
        let st = shared.stats();
        let get = Stats::get;
        let redis = z.params.as_ref().filter(|p| p.backend.is_some()).map(|p| {
            let last = get(&st.last_sync_ms);
            let (waiting, waiting_since) = st.waiting.sum(crate::backend::process_alive);
            metrics::Redis {
                up: get(&st.backend_up) == 1,
                on_error: match p.on_error {
                    OnError::Local => "local",
                    OnError::Allow => "allow",
                    OnError::Deny => "deny",
                    OnError::Share => "share",
                },
                commands: get(&st.commands),
                pipelines: get(&st.pipelines),
                errors_transport: get(&st.errors_transport),
                errors_reply: get(&st.errors_reply),
                connects: get(&st.connects),
                waiting,
                // how long counts have waited without a flush going
                // through: 0 when none waits (an idle zone is in sync)
                sync_age_s: Some(if waiting == 0 {
                    0.0
                } else {
                    now_ms.saturating_sub(last.max(waiting_since)) as f64 / 1000.0
                }),
                rtt_buckets: st.rtt_buckets.iter().map(get).collect(),
                rtt_sum_us: get(&st.rtt_sum_us),
                strict_waits: get(&st.strict_waits),
                strict_timeouts: get(&st.strict_timeouts),
                nodes: get(&st.fleet_nodes),
                sender: shared.ring().map_or(0, |r| r.holder()),
            }
        });
        out.push(Zone {
            name: z.name.clone(),
            passed: get(&st.passed),
            rejected: get(&st.rejected),
            rejected_dry_run: get(&st.rejected_dry_run),
            not_limited: get(&st.not_limited),
            delayed: get(&st.delayed),
            conn_in_flight: get(&st.conn_in_flight),
            conn_rejected: get(&st.conn_rejected),
            conn_rejected_dry_run: get(&st.conn_rejected_dry_run),
            conn_leased: get(&st.conn_leased),
            conn_expired: get(&st.conn_expired),
            blocks: get(&st.blocks),
            blocked_keys,
            overridden_keys,
            keys: keys as u64,
            capacity: capacity as u64,
            evictions,
            breaker_trips: get(&st.breaker_trips),
            dropped: get(&st.dropped),
            redis,
        });
    }
    out
}

unsafe extern "C" fn handler(r: *mut ngx_http_request_t) -> ngx_int_t {
    // SAFETY: nginx calls content handlers with a valid request.
    let r = unsafe { &mut *r };
    if r.method & (NGX_HTTP_GET | NGX_HTTP_HEAD) as usize == 0 {
        return NGX_HTTP_NOT_ALLOWED as ngx_int_t;
    }
    // SAFETY: the request is valid.
    let rc = unsafe { ngx_http_discard_request_body(r) };
    if rc != NGX_OK as ngx_int_t {
        return rc;
    }
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let Some(mcf) = Module::main_conf(req) else {
        return NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t;
    };
    let zones = collect(mcf, now_ms());
    let json = metrics::wants_json(r.args.as_bytes());
    let (body, ctype) = if json {
        (metrics::json(&zones), "application/json")
    } else {
        (metrics::prometheus(&zones), "text/plain; version=0.0.4; charset=utf-8")
    };
    crate::http::respond::send(r, NGX_HTTP_OK as u16, ctype, body.as_bytes())
}
