//! The module as the rest of the glue knows it: the `ngx_module_t`
//! (defined with its tables in `lib.rs`, declared here as an nginx module
//! in C declares it `extern` in its header) and typed access to this
//! module's configurations.

use std::ptr;

use nginx_sys::ngx_module_t;
use ngx::http::{HttpModule, HttpModuleLocationConf, HttpModuleMainConf};

use crate::conf::{LocConf, MainConf};

unsafe extern "C" {
    /// Defined in `lib.rs` (`#[no_mangle]`).
    pub static mut ngx_http_redis_ratelimit_module: ngx_module_t;
}

pub struct Module;

impl HttpModule for Module {
    fn module() -> &'static ngx_module_t {
        // SAFETY: the module static is only written by nginx while it
        // loads the module, before any of our code runs.
        unsafe { &*ptr::addr_of!(ngx_http_redis_ratelimit_module) }
    }
}

// SAFETY: the main configuration is created by `create_main_conf` (the
// trait's, used in `lib.rs`'s module context) as a `MainConf`.
unsafe impl HttpModuleMainConf for Module {
    type MainConf = MainConf;
}

// SAFETY: location (and http/server) configurations are created by
// `create_loc_conf` (the trait's, used in `lib.rs`) as `LocConf`.
unsafe impl HttpModuleLocationConf for Module {
    type LocationConf = LocConf;
}
