//! `redis_ratelimit_api [write=on|off]`: a content handler answering JSON
//! about the zones and their keys, and (with `write=on`) blocking a key,
//! overriding its rate, lifting either, resetting its counts
//! (`ratelimit_core::api` reads the paths and bodies; `worker::controls`
//! makes the changes). nginx's own access control (`allow`, `deny`,
//! `auth_basic`) guards the location.

use std::ffi::{c_char, c_void};
use std::fmt::Write;

use nginx_sys::{
    ngx_chain_t, ngx_command_t, ngx_conf_t, ngx_http_discard_request_body,
    ngx_http_finalize_request, ngx_http_read_client_request_body, ngx_http_request_t, ngx_int_t,
    NGX_DONE, NGX_HTTP_DELETE, NGX_HTTP_GET, NGX_HTTP_HEAD, NGX_HTTP_INTERNAL_SERVER_ERROR,
    NGX_HTTP_PUT, NGX_HTTP_SPECIAL_RESPONSE, NGX_LOG_NOTICE, NGX_OK,
};
use ngx::core::{NGX_CONF_ERROR, NGX_CONF_OK};
use ngx::http::{HttpModuleLocationConf, HttpModuleMainConf, NgxHttpCoreModule, Request};
use ngx::ngx_log_error;
use ratelimit_core::api::{self, Part, Problem, Route};
use ratelimit_core::control::{key_form, Kind, Slot};
use ratelimit_core::rate::Rate;
use ratelimit_core::stats::Stats;
use ratelimit_core::text::{duration, json_string};
use ratelimit_core::{counter, problem};

use crate::conf::module::Module;
use crate::conf::{LocConf, MainConf, ZoneConf, API_READ, API_WRITE};
use crate::http::request_log;
use crate::http::respond::send;
use crate::shm::Shared;
use crate::worker::controls::{change, Asked};
use crate::worker::time::now_ms;

const JSON: &str = "application/json";

/// `redis_ratelimit_api [write=on|off];` in a location.
pub extern "C" fn cmd_api(
    cf: *mut ngx_conf_t,
    _cmd: *mut ngx_command_t,
    conf: *mut c_void,
) -> *mut c_char {
    // SAFETY: `conf` is this module's location configuration.
    let lcf = unsafe { &mut *conf.cast::<LocConf>() };
    // SAFETY: nginx calls directive handlers with the configuration being
    // read; its arguments are an array of `ngx_str_t`.
    let args = unsafe { crate::conf::directives::args(cf) };
    let write = match args.get(1).map(|a| a.as_bytes()) {
        None | Some(b"write=off") => false,
        Some(b"write=on") => true,
        Some(other) => {
            return crate::conf::directives::refuse(
                cf,
                "redis_ratelimit_api",
                format!(
                    "invalid parameter \"{}\": write=on or write=off expected",
                    String::from_utf8_lossy(other)
                ),
            )
        }
    };
    if lcf.api != 0 {
        return crate::conf::directives::refuse(cf, "redis_ratelimit_api", "is duplicate");
    }
    lcf.api = if write { API_WRITE } else { API_READ };
    // SAFETY: the core module's location configuration exists at this
    // level.
    let Some(clcf) = NgxHttpCoreModule::location_conf_mut(unsafe { &*cf }) else {
        return NGX_CONF_ERROR;
    };
    clcf.handler = Some(handler);
    NGX_CONF_OK
}

unsafe extern "C" fn handler(r: *mut ngx_http_request_t) -> ngx_int_t {
    // SAFETY: nginx calls content handlers with a valid request.
    let r = unsafe { &mut *r };
    if r.method & NGX_HTTP_PUT as usize != 0 {
        // SAFETY: the request is valid; `body_read` runs once the body is
        // in (at once, or from the event loop).
        let rc = unsafe { ngx_http_read_client_request_body(r, Some(body_read)) };
        if rc >= NGX_HTTP_SPECIAL_RESPONSE as ngx_int_t {
            return rc;
        }
        return NGX_DONE as ngx_int_t;
    }
    // SAFETY: the request is valid.
    let rc = unsafe { ngx_http_discard_request_body(r) };
    if rc != NGX_OK as ngx_int_t {
        return rc;
    }
    answer(r, &[])
}

/// The body of a `PUT` is in: answers, and finalizes the request.
unsafe extern "C" fn body_read(r: *mut ngx_http_request_t) {
    // SAFETY: nginx calls it with the request whose body it read.
    let r = unsafe { &mut *r };
    let rc = match body(r) {
        Ok(bytes) => answer(r, &bytes),
        Err(p) => problem(r, &p),
    };
    // SAFETY: the request is valid and this handler took it (`NGX_DONE`).
    unsafe { ngx_http_finalize_request(r, rc) };
}

