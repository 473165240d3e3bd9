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
* ``Redis``    - one redis-server, with a tiny RESP client (``cmd``).
* ``http_get`` - one HTTP/1.1 request over a raw socket (2 s timeout).
* ``burst``    - many concurrent requests from threads.
"""

import atexit
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NGINX_BIN = os.environ.get("SCENARIO_NGINX", os.path.join(ROOT, "build", "sbin", "nginx"))
MODULE_SO = os.environ.get(
    "SCENARIO_MODULE",
    os.path.join(ROOT, "build", "modules", "ngx_http_redis_ratelimit_module.so"))
REDIS_SERVER = os.environ.get("SCENARIO_REDIS_SERVER") or shutil.which("redis-server") or "redis-server"

HOST = "127.0.0.1"


class TestFailure(AssertionError):
    pass


class TestTimeout(Exception):
    pass


# --------------------------------------------------------------------------
# process registry and hygiene
# --------------------------------------------------------------------------

_REGISTRY = []              # objects with .stop(); stopped in reverse order
_REG_LOCK = threading.RLock()
_CLEANING = False


def _register(obj):
    with _REG_LOCK:
        _REGISTRY.append(obj)


def _unregister(obj):
    with _REG_LOCK:
        try:
            _REGISTRY.remove(obj)
        except ValueError:
            pass


def cleanup_all():
    """Stop every process still registered (by pid).  Idempotent."""
    global _CLEANING
    if _CLEANING:
        return
    _CLEANING = True
    try:
        while True:
            with _REG_LOCK:
                if not _REGISTRY:
                    break
                obj = _REGISTRY.pop()
            try:
                obj.stop(quick=True)
            except Exception:
                pass
    finally:
        _CLEANING = False


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


def proc_stat(pid):
    """(state, ppid, starttime) from /proc/<pid>/stat, or None."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            data = f.read().decode("latin-1")
    except OSError:
        return None
    rest = data[data.rindex(")") + 2:].split()
    try:
        return rest[0], int(rest[1]), int(rest[19])
    except (IndexError, ValueError):
        return None


def proc_cmdline(pid):
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read().replace(b"\0", b" ").decode("latin-1").strip()
    except OSError:
        return ""


def children_of(ppid):
    """{pid: starttime} of live (non-zombie) children of ppid."""
    kids = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        st = proc_stat(int(d))
        if st and st[1] == ppid and st[0] != "Z":
            kids[int(d)] = st[2]
    return kids


def same_process_alive(pid, starttime):
    st = proc_stat(pid)
    return bool(st) and st[2] == starttime and st[0] != "Z"


def _stop_popen(popen, first_sig, grace, then=(signal.SIGKILL,), then_grace=2.0):
    """Signal one Popen (by its own pid) and wait; escalate.  Returns the
    seconds from the first signal until it exited (None if it never did)."""
    if popen.poll() is not None:
        return 0.0
    t0 = time.monotonic()
    sigs = [(first_sig, grace)] + [(s, then_grace) for s in then]
    for sig, g in sigs:
        try:
            popen.send_signal(sig)     # Popen checks it has not been reaped
        except OSError:
            pass
        try:
            popen.wait(timeout=g)
            return time.monotonic() - t0
        except subprocess.TimeoutExpired:
            continue
    return None


# --------------------------------------------------------------------------
# ports, files, waiting
# --------------------------------------------------------------------------

_USED_PORTS = set()


def free_port():
    """A free loopback TCP port below 50000 (never handed out twice)."""
    for _ in range(500):
        port = random.randint(20000, 49999)
        if port in _USED_PORTS:
            continue
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.bind((HOST, port))
        except OSError:
            continue
        finally:
            s.close()
        _USED_PORTS.add(port)
        return port
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    _USED_PORTS.add(port)
    return port


def port_accepts(port, timeout=0.2):
    try:
        s = socket.create_connection((HOST, port), timeout=timeout)
    except OSError:
        return False
    s.close()
    return True


