//! Passes the nginx build facts that `nginx-sys` detected to the compiler as
//! `cfg` values, and records where the nginx build tree is so that `make build`
//! can pick up the matching `nginx` binary.

use std::env;

fn main() {
    println!("cargo::rerun-if-env-changed=DEP_NGINX_FEATURES_CHECK");
    println!(
        "cargo::rustc-check-cfg=cfg(ngx_feature, values({}))",
        env::var("DEP_NGINX_FEATURES_CHECK").unwrap_or_else(|_| "any()".to_string())
    );
    println!("cargo::rerun-if-env-changed=DEP_NGINX_FEATURES");
    if let Ok(features) = env::var("DEP_NGINX_FEATURES") {
        for feature in features.split(',').map(str::trim) {
            println!("cargo::rustc-cfg=ngx_feature=\"{feature}\"");
        }
    }

    println!("cargo::rerun-if-env-changed=DEP_NGINX_OS_CHECK");
    println!(
        "cargo::rustc-check-cfg=cfg(ngx_os, values({}))",
        env::var("DEP_NGINX_OS_CHECK").unwrap_or_else(|_| "any()".to_string())
    );
    println!("cargo::rerun-if-env-changed=DEP_NGINX_OS");
    if let Ok(os) = env::var("DEP_NGINX_OS") {
        println!("cargo::rustc-cfg=ngx_os=\"{os}\"");
    }

    // The Makefile reads this file to find the nginx binary built with the
    // module (vendored build) or to report which tree the module targets.
    println!("cargo::rerun-if-env-changed=DEP_NGINX_BUILD_DIR");
    if let (Ok(build_dir), Ok(out_dir)) = (env::var("DEP_NGINX_BUILD_DIR"), env::var("OUT_DIR")) {
        let marker = std::path::Path::new(&out_dir).join("nginx-build-dir");
        if let Err(e) = std::fs::write(&marker, &build_dir) {
            println!("cargo::warning=cannot write {}: {e}", marker.display());
        }
    }
}