/// The request's body, in memory (at most `api::MAX_BODY` bytes).
fn body(r: &ngx_http_request_t) -> Result<Vec<u8>, Problem> {
    let too_large =
        || Problem::new(413, None, format!("a body is at most {} bytes", api::MAX_BODY));
    let mut out = Vec::new();
    // SAFETY: after `ngx_http_read_client_request_body` the request's body
    // (if any) and its chain of buffers are valid.
    unsafe {
        let Some(rb) = r.request_body.as_ref() else {
            return Ok(out);
        };
        if !rb.temp_file.is_null() {
            return Err(too_large());
        }
        let mut cl: *mut ngx_chain_t = rb.bufs;
        while let Some(c) = cl.as_ref() {
            if let Some(b) = c.buf.as_ref() {
                if b.in_file() != 0 {
                    return Err(too_large());
                }
                let n = b.last.offset_from(b.pos).max(0) as usize;
                if out.len() + n > api::MAX_BODY {
                    return Err(too_large());
                }
                out.extend_from_slice(std::slice::from_raw_parts(b.pos, n));
            }
            cl = c.next;
        }
    }
    Ok(out)
}

fn problem(r: &mut ngx_http_request_t, p: &Problem) -> ngx_int_t {
    send(r, p.status, problem::MEDIA_TYPE, p.body().as_bytes())
}

/// Answers the request (`body`: a `PUT`'s).
fn answer(r: &mut ngx_http_request_t, body: &[u8]) -> ngx_int_t {
    // SAFETY: the request is valid; `Request` is a transparent wrapper.
    let req = unsafe { Request::from_ngx_http_request(r) };
    let (Some(mcf), Some(lcf), Some(clcf)) =
        (Module::main_conf(req), Module::location_conf(req), NgxHttpCoreModule::location_conf(req))
    else {
        return NGX_HTTP_INTERNAL_SERVER_ERROR as ngx_int_t;
    };
    // the path as the client wrote it (a key may hold an encoded `/`),
    // below the location's prefix
    let raw = r.unparsed_uri.as_bytes().to_vec();
    let raw = &raw[..raw.iter().position(|&b| b == b'?').unwrap_or(raw.len())];
    let Some(path) = raw.strip_prefix(clcf.name.as_bytes()) else {
        return problem(r, &Problem::new(404, None, "no such resource"));
    };
    match route(r, mcf, lcf, path, body) {
        Ok((status, json)) => send(r, status, JSON, json.as_bytes()),
        Err(p) => problem(r, &p),
    }
}

/// The answer to a method on a path: its status and JSON.
fn route(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    lcf: &LocConf,
    path: &[u8],
    body: &[u8],
) -> Result<(u16, String), Problem> {
    let route = api::route(path)?;
    let method = r.method;
    let reading = method & (NGX_HTTP_GET | NGX_HTTP_HEAD) as usize != 0;
    let writing = method & (NGX_HTTP_PUT | NGX_HTTP_DELETE) as usize != 0;
    if !reading && !writing {
        return Err(Problem::new(405, None, "the API answers GET, HEAD, PUT and DELETE"));
    }
    if writing && lcf.api != API_WRITE {
        return Err(Problem::new(
            405,
            None,
            "this location is read-only (redis_ratelimit_api write=on allows changes)",
        ));
    }
    let now = now_ms();
    match route {
        Route::Root if reading => Ok((200, "[\"zones\"]\n".into())),
        Route::Zones if reading => {
            let mut out = String::new();
            list(&mut out, "{}", &mcf.zones, |out, z| {
                let _ = write!(out, "{}:{}", json_string(&z.name), zone_json(z, now));
            });
            Ok((200, out + "\n"))
        }
        Route::Zone(name) if reading => {
            let (_, z) = zone(mcf, &name)?;
            Ok((200, zone_json(z, now) + "\n"))
        }
        Route::Top(name) if reading => {
            let (_, z) = zone(mcf, &name)?;
            let n = api::top_n(r.args.as_bytes())?;
            let busiest = shared(z)?.lock().top().busiest(n);
            let mut out = String::new();
            list(&mut out, "[]", busiest, |out, (key, share)| {
                let _ =
                    write!(out, "{{\"share\":{share:.3},\"state\":{}}}", key_json(z, &key, now));
            });
            Ok((200, out + "\n"))
        }
        Route::Key(name, given, part) => {
            let (index, z) = zone(mcf, &name)?;
            let key = api::key_bytes(given, z.binary_addr)?;
            if reading {
                return Ok((200, key_json(z, &key, now) + "\n"));
            }
            let put = method & NGX_HTTP_PUT as usize != 0;
            write(r, mcf, index, z, &key, part, put.then_some(body), now)
        }
        _ => Err(Problem::new(405, None, "this resource answers GET and HEAD")),
    }
}