def wait_for(pred, timeout, interval=0.02):
    """Poll pred() until truthy or timeout; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


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
# HTTP client
# --------------------------------------------------------------------------


def http_get(port, path, headers=None, timeout=2.0):
    """GET over a fresh connection.  Returns (status, headers, body, elapsed)
    with headers = {lower-case name: [values]}; raises OSError/ValueError on
    connection errors, timeouts or malformed responses."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    s = socket.create_connection((HOST, port), timeout=timeout)
    try:
        lines = ["GET %s HTTP/1.1" % path, "Host: localhost", "Connection: close"]
        for k, v in (headers or {}).items():
            lines.append("%s: %s" % (k, v))
        s.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        chunks = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("response not complete within %.1fs" % timeout)
            s.settimeout(left)
            b = s.recv(65536)
            if not b:
                break
            chunks.append(b)
    finally:
        s.close()
    elapsed = time.monotonic() - t0
    raw = b"".join(chunks)
    head, sep, body = raw.partition(b"\r\n\r\n")
    if not sep:
        raise ValueError("malformed/empty HTTP response: %r" % raw[:200])
    hl = head.decode("latin-1").split("\r\n")
    m = re.match(r"HTTP/1\.[01] (\d{3})", hl[0])
    if not m:
        raise ValueError("bad status line: %r" % hl[0])
    hdrs = {}
    for line in hl[1:]:
        k, _, v = line.partition(":")
        hdrs.setdefault(k.strip().lower(), []).append(v.strip())
    return int(m.group(1)), hdrs, body, elapsed


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


class RedisError(Exception):
    pass


def _resp_encode(args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if not isinstance(a, bytes):
            a = str(a).encode("utf-8")
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _resp_read(f):
    line = f.readline()
    if not line:
        raise ConnectionError("redis closed the connection")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        return RedisError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2].decode("utf-8", "surrogateescape")
    if kind == b"*":
        n = int(rest)
        if n < 0:
            return None
        return [_resp_read(f) for _ in range(n)]
    raise ConnectionError("bad RESP line %r" % line)


