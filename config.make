# Sourced by nginx's auto/make after `config`: the rule that builds the
# Rust static library with cargo (always run; cargo knows what changed),
# and the dependency of the module on it.

cat << END                                                   >> $NGX_MAKEFILE

# ngx_http_redis_ratelimit_module: the Rust code, by cargo
.PHONY: $ngx_rl_lib

$ngx_rl_lib:
	cd "$ngx_rl_repo" && NGINX_SOURCE_DIR="$ngx_rl_src" NGINX_BUILD_DIR="$ngx_rl_objs" \\
	$ngx_rl_cargo rustc --release --lib --crate-type staticlib \\
		--manifest-path "$ngx_rl_repo/Cargo.toml" \\
		--no-default-features --target-dir "$ngx_rl_target"

END

if [ "$ngx_rl_link" = DYNAMIC ]; then
    cat << END                                               >> $NGX_MAKEFILE
$NGX_OBJS${ngx_dirsep}ngx_http_redis_ratelimit_module$ngx_modext: $ngx_rl_lib

END
fi