/// A change through the API: made, logged at `notice`, answered.
#[allow(clippy::too_many_arguments)]
fn write(
    r: &mut ngx_http_request_t,
    mcf: &MainConf,
    index: usize,
    z: &ZoneConf,
    key: &[u8],
    part: Part,
    put: Option<&[u8]>,
    now: u64,
) -> Result<(u16, String), Problem> {
    let what = match (part, put) {
        (Part::Key, None) => {
            for &(rate, bucket) in &z.lines {
                crate::engine::reset(
                    mcf,
                    index,
                    z.name.as_bytes(),
                    key,
                    rate.period,
                    bucket.map(|_| rate.limit),
                );
            }
            log_change(r, z, key, "counts reset");
            return Ok((204, String::new()));
        }
        (Part::Key, Some(_)) => {
            return Err(Problem::new(405, None, "a key answers GET, HEAD and DELETE"));
        }
        (Part::Block, Some(b)) => {
            let b = api::body(b, false, None)?;
            Asked::Set(Kind::Block, b.ttl_ms.unwrap_or(0))
        }
        (Part::Override, Some(b)) => {
            let b = api::body(b, true, None)?;
            let rate = b.rate.ok_or_else(|| Problem::new(400, Some("rate"), "is required"))?;
            Asked::Set(Kind::Override(rate), b.ttl_ms.unwrap_or(0))
        }
        (Part::Block, None) => Asked::Lift(Kind::Block),
        (Part::Override, None) => Asked::Lift(Kind::ANY_OVERRIDE),
    };
    match change(mcf, index, key, what, now) {
        Err(_) => Err(Problem::new(
            507,
            None,
            "the zone holds no more blocked or overridden keys (a larger zone holds more)",
        )),
        Ok(false) => Err(Problem::new(404, None, "the key has no such control")),
        Ok(true) => {
            let said = match what {
                Asked::Set(Kind::Block, ttl) => format!("blocked for {}", duration(ttl)),
                Asked::Set(Kind::Override(rate), ttl) => {
                    format!("limited at {rate} for {}", duration(ttl))
                }
                Asked::Lift(Kind::Block) => "unblocked".into(),
                Asked::Lift(Kind::Override(_)) => "override lifted".into(),
            };
            log_change(r, z, key, &said);
            match what {
                Asked::Set(..) => Ok((200, key_json(z, key, now) + "\n")),
                Asked::Lift(_) => Ok((204, String::new())),
            }
        }
    }
}

/// The `notice` line of a change: zone, key, what changed (nginx adds
/// the caller's address, `client:`).
fn log_change(r: &ngx_http_request_t, z: &ZoneConf, key: &[u8], what: &str) {
    ngx_log_error!(
        NGX_LOG_NOTICE,
        request_log(r),
        "redis_ratelimit: zone \"{}\": key \"{}\" {} (API)",
        z.name,
        api::key_text(key, z.binary_addr).escape_debug(),
        what
    );
}

fn zone<'m>(mcf: &'m MainConf, name: &str) -> Result<(usize, &'m ZoneConf), Problem> {
    mcf.zones
        .iter()
        .enumerate()
        .find(|(_, z)| z.name == name)
        .map(|(i, z)| (i, &**z))
        .ok_or_else(|| Problem::new(404, Some("zone"), format!("no zone {}", json_string(name))))
}

fn shared(z: &ZoneConf) -> Result<&Shared, Problem> {
    z.shared.as_ref().ok_or_else(|| Problem::new(503, None, "the zone's memory is not ready"))
}

/// Seconds (to the millisecond) from `now` to `at`.
fn secs(now: u64, at: u64) -> f64 {
    at.saturating_sub(now) as f64 / 1000.0
}

/// Most keys of each kind a zone's page lists.
const LISTED: usize = 100;

