//! One `cmd_*` handler per directive, and the check that every zone used
//! was declared. Every refusal is an `[emerg]` line that names the directive
//! and the bad value (`nginx -t` fails on it).

use std::ffi::{c_char, c_void};
use std::fmt::Display;
use std::ptr;

use nginx_sys::{
    ngx_command_t, ngx_conf_t, ngx_http_compile_complex_value, ngx_http_compile_complex_value_t,
    ngx_http_complex_value_t, ngx_http_get_variable_index, ngx_int_t, ngx_pagesize, ngx_parse_size,
    ngx_parse_time, ngx_shared_memory_add, ngx_shm_zone_t, ngx_str_t, ngx_uint_t, NGX_LOG_EMERG,
    NGX_LOG_ERR, NGX_LOG_INFO, NGX_LOG_NOTICE, NGX_LOG_WARN, NGX_OK,
};
use ngx::core::{Pool, NGX_CONF_ERROR, NGX_CONF_OK};
use ngx::http::HttpModuleMainConf;
use ngx::ngx_conf_log_error;
use ratelimit_core::bucket::{self, Bucket, Delay, MAX_BUCKET_LIMIT, MAX_BURST};
use ratelimit_core::control;
use ratelimit_core::params;
use ratelimit_core::rate::Rate;

use crate::conf::module::Module;
use ratelimit_core::conn::{LEASE_MS, MAX_CONN, MAX_LEASE_MS, MIN_LEASE_MS};

use crate::conf::{
    parse_cost, ConnLimit, Cost, Limit, LocConf, MainConf, RateSpec, Source, ZoneConf,
    HEADERS_LEGACY, HEADERS_OFF, HEADERS_ON, MAX_COST, MAX_STRICT, UNSET_UINT,
};
use crate::shm;

/// The directive's arguments (the directive name first).
///
/// # Safety
/// `cf` must be the configuration being parsed, as nginx passes it to a
/// directive handler.
pub(crate) unsafe fn args<'a>(cf: *mut ngx_conf_t) -> &'a [ngx_str_t] {
    // SAFETY: nginx fills `cf->args` with at least the directive name before
    // calling a handler; the array lives in the configuration pool.
    unsafe { (*(*cf).args).as_slice() }
}

pub(crate) fn refuse(cf: *mut ngx_conf_t, directive: &str, msg: impl Display) -> *mut c_char {
    ngx_conf_log_error!(NGX_LOG_EMERG, cf, "{directive}: {msg}");
    NGX_CONF_ERROR
}

fn show(s: &ngx_str_t) -> String {
    String::from_utf8_lossy(s.as_bytes()).into_owned()
}

/// "file:line" of the directive being parsed.
fn position(cf: *mut ngx_conf_t) -> String {
    // SAFETY: `cf` is valid during parsing; `conf_file` is set while a file
    // is read (it is null only for `-g` directives).
    unsafe {
        let file = (*cf).conf_file;
        if file.is_null() {
            return "command line".to_string();
        }
        format!("{}:{}", show(&(*file).file.name), (*file).line)
    }
}

fn main_conf(cf: *mut ngx_conf_t) -> Option<&'static mut MainConf> {
    // SAFETY: called from directive handlers inside the http block, where the
    // module's main configuration exists.
    Module::main_conf_mut(unsafe { &*cf })
}

/// Where a value with variables will be read from per request: one
/// variable (`$name`) by its index, other text as a complex value. `None`
/// after nginx logged why.
fn source(cf: *mut ngx_conf_t, text: ngx_str_t) -> Option<Source> {
    let name = text
        .as_bytes()
        .strip_prefix(b"$")
        .filter(|n| !n.is_empty() && n.iter().all(|b| b.is_ascii_alphanumeric() || *b == b'_'));
    let Some(name) = name else {
        return compile(cf, text).map(Source::Complex);
    };
    let mut name = ngx_str_t { len: name.len(), data: name.as_ptr().cast_mut() };
    // SAFETY: `cf` is valid while the directive is read; nginx copies the
    // name.
    let index = unsafe { ngx_http_get_variable_index(cf, &mut name) };
    ngx_uint_t::try_from(index).ok().map(Source::Index)
}

