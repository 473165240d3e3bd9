"""What `make build` and `make build-debian` leave: a module of a sensible
size, its debug information split into a .debug file beside it (as
distributions ship modules), which debuggers and valgrind find through
the module's .gnu_debuglink; the module still loads (every other test
loads it)."""

import os
import subprocess

from harness import ROOT

# the files make wrote (the runner runs a snapshot of the module elsewhere)
MODULE_SO = os.path.join(ROOT, "build", "modules", "ngx_http_redis_ratelimit_module.so")
DEBIAN_SO = os.path.join(ROOT, "build", "debian", "modules", "ngx_http_redis_ratelimit_module.so")
MAX_BYTES = 8 << 20


def debuglink(so):
    p = subprocess.run(["objcopy", "--dump-section", ".gnu_debuglink=/dev/stdout", so],
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=30)
    return p.stdout.split(b"\0", 1)[0].decode(errors="replace") if p.returncode == 0 else None


def test_the_module_is_small_and_its_debug_information_beside_it(h):
    for so in (MODULE_SO, DEBIAN_SO):
        size = os.path.getsize(so)
        dbg = so + ".debug"
        link = debuglink(so)
        h.note("%s: %.1f MiB; %s: %s; .gnu_debuglink: %s"
               % (os.path.relpath(so, ROOT), size / 2**20, os.path.basename(dbg),
                  "%.1f MiB" % (os.path.getsize(dbg) / 2**20) if os.path.exists(dbg) else "missing", link))
        h.check(size < MAX_BYTES, "%s is %d bytes (at most %d)" % (so, size, MAX_BYTES))
        h.check(os.path.exists(dbg), "%s is missing" % dbg)
        h.check(link == os.path.basename(dbg), "the module links to its debug file: %s" % link)