/// A zone: its limits, its table's fill, its backend, its controls.
fn zone_json(z: &ZoneConf, now: u64) -> String {
    let Ok(shared) = shared(z) else {
        return "null".into();
    };
    let mut out = String::with_capacity(512);
    out.push_str("{\"limits\":");
    list(&mut out, "[]", &z.lines, |out, (r, b)| line_json(out, *r, b.map(|b| b.burst)));
    let st = shared.stats();
    let mut locked = shared.lock();
    let _ = write!(
        out,
        ",\"keys\":{},\"keys_capacity\":{},\"evictions\":{},",
        locked.table.len(),
        locked.table.capacity(),
        locked.table.evictions()
    );
    let redis = z.params.as_ref().filter(|p| p.backend.is_some());
    match redis {
        Some(_) => {
            let last = Stats::get(&st.last_sync_ms);
            let _ = write!(
                out,
                "\"redis\":{{\"up\":{},\"counts_synced_s_ago\":{},\"controls_synced_s_ago\":{}}},",
                Stats::get(&st.backend_up) == 1,
                ago(now, last),
                ago(
                    now,
                    locked.controls().header().synced_ms.load(std::sync::atomic::Ordering::Relaxed)
                )
            );
        }
        None => out.push_str("\"redis\":null,"),
    }
    let c = locked.controls();
    let blocked: Vec<&Slot> = c.iter().filter(|s| s.blocked(now).is_some()).collect();
    let overridden: Vec<&Slot> = c.iter().filter(|s| s.rate(now).is_some()).collect();
    let _ = write!(
        out,
        "\"blocked_keys\":{},\"overridden_keys\":{},\"controls_capacity\":{},\"blocked\":",
        blocked.len(),
        overridden.len(),
        ratelimit_core::control::capacity(c.header().slots)
    );
    let key = |s: &Slot| json_string(&api::key_text(s.key(), z.binary_addr));
    list(&mut out, "[]", blocked.iter().take(LISTED), |out, s| {
        let _ = write!(out, "{{\"key\":{},\"ttl_s\":{}}}", key(s), secs(now, s.block_until));
    });
    out.push_str(",\"overrides\":");
    list(&mut out, "[]", overridden.iter().take(LISTED), |out, s| {
        let rate = s.rate(now).map(|r| r.to_string()).unwrap_or_default();
        let _ = write!(
            out,
            "{{\"key\":{},\"rate\":\"{rate}\",\"ttl_s\":{}}}",
            key(s),
            secs(now, s.override_until)
        );
    });
    out.push('}');
    out
}

/// `items` written by `each` between the two brackets of `brackets`,
/// separated by commas.
fn list<T>(
    out: &mut String,
    brackets: &str,
    items: impl IntoIterator<Item = T>,
    mut each: impl FnMut(&mut String, T),
) {
    let (open, close) = brackets.split_at(1);
    out.push_str(open);
    for (i, item) in items.into_iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        each(out, item);
    }
    out.push_str(close);
}

fn ago(now: u64, at: u64) -> String {
    if at == 0 {
        "null".into()
    } else {
        format!("{}", now.saturating_sub(at) as f64 / 1000.0)
    }
}

fn line_json(out: &mut String, rate: Rate, burst: Option<u32>) {
    let _ = match burst {
        Some(b) => write!(out, "{{\"rate\":\"{rate}\",\"burst\":{b}}}"),
        None => write!(out, "{{\"rate\":\"{rate}\"}}"),
    };
}

/// A key as this node sees it: its controls, and each of its zone's
/// limits (written out in the configuration) against its counts.
fn key_json(z: &ZoneConf, key: &[u8], now: u64) -> String {
    let Ok(shared) = shared(z) else {
        return "null".into();
    };
    let part = key_form(key);
    let mut locked = shared.lock();
    let slot = locked.controls().get(shared.control_id(&part)).copied();
    let mut out = String::with_capacity(512);
    let _ = write!(out, "{{\"key\":{},", json_string(&api::key_text(key, z.binary_addr)));
    match slot.as_ref().and_then(|s| Some((s, s.blocked(now)?))) {
        Some((s, until)) => {
            let _ = write!(
                out,
                "\"blocked\":{{\"ttl_s\":{},\"pending\":{}}},",
                secs(now, until),
                s.block_pending()
            );
        }
        None => out.push_str("\"blocked\":null,"),
    }
    let rate = slot.as_ref().and_then(|s| s.rate(now));
    match (slot.as_ref(), rate) {
        (Some(s), Some(rate)) => {
            let _ = write!(
                out,
                "\"override\":{{\"rate\":\"{rate}\",\"ttl_s\":{},\"pending\":{}}},",
                secs(now, s.override_until),
                s.override_pending()
            );
        }
        _ => out.push_str("\"override\":null,"),
    }
    out.push_str("\"limits\":");
    list(&mut out, "[]", &z.lines, |out, &(line_rate, bucket)| {
        let applied = rate.unwrap_or(line_rate);
        let _ = write!(out, "{{\"rate\":\"{line_rate}\",\"applied\":\"{applied}\"");
        if let Some(b) = bucket {
            let _ = write!(out, ",\"burst\":{}", b.burst);
        } else {
            let id = shared.ids.id_in(shared.name, applied.period, key);
            let mut e = locked.table.find(id).map(|i| *locked.table.entry(i)).unwrap_or_default();
            counter::roll(&mut e, now, applied.period_ms());
            let est = counter::estimate(&e, applied, now);
            let breaker = e.blocked_until_ms > now;
            let _ = write!(
                out,
                ",\"estimate\":{:.3},\"remaining\":{},\"breaker_open_s\":{}",
                est.value(),
                est.remaining(applied.limit),
                if breaker { secs(now, e.blocked_until_ms) } else { 0.0 }
            );
        }
        out.push('}');
    });
    out.push('}');
    out
}