/// Bytes of a directive's argument as nginx's string (they live in the
/// configuration pool).
fn bytes_str(v: &[u8]) -> ngx_str_t {
    ngx_str_t { len: v.len(), data: v.as_ptr().cast_mut() }
}

/// Compiles text with variables (`$binary_remote_addr`, `$arg_cost`) into
/// a complex value in the configuration pool; `None` after nginx logged why.
fn compile(cf: *mut ngx_conf_t, mut src: ngx_str_t) -> Option<*mut ngx_http_complex_value_t> {
    // SAFETY: `cf->pool` is the configuration pool, alive as long as the cycle.
    let pool = unsafe { Pool::from_ngx_pool((*cf).pool) };
    let cv = pool.calloc_type::<ngx_http_complex_value_t>();
    if cv.is_null() {
        return None;
    }
    // SAFETY: a zeroed compile context is how nginx modules start one; the
    // pointers set below outlive the call.
    let mut ccv: ngx_http_compile_complex_value_t = unsafe { std::mem::zeroed() };
    ccv.cf = cf;
    ccv.value = &mut src;
    ccv.complex_value = cv;
    // SAFETY: `ccv` is fully set up as nginx expects.
    if unsafe { ngx_http_compile_complex_value(&mut ccv) } != NGX_OK as isize {
        return None;
    }
    Some(cv)
}

/// Sizes and times as nginx reads them everywhere.
const NGINX_UNITS: params::Units = params::Units { size: parse_size, time_ms: parse_time_ms };

fn parse_size(s: &[u8]) -> Option<usize> {
    let mut v = ngx_str_t { len: s.len(), data: s.as_ptr().cast_mut() };
    // SAFETY: ngx_parse_size reads `len` bytes of `data` and writes nothing.
    let n = unsafe { ngx_parse_size(&mut v) };
    usize::try_from(n).ok()
}

fn parse_time_ms(s: &[u8]) -> Option<u64> {
    let mut v = ngx_str_t { len: s.len(), data: s.as_ptr().cast_mut() };
    // SAFETY: ngx_parse_time reads `len` bytes of `data` and writes nothing;
    // 0: the result is in milliseconds.
    let n = unsafe { ngx_parse_time(&mut v, 0) };
    u64::try_from(n).ok()
}

/// `redis_ratelimit_zone key zone=name:size [redis=URL,...] [cluster] ...`
pub extern "C" fn cmd_zone(
    cf: *mut ngx_conf_t,
    _cmd: *mut ngx_command_t,
    conf: *mut c_void,
) -> *mut c_char {
    const D: &str = "redis_ratelimit_zone";
    // SAFETY: `conf` is this module's main configuration (NGX_HTTP_MAIN_CONF_OFFSET).
    let mcf = unsafe { &mut *conf.cast::<MainConf>() };
    // SAFETY: see `args`.
    let args = unsafe { args(cf) };
    let rest: Vec<&[u8]> = args[2..].iter().map(|a| a.as_bytes()).collect();
    // SAFETY: ngx_pagesize is set by nginx before any configuration is read.
    let min_size = 8 * unsafe { ngx_pagesize };
    let mut params = match params::parse_zone_params(&rest, min_size, NGINX_UNITS) {
        Ok(p) => p,
        Err(e) => return refuse(cf, D, e),
    };
    // SAFETY: `cf` is the configuration being read.
    match unsafe { crate::conf::zone_files::load(cf, &mut params) } {
        Ok(()) => {}
        Err(Some(e)) => return refuse(cf, D, e),
        Err(None) => return NGX_CONF_ERROR,
    }
    let existing = mcf.zones.iter().position(|z| z.name == params.name);
    if let Some(i) = existing {
        if mcf.zones[i].declared {
            return refuse(cf, D, format!("zone \"{}\" is already declared", params.name));
        }
    }

    let Some(key) = source(cf, args[1]) else {
        return NGX_CONF_ERROR;
    };

    // SAFETY: copies the name into the configuration pool, which outlives
    // the shared memory zone's use of it.
    let Some(mut shm_name) = (unsafe { ngx_str_t::from_bytes((*cf).pool, params.name.as_bytes()) })
    else {
        return NGX_CONF_ERROR;
    };
    // SAFETY: `cf` is valid; the tag is this module's static, unique to it.
    let shm_zone = unsafe {
        ngx_shared_memory_add(
            cf,
            &mut shm_name,
            params.size,
            ptr::addr_of_mut!(crate::conf::module::ngx_http_redis_ratelimit_module).cast(),
        )
    };
    if shm_zone.is_null() {
        return NGX_CONF_ERROR;
    }
    // SAFETY: just returned by nginx, non-null.
    let shm = unsafe { &mut *shm_zone };
    if !shm.data.is_null() {
        return refuse(cf, D, format!("zone \"{}\" is already declared", params.name));
    }

    // a limit that named the zone before its declaration may be strict
    let strict_at = existing.and_then(|i| mcf.zones[i].strict_at.take());
    let conn_at = existing.and_then(|i| mcf.zones[i].conn_at.take());
    let lease_at = existing.and_then(|i| mcf.zones[i].lease_at.take());
    let zone = Box::new(ZoneConf {
        name: params.name.clone(),
        declared: true,
        used_at: String::new(),
        params: Some(params),
        key,
        binary_addr: args[1].as_bytes() == b"$binary_remote_addr",
        lines: existing.map(|i| std::mem::take(&mut mcf.zones[i].lines)).unwrap_or_default(),
        // SAFETY: `cf` is valid while the directive is read.
        cycle: unsafe { (*cf).cycle },
        shared: None,
        strict_at,
        conn_at,
        lease_at,
    });
    let slot = match existing {
        Some(i) => {
            mcf.zones[i] = zone;
            i
        }
        None => {
            mcf.zones.push(zone);
            mcf.zones.len() - 1
        }
    };
    shm.init = Some(zone_init);
    shm.data = ptr::from_mut::<ZoneConf>(&mut mcf.zones[slot]).cast();
    NGX_CONF_OK
}

