"""The Debian package that `make deb` builds (build/deb/): laid out as
Debian's own libnginx-mod-http-* packages, and, installed on this machine
with dpkg as root, loaded by Debian's /usr/sbin/nginx through the stock
/etc/nginx/modules-enabled/ layout: a 429 decided through Redis, the Lua
library found on lua-nginx-module's default path; removed, `nginx -t`
passes again with the module gone, and purged, nothing of it is left.

The install test changes the machine for its duration only: it fails
(never skips) when not root, when the package is already installed, or
when a file it would install is already there; it removes the package in a
`finally`, and keeps packages from starting or reloading a service
meanwhile (a policy-rc.d of its own when there is none). The nginx it runs
has its own pid file and logs, and listens on a free loopback port only."""

import glob
import os
import re
import subprocess
import time

import harness
import servers
from harness import ROOT, free_port, http_get, write_file

PKG = "libnginx-mod-http-redis-ratelimit"
DEB_DIR = os.path.join(ROOT, "build", "deb")
NGINX = "/usr/sbin/nginx"
STOCK_CONF = "/etc/nginx/nginx.conf"
ENABLED = "/etc/nginx/modules-enabled"
LINK = os.path.join(ENABLED, "50-mod-http-redis-ratelimit.conf")
AVAILABLE = "/usr/share/nginx/modules-available/mod-http-redis-ratelimit.conf"
MODULE = "/usr/lib/nginx/modules/ngx_http_redis_ratelimit_module.so"
LUA = "/usr/share/lua/5.1/resty/redis_ratelimit.lua"
DOC = "/usr/share/doc/" + PKG
ABI_FILE = "/usr/share/nginx/src/debian/libnginx-mod.abisubstvars"
POLICY = "/usr/sbin/policy-rc.d"


def run(argv, timeout=120, **kw):
    """(exit code, stdout and stderr together)."""
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, timeout=timeout, **kw)
    return p.returncode, p.stdout.decode("utf-8", "replace")


def the_deb(h):
    debs = [d for d in glob.glob(os.path.join(DEB_DIR, PKG + "_*.deb")) if "-dbgsym_" not in d]
    h.check(len(debs) == 1, "expected one %s_<version>_<arch>.deb in build/deb, found %s: run `make deb`"
            % (PKG, [os.path.basename(d) for d in debs]))
    return debs[0]


def crate_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        return re.search(r'^version\s*=\s*"([^"]+)"', f.read(), re.M).group(1)


def nginx_abi():
    with open(ABI_FILE) as f:
        return re.search(r"^nginx:abi=(\S+)", f.read(), re.M).group(1)


def installed(pkg):
    rc, out = run(["dpkg-query", "-W", "-f=${Status}", pkg])
    return rc == 0 and "ok installed" in out


def known_to_dpkg(pkg):
    """Installed, or removed with its configuration left (rc)."""
    rc, out = run(["dpkg-query", "-W", "-f=${Status}", pkg])
    return rc == 0 and "not-installed" not in out