class Redis:
    def __init__(self, ctx, port=None, extra_args=(), password=None):
        self.ctx = ctx
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.password = password
        if password is not None:
            self.extra_args += ["--requirepass", password]
        self.dir = tempfile.mkdtemp(prefix="redis-", dir=ctx.tmp)
        self.log = os.path.join(self.dir, "redis.log")
        self.popen = None

    @property
    def url(self):
        return "redis://%s:%d" % (HOST, self.port)

    def start(self, timeout=5.0):
        if self.popen and self.popen.poll() is None:
            return self
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", HOST,
                "--daemonize", "no", "--save", "", "--appendonly", "no",
                "--protected-mode", "no", "--dir", self.dir,
                "--logfile", self.log] + self.extra_args
        self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL,
                                      start_new_session=True)
        _register(self)

        def ready():
            if self.popen.poll() is not None:
                raise RuntimeError("redis-server exited (%s) at start; log:\n%s"
                                   % (self.popen.returncode, self.log_tail()))
            try:
                self.cmd("PING", timeout=0.3, auth=False, raise_errors=False)
                return True
            except OSError:
                return False

        if not wait_for(ready, timeout, 0.02):
            raise RuntimeError("redis-server on port %d not ready within %.0fs"
                               % (self.port, timeout))
        return self

    def stop(self, quick=False):
        if self.popen is None:
            return
        _stop_popen(self.popen, signal.SIGTERM, 1.0 if quick else 3.0)
        _unregister(self)

    def restart(self):
        """Stop, then start again on the SAME port."""
        self.stop()
        return self.start()

    @property
    def running(self):
        return self.popen is not None and self.popen.poll() is None

    def cmd(self, *args, timeout=3.0, auth=True, raise_errors=True):
        s = socket.create_connection((HOST, self.port), timeout=timeout)
        try:
            payload = b""
            if auth and self.password is not None:
                payload += _resp_encode(["AUTH", self.password])
            payload += _resp_encode(args)
            s.sendall(payload)
            f = s.makefile("rb")
            if auth and self.password is not None:
                r = _resp_read(f)
                if isinstance(r, RedisError):
                    raise r
            r = _resp_read(f)
        finally:
            s.close()
        if isinstance(r, RedisError) and raise_errors:
            raise r
        return r

    def keys(self, pattern="*"):
        return sorted(self.cmd("KEYS", pattern))

    def dump(self, pattern="*"):
        """{key: (value, ttl)} of string keys matching pattern."""
        out = {}
        for k in self.keys(pattern):
            out[k] = (self.cmd("GET", k), self.cmd("TTL", k))
        return out

    def info_commandstats(self):
        text = self.cmd("INFO", "commandstats")
        stats = {}
        for line in text.splitlines():
            m = re.match(r"cmdstat_([^:]+):(.*)", line.strip())
            if not m:
                continue
            d = {}
            for kv in m.group(2).split(","):
                k, _, v = kv.partition("=")
                try:
                    d[k] = float(v) if "." in v else int(v)
                except ValueError:
                    d[k] = v
            stats[m.group(1)] = d
        return stats

    def log_tail(self, n=15):
        try:
            with open(self.log, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return "(no redis log)"


# --------------------------------------------------------------------------
# nginx
# --------------------------------------------------------------------------


class Nginx:
    def __init__(self, ctx, http_config="", server_config="", workers=1,
                 files=None, main_config="", name="nginx", port=None,
                 log_level="info"):
        self.ctx = ctx
        self.name = name
        self.port = port or free_port()
        self.workers = workers
        self.prefix = tempfile.mkdtemp(prefix="%s-" % name, dir=ctx.tmp)
        os.chmod(self.prefix, 0o755)
        for d in ("conf", "logs", "html"):
            os.makedirs(os.path.join(self.prefix, d), exist_ok=True)
            os.chmod(os.path.join(self.prefix, d), 0o755)
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
        write_file(os.path.join(self.prefix, "conf", "nginx.conf"), self.conf_text)
        self.error_log = os.path.join(self.prefix, "logs", "error.log")
        self.stderr_path = os.path.join(self.prefix, "logs", "stderr.log")
        self.popen = None
        self.seen = {}            # worker pid -> starttime (for hygiene)

    # -- process control ------------------------------------------------
    @property
    def pid(self):
        return self.popen.pid if self.popen else None

    def worker_pids(self):
        """{pid: starttime} of the master's live children."""
        if not self.popen or self.popen.poll() is not None:
            return {}
        kids = children_of(self.popen.pid)
        self.seen.update(kids)
        return kids

    def start(self, timeout=5.0):
        self.stderr_f = open(self.stderr_path, "wb")
        self.popen = subprocess.Popen(
            [NGINX_BIN, "-p", self.prefix + "/", "-c", "conf/nginx.conf",
             "-g", "daemon off;"],
            stdin=subprocess.DEVNULL, stdout=self.stderr_f, stderr=subprocess.STDOUT,
            start_new_session=True)
        _register(self)

        def up():
            if self.popen.poll() is not None:
                raise RuntimeError("nginx %s exited (%s) at start:\n%s\n%s" % (
                    self.name, self.popen.returncode, self.stderr_text(),
                    self.error_log_tail()))
            return port_accepts(self.port) and len(self.worker_pids()) >= self.workers

        if not wait_for(up, timeout, 0.02):
            raise RuntimeError("nginx %s not accepting on %d with %d workers within %.0fs"
                               % (self.name, self.port, self.workers, timeout))
        return self

    def reload(self, timeout=5.0, check=True):
        """SIGHUP the master; wait for the new workers and for the old ones to
        exit.  Returns {"old": [...], "new": [...], "old_gone_after": s|None}."""
        old = self.worker_pids()
        t0 = time.monotonic()
        self.popen.send_signal(signal.SIGHUP)
        new = wait_for(lambda: [p for p in self.worker_pids() if p not in old]
                       if len([p for p in self.worker_pids() if p not in old]) >= self.workers
                       else None, timeout)
        gone = wait_for(lambda: not any(same_process_alive(p, st) for p, st in old.items()),
                        max(0.0, timeout - (time.monotonic() - t0)), 0.01)
        res = {"old": sorted(old), "new": sorted(new or []),
               "old_gone_after": (time.monotonic() - t0) if gone else None,
               "still_alive": sorted(p for p, st in old.items() if same_process_alive(p, st))}
        if check and (not new or not gone):
            raise TestFailure("reload of %s: new workers %s, old workers still alive %s after %.1fs"
                              % (self.name, res["new"], res["still_alive"], timeout))
        return res

    def quit(self, grace=5.0):
        """SIGQUIT the master; returns the seconds until it exited (if it did
        not within `grace`, it is SIGTERMed/SIGKILLed and the returned figure
        is the total time, > grace)."""
        if not self.popen or self.popen.poll() is not None:
            return 0.0
        self.worker_pids()
        t0 = time.monotonic()
        el = _stop_popen(self.popen, signal.SIGQUIT, grace,
                         then=(signal.SIGTERM, signal.SIGKILL), then_grace=2.0)
        self._reap_workers()
        _unregister(self)
        self._close()
        return el if el is not None else time.monotonic() - t0

    def stop(self, quick=False):
        self.quit(grace=1.0 if quick else 5.0)

    def _reap_workers(self):
        # workers orphaned by a killed master: kill exactly those we saw
        for pid, st in list(self.seen.items()):
            if same_process_alive(pid, st) and "nginx" in proc_cmdline(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        wait_for(lambda: not any(same_process_alive(p, s) for p, s in self.seen.items()), 2.0)

    def _close(self):
        try:
            self.stderr_f.close()
        except Exception:
            pass

    @property
    def running(self):
        return self.popen is not None and self.popen.poll() is None

    # -- logs and requests ---------------------------------------------
    def error_log_text(self):
        try:
            with open(self.error_log, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def error_log_tail(self, n=25):
        lines = self.error_log_text().splitlines()
        return "\n".join(lines[-n:])

    def stderr_text(self):
        try:
            with open(self.stderr_path, "rb") as f:
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

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