/// `redis_ratelimit zone rate|$var [cost=N|$var]` or `redis_ratelimit off`
pub extern "C" fn cmd_limit(
    cf: *mut ngx_conf_t,
    _cmd: *mut ngx_command_t,
    conf: *mut c_void,
) -> *mut c_char {
    // SAFETY: `conf` is this module's configuration at the current level.
    let lcf = unsafe { &mut *conf.cast::<LocConf>() };
    // SAFETY: see `args`.
    let args = unsafe { args(cf) };
    answer(cf, "redis_ratelimit", limit_line(cf, lcf, args))
}

/// `redis_ratelimit_conn zone number [strict] [lease=time]`.
pub extern "C" fn cmd_conn(
    cf: *mut ngx_conf_t,
    _cmd: *mut ngx_command_t,
    conf: *mut c_void,
) -> *mut c_char {
    // SAFETY: `conf` is this module's configuration at the current level.
    let lcf = unsafe { &mut *conf.cast::<LocConf>() };
    // SAFETY: see `args`.
    let args = unsafe { args(cf) };
    answer(cf, "redis_ratelimit_conn", conn_line(cf, lcf, args))
}

/// A `redis_ratelimit_conn` line: its zone, its number (1 to `MAX_CONN`),
/// `strict` and `lease=` (a zone with Redis: each slot taken in Redis;
/// how long a holder's lease of the key's slots lives unrenewed,
/// `MIN_LEASE_MS` to `MAX_LEASE_MS`).
fn conn_line(cf: *mut ngx_conf_t, lcf: &mut LocConf, args: &[ngx_str_t]) -> Parsed<()> {
    let n = show(&args[2]);
    let max = std::str::from_utf8(args[2].as_bytes())
        .ok()
        .filter(|s| s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse::<u32>().ok())
        .filter(|m| (1..=MAX_CONN).contains(m))
        .ok_or_else(|| format!("invalid number \"{n}\": 1 to {MAX_CONN} requests expected"))?;
    let (mut lease_ms, mut strict) = (None, false);
    for a in &args[3..] {
        match a.as_bytes() {
            b"strict" if !strict => strict = true,
            [b'l', b'e', b'a', b's', b'e', b'=', v @ ..] if lease_ms.is_none() => {
                let ms = parse_time_ms(v)
                    .filter(|ms| (MIN_LEASE_MS..=MAX_LEASE_MS).contains(ms))
                    .ok_or_else(|| {
                    format!(
                        "invalid \"{}\": a time of {}s to {}s expected",
                        show(a),
                        MIN_LEASE_MS / 1000,
                        MAX_LEASE_MS / 1000
                    )
                })?;
                lease_ms = Some(ms as u32);
            }
            _ => return Err(format!("invalid parameter \"{}\"", show(a)).into()),
        }
    }
    let mcf = main_conf(cf).ok_or(Refusal::Said)?;
    let zone = zone_used(cf, mcf, show(&args[1]));
    if mcf.zones[zone].conn_at.is_none() {
        mcf.zones[zone].conn_at = Some(position(cf));
    }
    if lease_ms.is_some() && mcf.zones[zone].lease_at.is_none() {
        mcf.zones[zone].lease_at = Some(position(cf));
    }
    if strict && mcf.zones[zone].strict_at.is_none() {
        mcf.zones[zone].strict_at = Some(position(cf));
    }
    let conns = lcf.conns.get_or_insert_with(Vec::new);
    if conns.iter().any(|c| c.zone == zone) {
        return Err(format!("zone \"{}\" is limited twice at one level", show(&args[1])).into());
    }
    conns.push(ConnLimit { zone, max, lease_ms: lease_ms.unwrap_or(LEASE_MS), strict });
    Ok(())
}

