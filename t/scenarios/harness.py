"""Stdlib-only harness for black-box scenario tests of the nginx module.

Every process this harness starts (redis-server, nginx masters) is
registered and stopped BY ITS PID: from the test context's cleanup (a
``finally``), from ``atexit`` and from the SIGINT/SIGTERM handlers that
``run.py`` installs (``install_signal_handlers``).  Nothing is ever killed by
name, and only processes started here (plus the worker children of nginx
masters started here, identified by pid + start time) are ever signalled.

Main pieces:

* ``Ctx``      - per-test context (``h``): ``h.redis()``, ``h.nginx()``,
                 ``h.note()``, ``h.check()``, ``h.wait_minute_room()``.
* ``Nginx``    - one nginx instance in its own prefix (temp dir).
* ``Redis``    - one redis-server (``cmd``: one command).
* ``http_get`` - one HTTP/1.1 request on a fresh connection (2 s timeout).
* ``burst``    - many concurrent requests from threads.

Starting and stopping processes, ports and the Redis and HTTP clients are
the shared library's (t/lib/servers.py); this file keeps the registry, the
test API and the test-specific configs.
"""

import atexit
import http.client
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "t", "lib"))

import servers  # noqa: E402
# the names the tests and bench/soak.py import from here
from servers import HOST, RedisError, free_port, http_get, proc_stat, wait_for  # noqa: E402,F401

NGINX_BIN = os.environ.get("SCENARIO_NGINX", os.path.join(ROOT, "build", "sbin", "nginx"))
MODULE_SO = os.environ.get(
    "SCENARIO_MODULE",
    os.path.join(ROOT, "build", "modules", "ngx_http_redis_ratelimit_module.so"))
# Debian's nginx with its Lua module and the module built for it (make
# build-debian): the Lua examples and tests
DEBIAN_NGINX = "/usr/sbin/nginx"
DEBIAN_MODULE = os.path.join(ROOT, "build", "debian", "modules", "ngx_http_redis_ratelimit_module.so")
LUA_MODULES = ("/usr/lib/nginx/modules/ndk_http_module.so", "/usr/lib/nginx/modules/ngx_http_lua_module.so")
REDIS_SERVER = os.environ.get("SCENARIO_REDIS_SERVER") or shutil.which("redis-server") or "redis-server"


class TestFailure(AssertionError):
    pass


class TestTimeout(Exception):
    pass


# --------------------------------------------------------------------------
# process registry (the processes themselves: t/lib/servers.py)
# --------------------------------------------------------------------------

_REG = servers.Registry()   # what this process started; stopped in reverse order
_REGISTRY = _REG.items      # (bench/soak.py empties these in its client processes)
_REG_LOCK = _REG.lock


def cleanup_all():
    """Stop every process still registered (by pid).  Idempotent."""
    _REG.stop_all()


atexit.register(cleanup_all)


def _on_signal(signum, frame):
    # stop our processes first, then unwind (finally blocks run again: harmless)
    for s in (signal.SIGINT, signal.SIGTERM):
        try:
            signal.signal(s, signal.SIG_IGN)
        except (ValueError, OSError):
            pass
    cleanup_all()
    raise SystemExit(128 + signum)


def install_signal_handlers():
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


# --------------------------------------------------------------------------
# files, figures
# --------------------------------------------------------------------------


def write_file(path, text, mode=0o644):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(text.encode() if isinstance(text, str) else text)
    os.chmod(path, mode)


def percentile(values, p):
    if not values:
        return None
    v = sorted(values)
    k = min(len(v) - 1, max(0, int(round(p / 100.0 * (len(v) - 1)))))
    return v[k]


def ms(x):
    return "%.1fms" % (x * 1000.0) if x is not None else "n/a"