def test_the_package_is_laid_out_as_debians_module_packages(h):
    """Its fields (name, the crate's version, section httpd, the nginx-abi
    dependency dh_nginx takes from nginx-dev), its files (the module in
    /usr/lib/nginx/modules, its load_module line in modules-available, the
    Lua library, README, copyright and the crates' licenses in
    /usr/share/doc) and maintainer scripts that link and unlink
    /etc/nginx/modules-enabled/50-mod-http-redis-ratelimit.conf."""
    deb = the_deb(h)
    h.note("%s: %.2f MiB" % (os.path.basename(deb), os.path.getsize(deb) / 2**20))
    rc, fields = run(["dpkg-deb", "-f", deb, "Package", "Version", "Section", "Depends", "Architecture"])
    h.check(rc == 0, "dpkg-deb -f: %s" % fields)
    f = dict(l.split(": ", 1) for l in fields.strip().splitlines())
    h.note("Depends: %s" % f.get("Depends"))
    h.expect(f.get("Package") == PKG, "Package: %s" % f.get("Package"))
    h.expect(f.get("Version") == crate_version(),
             "Version %s, Cargo.toml says %s (debian/changelog and Cargo.toml go together)"
             % (f.get("Version"), crate_version()))
    h.expect(f.get("Section") == "httpd", "Section: %s" % f.get("Section"))
    deps = [d.strip() for d in f.get("Depends", "").split(",")]
    h.expect(nginx_abi() in deps, "Depends %s lacks %s (dh_nginx)" % (deps, nginx_abi()))
    rc, out = run(["dpkg-query", "-W", "-f=${Provides}", "nginx"])
    h.expect(nginx_abi() in out, "Debian's nginx provides %r, not %s" % (out, nginx_abi()))

    rc, listing = run(["dpkg-deb", "-c", deb])
    files = set(re.findall(r"\s\.(/\S+)$", listing, re.M))
    examples = [l.strip().split("/")[-1] for l in open(os.path.join(ROOT, "debian", PKG + ".examples"))]
    for path in (MODULE, AVAILABLE, LUA, DOC + "/copyright", DOC + "/README.md",
                 DOC + "/docs/operations.md", DOC + "/rust-crates.txt"):
        h.expect(path in files, "the package lacks %s" % path)
    for conf in sorted(os.listdir(os.path.join(ROOT, "nginx-conf"))):
        if conf.endswith((".conf", ".yml", ".json")):
            h.expect(conf in examples and DOC + "/examples/" + conf in files,
                     "the package's examples lack nginx-conf/%s" % conf)
    h.expect(not [p for p in files if p.startswith("/etc/")],
             "files under /etc: the modules-enabled link is the maintainer scripts' (as dh_nginx writes)")

    tmp = os.path.join(h.tmp, "x")
    rc, out = run(["dpkg-deb", "-R", deb, tmp])
    h.check(rc == 0, "dpkg-deb -R: %s" % out)
    with open(os.path.join(tmp, AVAILABLE.lstrip("/"))) as fh:
        conf = fh.read()
    h.expect(conf.strip() == "load_module modules/ngx_http_redis_ratelimit_module.so;",
             "modules-available file: %r" % conf)
    for script, want in (("postinst", "ln -sf /usr/share/nginx/modules-available/$from"),
                         ("prerm", "modules-enabled/$to.removed"),
                         ("postrm", "modules-enabled/$to.removed")):
        with open(os.path.join(tmp, "DEBIAN", script)) as fh:
            text = fh.read()
        h.expect("mod-http-redis-ratelimit.conf:50-mod-http-redis-ratelimit.conf" in text and want in text,
                 "DEBIAN/%s is not dh_nginx's:\n%s" % (script, text))


def stock_conf(site, pid, error_log, access_log):
    """Debian's /etc/nginx/nginx.conf with this test's pid file, logs and
    site in place of the machine's: the modules-enabled include, the user,
    the events and http settings stay as they are."""
    with open(STOCK_CONF) as f:
        text = f.read()
    subs = [
        (r"^pid\s+[^;]+;", "pid %s;" % pid),
        (r"^error_log\s+[^;]+;", "error_log %s info;" % error_log),
        (r"^(\s*)access_log\s+[^;]+;", r"\1access_log %s;" % access_log),
        (r"^(\s*)include /etc/nginx/conf\.d/\*\.conf;\n", ""),
        (r"^(\s*)include /etc/nginx/sites-enabled/\*;", r"\1include %s;" % site),
    ]
    for pat, rep in subs:
        text, n = re.subn(pat, rep, text, count=1, flags=re.M)
        if n != 1 and "conf.d" not in pat:
            raise AssertionError("%s is not Debian's stock layout: no line matching %r" % (STOCK_CONF, pat))
    if not re.search(r"^include /etc/nginx/modules-enabled/\*\.conf;", text, re.M):
        raise AssertionError("%s does not include /etc/nginx/modules-enabled/*.conf" % STOCK_CONF)
    return text