/// Why a directive is refused: a message for the `[emerg]` line that names
/// the directive, or nothing more to say (nginx said why: a variable it
/// could not compile). `answer` turns it into nginx's answer, once.
enum Refusal {
    Say(String),
    Said,
}

/// What reading a directive's arguments gives, or why it is refused.
type Parsed<T> = Result<T, Refusal>;

impl From<String> for Refusal {
    fn from(message: String) -> Refusal {
        Refusal::Say(message)
    }
}

impl From<&str> for Refusal {
    fn from(message: &str) -> Refusal {
        Refusal::Say(message.to_string())
    }
}

/// A directive handler's answer to nginx.
fn answer(cf: *mut ngx_conf_t, directive: &str, r: Parsed<()>) -> *mut c_char {
    match r {
        Ok(()) => NGX_CONF_OK,
        Err(Refusal::Say(message)) => refuse(cf, directive, message),
        Err(Refusal::Said) => NGX_CONF_ERROR,
    }
}

/// `source`, with nginx's own refusal.
fn source_of(cf: *mut ngx_conf_t, text: ngx_str_t) -> Parsed<Source> {
    source(cf, text).ok_or(Refusal::Said)
}

/// The parameters of a `redis_ratelimit` line after its zone and rate.
#[derive(Default)]
struct LineParams {
    cost: Option<Cost>,
    count_if: Option<Source>,
    strict: bool,
    burst: Option<u32>,
    delay: Option<Delay>,
    block_ms: Option<u64>,
}

impl LineParams {
    /// The line's bucket, if any of `burst=`, `delay=`, `nodelay` is given
    /// (`burst` 0 and `delay` 0 unless given, as `limit_req` reads them).
    fn bucket(&self) -> Parsed<Option<Bucket>> {
        if self.burst.is_none() && self.delay.is_none() {
            return Ok(None);
        }
        let b =
            Bucket { burst: self.burst.unwrap_or(0), delay: self.delay.unwrap_or(Delay::Above(0)) };
        if let Delay::Above(d) = b.delay {
            if d > b.burst {
                return Err(format!(
                    "delay={d} above burst={}: a request over the burst is rejected, never delayed",
                    b.burst
                )
                .into());
            }
        }
        if self.count_if.is_some() {
            return Err("a bucket (burst=, delay=, nodelay) counts in preaccess: \"count_if=\" cannot be one".into());
        }
        Ok(Some(b))
    }
}

/// `burst=N` or `delay=N`: 0 to `MAX_BURST` requests.
fn requests(a: &ngx_str_t, v: &[u8]) -> Parsed<u32> {
    // the digits as `cost=` reads them (its maximum is at least this one)
    const _: () = assert!(MAX_BURST <= MAX_COST);
    parse_cost(v).filter(|&n| n <= MAX_BURST).ok_or_else(|| {
        format!("invalid value \"{}\": 0 to {MAX_BURST} requests expected", show(a)).into()
    })
}

