//! ngx_http_redis_ratelimit_module: one global request rate across many
//! nginx nodes.
//!
//! This file is the front door nginx sees: the module static, its context
//! and directive table. The layers below it, and what each folder holds:
//! `docs/development.md`, "Layout".

mod backend;
mod conf;
mod engine;
mod http;
mod lua;
mod shm;
mod worker;

use std::mem::offset_of;
use std::ptr;

use nginx_sys::{
    ngx_array_push, ngx_command_t, ngx_conf_post_t, ngx_conf_set_flag_slot, ngx_conf_set_num_slot,
    ngx_conf_t, ngx_http_handler_pt, ngx_http_module_t, ngx_http_phases_NGX_HTTP_LOG_PHASE,
    ngx_http_phases_NGX_HTTP_PREACCESS_PHASE, ngx_int_t, ngx_module_t, ngx_str_t, ngx_uint_t,
    NGX_CONF_1MORE, NGX_CONF_2MORE, NGX_CONF_FLAG, NGX_CONF_NOARGS, NGX_CONF_TAKE1, NGX_CONF_TAKE2,
    NGX_CONF_TAKE3, NGX_CONF_TAKE4, NGX_ERROR, NGX_HTTP_LOC_CONF, NGX_HTTP_LOC_CONF_OFFSET,
    NGX_HTTP_MAIN_CONF, NGX_HTTP_MAIN_CONF_OFFSET, NGX_HTTP_MODULE, NGX_HTTP_SRV_CONF, NGX_OK,
};
use ngx::http::{HttpModule, HttpModuleMainConf, NgxHttpCoreModule};

use crate::conf::directives;
use crate::conf::module::Module;
use crate::conf::LocConf;

/// Adds the module's variables.
unsafe extern "C" fn preconfiguration(cf: *mut ngx_conf_t) -> ngx_int_t {
    // SAFETY: nginx passes a valid configuration.
    unsafe { crate::http::vars::add(cf) }
}

/// Installs the preaccess handler (and the log phase's, for `count_if=`).
unsafe extern "C" fn postconfiguration(cf: *mut ngx_conf_t) -> ngx_int_t {
    // SAFETY: nginx passes a valid configuration.
    let cf = unsafe { &mut *cf };
    let Some(cmcf) = NgxHttpCoreModule::main_conf_mut(cf) else {
        return NGX_ERROR as ngx_int_t;
    };
    let phase = ngx_http_phases_NGX_HTTP_PREACCESS_PHASE as usize;
    // SAFETY: the phase handler array is an nginx array of handler
    // pointers, owned by the core module's main configuration.
    let h =
        unsafe { ngx_array_push(&mut cmcf.phases[phase].handlers) }.cast::<ngx_http_handler_pt>();
    if h.is_null() {
        return NGX_ERROR as ngx_int_t;
    }
    // SAFETY: `h` points at the new slot.
    unsafe { *h = Some(crate::http::handler::preaccess) };

    // `count_if=` limits are counted once the response is known
    if Module::main_conf(cf).is_some_and(|m| m.count_if) {
        let phase = ngx_http_phases_NGX_HTTP_LOG_PHASE as usize;
        // SAFETY: as above.
        let h = unsafe { ngx_array_push(&mut cmcf.phases[phase].handlers) }
            .cast::<ngx_http_handler_pt>();
        if h.is_null() {
            return NGX_ERROR as ngx_int_t;
        }
        // SAFETY: `h` points at the new slot.
        unsafe { *h = Some(crate::http::count::log_phase) };
    }
    NGX_OK as ngx_int_t
}

/// nginx compares directive names with `strcmp`: they need a NUL.
const fn name(s: &'static std::ffi::CStr) -> ngx_str_t {
    ngx_str_t { len: s.count_bytes(), data: s.as_ptr().cast_mut().cast() }
}

const ANY_LEVEL: u32 = NGX_HTTP_MAIN_CONF | NGX_HTTP_SRV_CONF | NGX_HTTP_LOC_CONF;

type SetFn = unsafe extern "C" fn(
    *mut ngx_conf_t,
    *mut ngx_command_t,
    *mut std::ffi::c_void,
) -> *mut std::ffi::c_char;

/// A directive read by one of our handlers.
const fn command(n: &'static std::ffi::CStr, type_: u32, set: SetFn, conf: usize) -> ngx_command_t {
    slot(n, type_, set, conf, 0, ptr::null_mut())
}

/// A directive read by one of nginx's stock slots into the field at
/// `offset` of the configuration, with an optional post handler.
const fn slot(
    n: &'static std::ffi::CStr,
    type_: u32,
    set: SetFn,
    conf: usize,
    offset: usize,
    post: *mut std::ffi::c_void,
) -> ngx_command_t {
    ngx_command_t { name: name(n), type_: type_ as ngx_uint_t, set: Some(set), conf, offset, post }
}