SITE = """\
redis_ratelimit_zone $arg_k zone=deb:1m redis=redis://127.0.0.1:%(redis)d;

server {
    listen 127.0.0.1:%(port)d;
    root %(html)s;

    location = /t {
        redis_ratelimit deb 3r/m;
        try_files /index.html =404;
    }

    location = /lua {
        access_by_lua_block {
            local ratelimit = require "resty.redis_ratelimit"
            local lim = assert(ratelimit.new("deblua", "2r/m", { zone = "deb" }))
            local limited, err = lim:is_rate_limited(ngx.var.arg_k)
            if err then
                ngx.log(ngx.ERR, "is_rate_limited: ", err)
                return ngx.exit(500)
            end
            if limited then
                return ngx.exit(429)
            end
        }
        try_files /index.html =404;
    }
}
"""


def reloaded(dpkg_output):
    """Whether nginx's nginx-reload trigger reloaded a running service
    (the policy-rc.d in place denies it)."""
    return "Triggering nginx reload" in dpkg_output and "denied execution" not in dpkg_output


def dpkg(h, *args):
    t0 = time.monotonic()
    rc, out = run(["dpkg"] + list(args), timeout=300)
    h.note("dpkg %s: exit %d, %.1f s" % (" ".join(a if "/" not in a else os.path.basename(a) for a in args),
                                          rc, time.monotonic() - t0))
    return rc, out


