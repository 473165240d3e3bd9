"""The example configurations in nginx-conf/ stay valid: `nginx -t` accepts
each one with the module built from this tree (and, for the Lua example,
Debian's nginx with its Lua module and the module built for it)."""

import os
import shutil
import subprocess

import harness
from harness import DEBIAN_MODULE, DEBIAN_NGINX, LUA_MODULES, ROOT
from test_tls import example_certificates



def nginx_t(h, nginx, conf_text, modules):
    """Runs `nginx -t` on conf_text in a fresh prefix whose modules/ holds
    `modules`; returns (exit code, output)."""
    prefix = os.path.join(h.tmp, "prefix-%d" % len(os.listdir(h.tmp)))
    for d in ("conf", "logs", "modules", "html"):
        os.makedirs(os.path.join(prefix, d), exist_ok=True)
    for m in modules:
        shutil.copy(m, os.path.join(prefix, "modules", os.path.basename(m)))
    conf = os.path.join(prefix, "conf", "nginx.conf")
    with open(conf, "w") as f:
        f.write(conf_text)
    # the password file strict.conf and tls.conf name (read by nginx -t)
    with open(os.path.join(prefix, "conf", "redis-ratelimit.pw"), "w") as f:
        f.write("example-password\n")
    # the certificates TLS examples name (ssl_*=, read and checked by nginx -t)
    for name, path in example_certificates(h.tmp).items():
        shutil.copy(path, os.path.join(prefix, "conf", name))
    p = subprocess.run([nginx, "-p", prefix + "/", "-c", conf, "-t"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
    return p.returncode, p.stdout.decode("utf-8", "replace")


def read(name):
    with open(os.path.join(ROOT, "nginx-conf", name)) as f:
        return f.read()


def test_example_conf(h):
    """nginx-conf/example.conf (used by make run) passes nginx -t."""
    rc, out = nginx_t(h, harness.NGINX_BIN, read("example.conf"), [harness.MODULE_SO])
    h.note(out.strip().splitlines()[-1] if out.strip() else "(no output)")
    h.check(rc == 0, "nginx -t failed on example.conf:\n" + out)


def test_cluster_conf(h):
    """nginx-conf/cluster.conf passes nginx -t (no cluster needed for that)."""
    rc, out = nginx_t(h, harness.NGINX_BIN, read("cluster.conf"), [harness.MODULE_SO])
    h.check(rc == 0, "nginx -t failed on cluster.conf:\n" + out)


def test_lua_conf(h):
    """nginx-conf/lua.conf passes nginx -t on Debian's nginx with its Lua
    module (the lines loading ndk and lua enabled)."""
    for path in (DEBIAN_NGINX, DEBIAN_MODULE) + LUA_MODULES:
        h.check(os.path.exists(path), "%s is missing (make build-debian installs and builds it)" % path)
    text = read("lua.conf").replace("#   load_module", "load_module")
    rc, out = nginx_t(h, DEBIAN_NGINX, text, (DEBIAN_MODULE,) + LUA_MODULES)
    h.check(rc == 0, "nginx -t failed on lua.conf:\n" + out)


def test_recipes_conf(h):
    """nginx-conf/recipes.conf (every recipe of docs/recipes.md) passes nginx -t."""
    rc, out = nginx_t(h, harness.NGINX_BIN, read("recipes.conf"), [harness.MODULE_SO])
    h.check(rc == 0, "nginx -t failed on recipes.conf:\n" + out)


def test_strict_conf(h):
    """nginx-conf/strict.conf (strict limits, a Sentinel backend) passes
    nginx -t (no sentinel needed for that)."""
    rc, out = nginx_t(h, harness.NGINX_BIN, read("strict.conf"), [harness.MODULE_SO])
    h.check(rc == 0, "nginx -t failed on strict.conf:\n" + out)


def test_tls_conf(h):
    """nginx-conf/tls.conf (a private CA and client certificates, a managed
    TLS endpoint with a password file, a one-node cluster) passes nginx -t
    with the files it names beside it (no Redis needed for that)."""
    rc, out = nginx_t(h, harness.NGINX_BIN, read("tls.conf"), [harness.MODULE_SO])
    h.check(rc == 0, "nginx -t failed on tls.conf:\n" + out)