/// `redis_ratelimit zone rate [params]` or `redis_ratelimit off`: the
/// limit added to this level's list.
fn limit_line(cf: *mut ngx_conf_t, lcf: &mut LocConf, args: &[ngx_str_t]) -> Parsed<()> {
    if args.len() == 2 {
        return limits_off(lcf, &args[1]);
    }
    if lcf.off {
        return Err("\"off\" cannot be combined with limits at the same level".into());
    }
    let rate = rate_spec(cf, args[2])?;
    let p = line_params(cf, &args[3..])?;
    let bucket = p.bucket()?;
    if let (Some(_), RateSpec::Fixed(r)) = (bucket, rate) {
        if bucket::id_period(r).is_none() {
            return Err(format!(
                "a bucket's rate is at most {MAX_BUCKET_LIMIT} requests per period"
            )
            .into());
        }
    }
    let mcf = main_conf(cf).ok_or(Refusal::Said)?;
    let zone = zone_used(cf, mcf, show(&args[1]));
    mcf.count_if |= p.count_if.is_some();
    if p.strict && mcf.zones[zone].strict_at.is_none() {
        mcf.zones[zone].strict_at = Some(position(cf));
    }
    if let RateSpec::Fixed(r) = rate {
        let lines = &mut mcf.zones[zone].lines;
        if !lines.contains(&(r, bucket)) {
            lines.push((r, bucket));
        }
    }
    let limits = lcf.limits.get_or_insert_with(Vec::new);
    if p.strict && limits.iter().filter(|l| l.strict).count() >= MAX_STRICT {
        return Err(format!("more than {MAX_STRICT} strict limits at one level").into());
    }
    let same = |l: &Limit| l.bucket.is_some() == bucket.is_some();
    if limits
        .iter()
        .any(|l| l.zone == zone && l.rate == rate && matches!(rate, RateSpec::Fixed(_)) && same(l))
    {
        return Err(format!("duplicate limit \"{} {}\"", show(&args[1]), show(&args[2])).into());
    }
    limits.push(Limit {
        zone,
        rate,
        cost: p.cost.unwrap_or(Cost::Fixed(1)),
        count_if: p.count_if,
        strict: p.strict,
        bucket,
        block_ms: p.block_ms.unwrap_or(0),
        cache: Default::default(),
    });
    Ok(())
}

/// `redis_ratelimit off`: no limits at this level, none inherited.
fn limits_off(lcf: &mut LocConf, arg: &ngx_str_t) -> Parsed<()> {
    if arg.as_bytes() != b"off" {
        return Err(format!(
            "\"{}\" needs a rate (zone rate, e.g. {} 10r/s) or is \"off\"",
            show(arg),
            show(arg)
        )
        .into());
    }
    if lcf.limits.as_ref().is_some_and(|l| !l.is_empty()) {
        return Err("\"off\" cannot be combined with limits at the same level".into());
    }
    lcf.off = true;
    lcf.limits = Some(Vec::new());
    Ok(())
}

/// A line's rate: fixed, or text with variables read per request.
fn rate_spec(cf: *mut ngx_conf_t, arg: ngx_str_t) -> Parsed<RateSpec> {
    if arg.as_bytes().contains(&b'$') {
        return Ok(RateSpec::Var(source_of(cf, arg)?));
    }
    Rate::parse(arg.as_bytes())
        .map(RateSpec::Fixed)
        .map_err(|e| format!("invalid rate \"{}\": {e}", show(&arg)).into())
}