def window(t, period):
    return int(t // period) * period


# --------------------------------------------------------------------------
# HTTP (the client: servers.http_get)
# --------------------------------------------------------------------------


def http_call(port, method, path, body=None, timeout=3.0):
    """One request of any method over a fresh connection, with `body`
    (str or bytes) when given: (status, headers {lower-case name: value},
    body bytes)."""
    c = http.client.HTTPConnection(HOST, port, timeout=timeout)
    try:
        c.putrequest(method, path, skip_accept_encoding=True)
        data = body if isinstance(body, bytes) else (body or "").encode()
        if body is not None:
            c.putheader("Content-Length", str(len(data)))
        c.putheader("Connection", "close")
        c.endheaders()
        if body is not None:
            c.send(data)
        r = c.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        c.close()


def burst(port, paths, threads=64, timeout=2.0):
    """Send every path in `paths` (a list) from `threads` concurrent threads.
    Returns a list of statuses in the order of `paths` (an exception string
    instead of a status for a failed request)."""
    results = [None] * len(paths)
    idx = [0]
    lock = threading.Lock()
    barrier = threading.Barrier(threads)

    def run():
        try:
            barrier.wait(timeout=10)
        except threading.BrokenBarrierError:
            pass
        while True:
            with lock:
                i = idx[0]
                idx[0] += 1
            if i >= len(paths):
                return
            try:
                results[i] = http_get(port, paths[i], timeout=timeout)[0]
            except Exception as e:     # noqa: BLE001 - reported to the test
                results[i] = "%s: %s" % (type(e).__name__, e)

    ts = [threading.Thread(target=run, daemon=True) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout + 30)
    return results


# --------------------------------------------------------------------------
# Redis
# --------------------------------------------------------------------------


class Redis(servers.RedisServer):
    """A redis-server of one test, in its own dir below the test's temp dir
    (registered: stopped by its pid by the test's cleanup at the latest)."""

    def __init__(self, ctx, port=None, extra_args=(), password=None):
        self.ctx = ctx
        super().__init__(tempfile.mkdtemp(prefix="redis-", dir=ctx.tmp), port, extra_args,
                         password, binary=REDIS_SERVER, registry=_REG)

    def keys(self, pattern="*"):
        return sorted(self.cmd("KEYS", pattern))

    def dump(self, pattern="*"):
        """{key: (value, ttl)} of string keys matching pattern."""
        out = {}
        for k in self.keys(pattern):
            out[k] = (self.cmd("GET", k), self.cmd("TTL", k))
        return out

    info_commandstats = servers.RedisServer.commandstats    # the tests' name for it


# --------------------------------------------------------------------------
# nginx
# --------------------------------------------------------------------------


class Nginx(servers.NginxServer):
    """An nginx of one test in its own prefix below the test's temp dir,
    listening on one port, with the module loaded and the test's config
    pieces; requests over fresh connections."""

    def __init__(self, ctx, http_config="", server_config="", workers=1,
                 files=None, main_config="", name="nginx", port=None,
                 log_level="info"):
        self.ctx = ctx
        super().__init__(NGINX_BIN, tempfile.mkdtemp(prefix="%s-" % name, dir=ctx.tmp),
                         port or free_port(), workers, name, registry=_REG)
        files = {"t": "ok\n"} if files is None else files
        for rel, text in files.items():
            write_file(os.path.join(self.prefix, "html", rel), text)
        self.conf_text = (
            "load_module %s;\n"
            "worker_processes %d;\n"
            "error_log logs/error.log %s;\n"
            "pid logs/nginx.pid;\n"
            "%s\n"
            "events { worker_connections 1024; }\n"
            "http {\n"
            "    access_log off;\n"
            "%s\n"
            "    server {\n"
            "        listen %s:%d;\n"
            "        root html;\n"
            "%s\n"
            "    }\n"
            "}\n" % (MODULE_SO, workers, log_level, main_config, http_config,
                     HOST, self.port, server_config))
        write_file(self.conf_path, self.conf_text)

    def reload(self, timeout=5.0, check=True):
        """SIGHUP the master; wait for the new workers and for the old ones to
        exit.  Returns {"old": [...], "new": [...], "old_gone_after": s|None}
        and, with `check`, fails the test if that did not happen in time."""
        res = super().reload(timeout)
        if check and (not res["new"] or res["old_gone_after"] is None):
            raise TestFailure("reload of %s: new workers %s, old workers still alive %s after %.1fs"
                              % (self.name, res["new"], res["still_alive"], timeout))
        return res

    def request(self, path, headers=None, timeout=2.0):
        return http_get(self.port, path, headers, timeout)

    def get(self, path, timeout=2.0):
        """(status, elapsed) or (error string, elapsed)."""
        t0 = time.monotonic()
        try:
            st, _, _, el = http_get(self.port, path, None, timeout)
            return st, el
        except Exception as e:     # noqa: BLE001
            return "%s: %s" % (type(e).__name__, e), time.monotonic() - t0

    def burst(self, paths, threads=64, timeout=2.0):
        return burst(self.port, paths, threads, timeout)


# --------------------------------------------------------------------------
# the per-test context
# --------------------------------------------------------------------------


class Ctx:
    def __init__(self, name, tmp_root):
        self.name = name
        self.tmp = tempfile.mkdtemp(prefix=re.sub(r"\W", "_", name) + "-", dir=tmp_root)
        os.chmod(self.tmp, 0o755)
        self.procs = []
        self.nginxes = []
        self.redises = []
        self.notes = []
        self.failures = []          # from expect(): reported together at the end
        self.uid = "%x" % random.getrandbits(32)

    def key(self, base):
        """A key unique to this run."""
        return "%s-%s" % (base, self.uid)

    def redis(self, port=None, extra_args=(), password=None, start=True):
        r = Redis(self, port, extra_args, password)
        self.procs.append(r)
        self.redises.append(r)
        return r.start() if start else r

    def nginx(self, http_config="", server_config="", workers=1, start=True, **kw):
        n = Nginx(self, http_config, server_config, workers, name="nginx%d" % (len(self.nginxes) + 1), **kw)
        self.procs.append(n)
        self.nginxes.append(n)
        return n.start() if start else n

    def note(self, msg):
        self.notes.append(msg)

    def check(self, cond, msg):
        """Fatal assertion: the test stops here."""
        if not cond:
            raise TestFailure(msg)
        return cond

    def expect(self, cond, msg):
        """Non-fatal assertion: recorded, the test goes on, fails at the end."""
        if not cond:
            self.failures.append(msg)
        return cond

    def wait_minute_room(self, need):
        """Sleep until at least `need` seconds remain in the current minute
        (so a 60 s window does not roll over during the next `need` s)."""
        left = 60 - (time.time() % 60)
        if left < need:
            time.sleep(left + 0.05)

    def cleanup(self):
        for p in reversed(self.procs):
            try:
                p.stop()
            except Exception:
                pass

    def diagnostics(self):
        out = []
        for n in self.nginxes:
            out.append("%s (port %d, prefix %s) error.log tail:" % (n.name, n.port, n.prefix))
            out.extend("  " + l for l in (n.error_log_tail() or "(empty)").splitlines())
            st = n.stderr_text().strip()
            if st:
                out.append("%s stderr: %s" % (n.name, st[-800:]))
        for r in self.redises:
            out.append("redis :%d log tail:" % r.port)
            out.extend("  " + l for l in r.log_tail(5).splitlines())
        return out


def discover(module):
    """Test functions of a module, in order of definition."""
    return [(k[len("test_"):], v) for k, v in vars(module).items()
            if k.startswith("test_") and callable(v)]


def run_one(fn, name, tmp_root, default_timeout=45):
    """Run one test.  Returns (passed, notes, diagnostics lines, seconds)."""
    h = Ctx(name, tmp_root)
    limit = getattr(fn, "timeout", default_timeout)

    def on_alarm(signum, frame):
        raise TestTimeout("test exceeded its %ds time bound" % limit)

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(limit)
    t0 = time.monotonic()
    diag = []
    ok = False
    try:
        try:
            fn(h)
            ok = not h.failures
        except TestFailure as e:
            diag.append("FAILED: %s" % e)
        except BaseException as e:      # noqa: BLE001
            if isinstance(e, (SystemExit, KeyboardInterrupt)):
                raise
            diag.append("ERROR: %s: %s" % (type(e).__name__, e))
            diag.extend(traceback.format_exc().rstrip().splitlines())
        finally:
            signal.alarm(0)
        diag[:0] = ["FAILED: %s" % m for m in h.failures]
        if not ok:
            diag.extend(h.diagnostics())
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        h.cleanup()
    return ok, h.notes, diag, time.monotonic() - t0