/// `redis_ratelimit_status`'s range check, after nginx read the number.
static STATUS_POST: ngx_conf_post_t =
    ngx_conf_post_t { post_handler: Some(directives::check_status) };

static mut COMMANDS: [ngx_command_t; 11] = [
    command(
        c"redis_ratelimit_zone",
        NGX_HTTP_MAIN_CONF | NGX_CONF_2MORE,
        directives::cmd_zone,
        NGX_HTTP_MAIN_CONF_OFFSET,
    ),
    command(
        c"redis_ratelimit",
        ANY_LEVEL | NGX_CONF_1MORE,
        directives::cmd_limit,
        NGX_HTTP_LOC_CONF_OFFSET,
    ),
    command(
        c"redis_ratelimit_conn",
        ANY_LEVEL | NGX_CONF_TAKE2 | NGX_CONF_TAKE3 | NGX_CONF_TAKE4,
        directives::cmd_conn,
        NGX_HTTP_LOC_CONF_OFFSET,
    ),
    slot(
        c"redis_ratelimit_status",
        ANY_LEVEL | NGX_CONF_TAKE1,
        ngx_conf_set_num_slot,
        NGX_HTTP_LOC_CONF_OFFSET,
        offset_of!(LocConf, status),
        ptr::addr_of!(STATUS_POST).cast_mut().cast(),
    ),
    slot(
        c"redis_ratelimit_dry_run",
        ANY_LEVEL | NGX_CONF_FLAG,
        ngx_conf_set_flag_slot,
        NGX_HTTP_LOC_CONF_OFFSET,
        offset_of!(LocConf, dry_run),
        ptr::null_mut(),
    ),
    slot(
        c"redis_ratelimit_problem",
        ANY_LEVEL | NGX_CONF_FLAG,
        ngx_conf_set_flag_slot,
        NGX_HTTP_LOC_CONF_OFFSET,
        offset_of!(LocConf, problem),
        ptr::null_mut(),
    ),
    command(
        c"redis_ratelimit_log_level",
        ANY_LEVEL | NGX_CONF_TAKE1,
        directives::cmd_log_level,
        NGX_HTTP_LOC_CONF_OFFSET,
    ),
    command(
        c"redis_ratelimit_headers",
        ANY_LEVEL | NGX_CONF_TAKE1,
        directives::cmd_headers,
        NGX_HTTP_LOC_CONF_OFFSET,
    ),
    command(
        c"redis_ratelimit_api",
        NGX_HTTP_LOC_CONF | NGX_CONF_NOARGS | NGX_CONF_TAKE1,
        crate::http::api::cmd_api,
        NGX_HTTP_LOC_CONF_OFFSET,
    ),
    command(
        c"redis_ratelimit_metrics",
        NGX_HTTP_LOC_CONF | NGX_CONF_NOARGS,
        crate::http::metrics::cmd_metrics,
        NGX_HTTP_LOC_CONF_OFFSET,
    ),
    ngx_command_t::empty(),
];

static MODULE_CTX: ngx_http_module_t = ngx_http_module_t {
    preconfiguration: Some(preconfiguration),
    postconfiguration: Some(postconfiguration),
    create_main_conf: Some(Module::create_main_conf),
    init_main_conf: Some(directives::init_main_conf),
    create_srv_conf: None,
    merge_srv_conf: None,
    create_loc_conf: Some(Module::create_loc_conf),
    merge_loc_conf: Some(Module::merge_loc_conf),
};

// The list of modules a loadable module exports. Built by cargo alone (the
// Makefile), the library must carry it; built through nginx's `config`, nginx
// generates it, and `--no-default-features` leaves this one out.
#[cfg(feature = "export-modules")]
ngx::ngx_modules!(ngx_http_redis_ratelimit_module);

/// The module. Exported under its C name: the rest of the glue reaches it
/// through the declaration in `conf/module.rs`, as an nginx module in C
/// declares it `extern` in its header.
#[used]
#[no_mangle]
#[allow(non_upper_case_globals)]
pub static mut ngx_http_redis_ratelimit_module: ngx_module_t = ngx_module_t {
    ctx: ptr::addr_of!(MODULE_CTX).cast_mut().cast(),
    // SAFETY: the command table is a static that lives forever.
    commands: unsafe { ptr::addr_of_mut!(COMMANDS[0]) },
    type_: NGX_HTTP_MODULE as ngx_uint_t,
    init_process: Some(crate::worker::process::init_process),
    exit_process: Some(crate::worker::process::exit_process),
    ..ngx_module_t::default()
};