/// `cost=`, `count_if=` and `strict`, each at most once.
fn line_params(cf: *mut ngx_conf_t, args: &[ngx_str_t]) -> Parsed<LineParams> {
    let mut p = LineParams::default();
    for a in args {
        let bytes = a.as_bytes();
        if bytes == b"strict" {
            if p.strict {
                return Err("duplicate parameter \"strict\"".into());
            }
            p.strict = true;
        } else if let Some(v) = bytes.strip_prefix(b"cost=") {
            if p.cost.is_some() {
                return Err("duplicate parameter \"cost=\"".into());
            }
            p.cost = Some(if v.first() == Some(&b'$') {
                Cost::Var(source_of(cf, bytes_str(v))?)
            } else {
                let c = parse_cost(v).ok_or_else(|| {
                    format!("invalid cost \"{}\": 0 to {MAX_COST} or a variable expected", show(a))
                })?;
                Cost::Fixed(c)
            });
        } else if let Some(v) = bytes.strip_prefix(b"burst=") {
            if p.burst.is_some() {
                return Err("duplicate parameter \"burst=\"".into());
            }
            p.burst = Some(requests(a, v)?);
        } else if bytes == b"nodelay" || bytes.starts_with(b"delay=") {
            if p.delay.is_some() {
                return Err("\"nodelay\" and \"delay=\" given twice, or both".into());
            }
            p.delay = Some(match bytes.strip_prefix(b"delay=") {
                Some(v) => Delay::Above(requests(a, v)?),
                None => Delay::Never,
            });
        } else if let Some(v) = bytes.strip_prefix(b"block=") {
            if p.block_ms.is_some() {
                return Err("duplicate parameter \"block=\"".into());
            }
            let max_days = control::MAX_TTL_MS / 86_400_000;
            p.block_ms = Some(
                parse_time_ms(v)
                    .filter(|ms| (1000..=control::MAX_TTL_MS).contains(ms))
                    .ok_or_else(|| {
                        format!("invalid block \"{}\": a time from 1s to {max_days}d expected (30s, 15m)", show(a))
                    })?,
            );
        } else if let Some(v) = bytes.strip_prefix(b"count_if=") {
            if p.count_if.is_some() {
                return Err("duplicate parameter \"count_if=\"".into());
            }
            if !v.contains(&b'$') {
                return Err(format!(
                    "invalid parameter \"{}\": count_if needs a variable \
                     (count_if=$failed: counted when neither empty nor \"0\")",
                    show(a)
                )
                .into());
            }
            p.count_if = Some(source_of(cf, bytes_str(v))?);
        } else {
            return Err(format!("invalid parameter \"{}\"", show(a)).into());
        }
    }
    Ok(p)
}

/// The zone a line names, by index: declared already, or declared later in
/// the http block (`init_main_conf` checks that it is).
fn zone_used(cf: *mut ngx_conf_t, mcf: &mut MainConf, name: String) -> usize {
    if let Some(i) = mcf.zones.iter().position(|z| z.name == name) {
        return i;
    }
    mcf.zones.push(Box::new(ZoneConf {
        name,
        declared: false,
        used_at: position(cf),
        params: None,
        key: Source::Complex(ptr::null_mut()),
        binary_addr: false,
        lines: Vec::new(),
        cycle: ptr::null_mut(),
        shared: None,
        strict_at: None,
        conn_at: None,
        lease_at: None,
    }));
    mcf.zones.len() - 1
}

/// Checks, once the http block is read, that every zone used was declared.
pub unsafe extern "C" fn init_main_conf(cf: *mut ngx_conf_t, conf: *mut c_void) -> *mut c_char {
    // SAFETY: `conf` is this module's main configuration.
    let mcf = unsafe { &*conf.cast::<MainConf>() };
    for z in &mcf.zones {
        if !z.declared {
            return refuse(
                cf,
                "redis_ratelimit",
                format!(
                    "unknown zone \"{}\" (used at {}): declare it with redis_ratelimit_zone",
                    z.name, z.used_at
                ),
            );
        }
        let redis = z.params.as_ref().is_some_and(|p| p.backend.is_some());
        if let Some(at) = z.lease_at.as_ref().filter(|_| !redis) {
            return refuse(
                cf,
                "redis_ratelimit_conn",
                format!(
                    "\"lease=\" needs a zone with Redis: zone \"{}\" (used at {}) has no \"redis=\" (its slots are this node's alone)",
                    z.name, at
                ),
            );
        }
        if let Some(at) = z.strict_at.as_ref().filter(|_| !redis) {
            return refuse(
                cf,
                "redis_ratelimit",
                format!(
                    "\"strict\" needs a zone with Redis: zone \"{}\" (used at {}) has no \"redis=\"",
                    z.name, at
                ),
            );
        }
    }
    NGX_CONF_OK
}