def test_installed_with_dpkg_it_limits_in_debians_nginx_and_removes_cleanly(h):
    """dpkg -i; Debian's nginx, started with the stock nginx.conf (its own
    pid, logs and a site of ours on a loopback port in place of the
    machine's sites): the module comes from the package's modules-enabled
    link, 3r/m answers 200 x 3 then 429 with the count in Redis, the
    package's Lua library is found without lua_package_path. dpkg -r: the
    link is set aside, the .so is gone, `nginx -t` passes on the stock
    configuration and refuses our site (unknown directive). dpkg --purge:
    nothing of the package is left."""
    h.check(os.geteuid() == 0,
            "this test installs the package with dpkg -i and removes it again: run it as root "
            "(make test does on CI)")
    deb = the_deb(h)
    for path in (NGINX, STOCK_CONF, ENABLED, "/usr/lib/nginx/modules/ngx_http_lua_module.so"):
        h.check(os.path.exists(path), "%s is missing: Debian's nginx and libnginx-mod-http-lua "
                "(make deps-debian) are needed" % path)
    h.check(not known_to_dpkg(PKG),
            "%s is already installed on this machine; this test installs and removes it itself "
            "(dpkg --purge %s first)" % (PKG, PKG))
    present = [p for p in (MODULE, LUA, AVAILABLE, LINK, LINK + ".removed") if os.path.lexists(p)]
    h.check(not present, "files the package would install or link are already there, not from the "
            "package (installed by hand?): %s; the test would overwrite and remove them" % present)
    rc, out = run([NGINX, "-t"])
    h.check(rc == 0, "nginx -t fails on this machine's configuration before the test:\n%s" % out)

    own_policy = False
    ng = None
    try:
        if not os.path.lexists(POLICY):
            # no service started or reloaded by the maintainer scripts' trigger
            write_file(POLICY, "#!/bin/sh\nexit 101\n", mode=0o755)
            own_policy = True
        rc, out = dpkg(h, "-i", deb)
        h.check(rc == 0, "dpkg -i failed:\n%s" % out)
        h.expect(not reloaded(out), "dpkg -i reloaded an nginx service (nginx's nginx-reload trigger):\n%s" % out)
        h.check(installed(PKG), "dpkg says %s is not installed after dpkg -i" % PKG)
        rc, listing = run(["dpkg", "-L", PKG])
        owned = [l for l in listing.splitlines() if os.path.isfile(l)]
        h.check(os.path.islink(LINK) and os.readlink(LINK) == AVAILABLE,
                "%s should link to %s: %s" % (LINK, AVAILABLE,
                                             os.readlink(LINK) if os.path.islink(LINK) else "missing"))
        for path in (MODULE, LUA, DOC + "/copyright"):
            h.expect(os.path.isfile(path), "%s not installed" % path)

        r = h.redis()
        port = free_port()
        prefix = os.path.join(h.tmp, "debian-nginx")
        html = os.path.join(prefix, "html")
        write_file(os.path.join(html, "index.html"), "ok\n")
        # Debian's prefix (/usr/share/nginx) has modules -> /usr/lib/nginx/modules,
        # which the load_module lines of modules-enabled are relative to
        os.makedirs(prefix, exist_ok=True)
        os.symlink("/usr/lib/nginx/modules", os.path.join(prefix, "modules"))
        # (worker_processes auto, as the stock file says: start() waits for one)
        ng = servers.NginxServer(NGINX, prefix, port, 1, "debian-nginx", registry=harness._REG)
        h.procs.append(ng)
        h.nginxes.append(ng)
        site = os.path.join(prefix, "conf", "site.conf")
        write_file(site, SITE % {"redis": r.port, "port": port, "html": html})
        write_file(ng.conf_path, stock_conf(site, os.path.join(prefix, "logs", "nginx.pid"),
                                            ng.error_log, os.path.join(prefix, "logs", "access.log")))
        ng.start()

        h.wait_minute_room(10)
        key = h.key("deb")
        got = [http_get(port, "/t?k=" + key)[0] for _ in range(5)]
        h.note("3r/m through the package: %s" % got)
        h.check(got == [200, 200, 200, 429, 429], "statuses %s, expected 200 x 3 then 429 x 2" % got)
        redis_keys = r.keys("rl:{deb:%s}:60:*" % key)
        counts = [int(r.cmd("GET", k)) for k in redis_keys]
        h.note("Redis: %s = %s" % (redis_keys, counts))
        h.check(counts == [3], "Redis should hold the key's count, 3: %s = %s" % (redis_keys, counts))
        lua = [http_get(port, "/lua?k=" + key)[0] for _ in range(3)]
        h.note("Lua library from %s, 2r/m: %s" % (LUA, lua))
        h.check(lua == [200, 200, 429], "the packaged Lua library: %s, expected 200 200 429\n%s"
                % (lua, ng.error_log_tail()))
        ng.stop()

        # a file under /etc/nginx that still uses the module (not included
        # by the stock configuration): the prerm names it
        stale = "/etc/nginx/sites-available/zz-redis-ratelimit-test"
        write_file(stale, "redis_ratelimit_zone $binary_remote_addr zone=t:1m;\n")
        try:
            rc, out = dpkg(h, "-r", PKG)
        finally:
            os.remove(stale)
        h.check(rc == 0, "dpkg -r failed:\n%s" % out)
        h.expect("still has redis_ratelimit directives" in out and stale in out,
                 "dpkg -r warns of the directives left in /etc/nginx:\n%s" % out)
        h.expect(not reloaded(out), "dpkg -r reloaded an nginx service:\n%s" % out)
        h.check(not os.path.lexists(LINK) and os.path.islink(LINK + ".removed"),
                "after dpkg -r, %s should be set aside as .removed (dh_nginx's prerm)" % LINK)
        h.check(not os.path.exists(MODULE), "%s is still there after dpkg -r" % MODULE)
        rc, out = run([NGINX, "-t"])
        h.note("nginx -t on %s after dpkg -r: exit %d" % (STOCK_CONF, rc))
        h.check(rc == 0, "nginx -t fails after dpkg -r:\n%s" % out)
        rc, out = run(ng.argv("-t"))
        h.check(rc != 0 and 'unknown directive "redis_ratelimit_zone"' in out,
                "with the package removed our site should fail nginx -t (module not loaded): exit %d\n%s"
                % (rc, out))

        rc, out = dpkg(h, "--purge", PKG)
        h.check(rc == 0, "dpkg --purge failed:\n%s" % out)
        h.check(not known_to_dpkg(PKG), "dpkg still knows %s after --purge" % PKG)
        left = [p for p in owned + [LINK, LINK + ".removed", DOC] if os.path.lexists(p)]
        h.check(not left, "left after dpkg --purge: %s" % left)
        h.note("%d files installed, none left" % len(owned))
    finally:
        if ng is not None:
            ng.stop()
        if known_to_dpkg(PKG):
            run(["dpkg", "--purge", PKG], timeout=300)
        if own_policy:
            os.unlink(POLICY)


test_installed_with_dpkg_it_limits_in_debians_nginx_and_removes_cleanly.timeout = 300