/// `redis_ratelimit_status code`: read by `ngx_conf_set_num_slot`; this
/// post handler keeps it to 400..599 with an error that names the
/// directive (nginx's stock bounds check does not).
pub unsafe extern "C" fn check_status(
    cf: *mut ngx_conf_t,
    _post: *mut c_void,
    data: *mut c_void,
) -> *mut c_char {
    // SAFETY: nginx passes the number the slot just stored.
    let code = unsafe { *data.cast::<ngx_int_t>() };
    if (400..=599).contains(&code) {
        return NGX_CONF_OK;
    }
    refuse(cf, "redis_ratelimit_status", format!("invalid status \"{code}\": 400 to 599 expected"))
}

/// A directive whose one argument is one word of `choices`, stored once
/// per level. Not nginx's enum slot: its error ("invalid value") does not
/// name the directive.
fn one_of(
    cf: *mut ngx_conf_t,
    directive: &str,
    what: &str,
    slot: &mut ngx_uint_t,
    choices: &[(&str, ngx_uint_t)],
) -> *mut c_char {
    // SAFETY: see `args`.
    let args = unsafe { args(cf) };
    if *slot != UNSET_UINT {
        return refuse(cf, directive, "is duplicate");
    }
    if let Some(&(_, v)) = choices.iter().find(|(w, _)| w.as_bytes() == args[1].as_bytes()) {
        *slot = v;
        return NGX_CONF_OK;
    }
    let words: Vec<&str> = choices.iter().map(|(w, _)| *w).collect();
    let expected = match words.split_last() {
        Some((last, [])) => last.to_string(),
        Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
        None => String::new(),
    };
    refuse(cf, directive, format!("invalid {what} \"{}\": {expected} expected", show(&args[1])))
}

/// `redis_ratelimit_log_level info|notice|warn|error`
pub extern "C" fn cmd_log_level(
    cf: *mut ngx_conf_t,
    _cmd: *mut ngx_command_t,
    conf: *mut c_void,
) -> *mut c_char {
    // SAFETY: `conf` is this module's configuration at the current level.
    let lcf = unsafe { &mut *conf.cast::<LocConf>() };
    let levels = [
        ("info", NGX_LOG_INFO as ngx_uint_t),
        ("notice", NGX_LOG_NOTICE as ngx_uint_t),
        ("warn", NGX_LOG_WARN as ngx_uint_t),
        ("error", NGX_LOG_ERR as ngx_uint_t),
    ];
    one_of(cf, "redis_ratelimit_log_level", "level", &mut lcf.log_level, &levels)
}

/// `redis_ratelimit_headers on|off|legacy`
pub extern "C" fn cmd_headers(
    cf: *mut ngx_conf_t,
    _cmd: *mut ngx_command_t,
    conf: *mut c_void,
) -> *mut c_char {
    // SAFETY: `conf` is this module's configuration at the current level.
    let lcf = unsafe { &mut *conf.cast::<LocConf>() };
    let modes = [("on", HEADERS_ON), ("off", HEADERS_OFF), ("legacy", HEADERS_LEGACY)];
    one_of(cf, "redis_ratelimit_headers", "value", &mut lcf.headers, &modes)
}

/// nginx's `init` callback for a zone's shared memory: maps the counter
/// table (fresh, or kept from before a reload) and hands it to the zone's
/// configuration.
unsafe extern "C" fn zone_init(shm_zone: *mut ngx_shm_zone_t, data: *mut c_void) -> ngx_int_t {
    // SAFETY: nginx passes the zone set up in `cmd_zone`, whose `data` points
    // at our boxed `ZoneConf`.
    let zone = unsafe { &mut *(*shm_zone).data.cast::<ZoneConf>() };
    // SAFETY: the cycle that declared the zone is the one being set up; its
    // log is in place before shared memory is initialised.
    let log = unsafe { zone.cycle.as_ref() }.map_or(unsafe { (*shm_zone).shm.log }, |c| c.log);
    // SAFETY: nginx passes the zone it created and, on a reload, the data
    // the old cycle's zone had.
    let ring = zone.params.as_ref().is_some_and(|p| p.backend.is_some());
    // SAFETY: as above.
    match unsafe { shm::attach(shm_zone, data, &zone.name, ring, log) } {
        Some(shared) => {
            zone.shared = Some(shared);
            NGX_OK as ngx_int_t
        }
        None => nginx_sys::NGX_ERROR as ngx_int_t,
    }
}
