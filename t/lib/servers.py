"""Starting and stopping the servers that the tests and benchmarks run:
redis-server, a Redis Cluster and nginx, all on 127.0.0.1, and the clients
that talk to them: Redis (RESP) and HTTP (Python 3 stdlib only).

Shared by t/runner.py (the Test::Nginx runner), t/scenarios/harness.py and
cluster.py (the scenario tests, also used by bench/soak.py) and bench/run.py.
Each of them keeps its own record of what it started (a ``Registry``, or the
runner's ``Reaper``) and stops all of it at the end, on failure, from
``atexit`` and on Ctrl-C.

Everything here works strictly BY PID: a process is signalled only if it was
started here (a ``Popen``), or is an nginx master whose PID the caller hands
in, or is a worker child of such a master, identified by PID and start time.
Nothing is ever killed by name.

Pieces:

* ports      - ``free_port``, ``cluster_ports``, ``port_accepts``, ``wait_for``
* processes  - ``proc_stat``, ``proc_cmdline``, ``pid_alive``,
               ``same_process_alive``, ``children``, ``send_signal``,
               ``stop_popen``, ``stop_nginx``, ``Registry``
* RESP       - ``RedisError``, ``resp_encode``, ``resp_read``, ``RedisConn``
               (a connection kept open), ``pipeline``, ``call`` (one each)
* HTTP       - ``http_request``, ``HttpConn`` (keep-alive, pipelining),
               ``HttpResponse``, ``HttpClosed``, ``http_get`` (one request)
* servers    - ``RedisServer``, ``RedisCluster``, ``NginxServer``
"""

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

HOST = "127.0.0.1"
REDIS_SERVER = shutil.which("redis-server") or "redis-server"
REDIS_CLI = shutil.which("redis-cli") or "redis-cli"

# --------------------------------------------------------------------------
# ports and waiting
# --------------------------------------------------------------------------

def _port_range():
    """Ports below the kernel's ephemeral range (the source ports of every
    outgoing connection: nginx to Redis, clients to nginx): a port chosen
    there can be taken by such a connection between the check and the
    server's bind. A cluster node's bus port (+10000) stays below it too."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    high = max(low - 10000, 11000)
    return (min(10000, high - 1000), high)


PORT_RANGE = _port_range()      # e.g. (10000, 22768): below the ephemeral ports, bus port included
_HANDED_OUT = set()             # every port this process handed out
_PORT_LOCK = threading.Lock()


def _bindable(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((HOST, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def free_port(exclude=()):
    """A free loopback TCP port in PORT_RANGE, chosen at random, never handed
    out twice by this process and not in `exclude` (ports the caller uses
    otherwise).  Falls back to a port the kernel picks."""
    with _PORT_LOCK:
        for _ in range(500):
            port = random.randrange(*PORT_RANGE)
            if port not in _HANDED_OUT and port not in exclude and _bindable(port):
                _HANDED_OUT.add(port)
                return port
        for _ in range(50):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((HOST, 0))
                port = s.getsockname()[1]
            finally:
                s.close()
            if port not in _HANDED_OUT and port not in exclude:
                _HANDED_OUT.add(port)
                return port
    raise RuntimeError("cannot find a free TCP port on %s" % HOST)


def cluster_ports(n=6, exclude=()):
    """`n` free ports P in PORT_RANGE for Redis Cluster nodes whose cluster
    bus ports (P + 10000) are free too; P and P + 10000 are both reserved
    (never handed out again by this process)."""
    chosen = []
    with _PORT_LOCK:
        for _ in range(5000):
            p = random.randrange(*PORT_RANGE)
            pair = (p, p + 10000)
            if any(x in _HANDED_OUT or x in exclude for x in pair):
                continue
            if _bindable(p) and _bindable(p + 10000):
                _HANDED_OUT.update(pair)
                chosen.append(p)
                if len(chosen) == n:
                    return chosen
    raise RuntimeError("cannot find %d free port pairs (P in %s, P + 10000)" % (n, PORT_RANGE))


def port_accepts(port, timeout=0.2):
    """True if something accepts a TCP connection on 127.0.0.1:port."""
    try:
        s = socket.create_connection((HOST, port), timeout=timeout)
    except OSError:
        return False
    s.close()
    return True


def wait_for(pred, timeout, interval=0.02):
    """Poll pred() until truthy or timeout; returns the last value.  Waiting
    for a port is ``wait_for(lambda: port_accepts(port), timeout)``."""
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(interval)


# --------------------------------------------------------------------------
# processes, by PID
# --------------------------------------------------------------------------


def proc_stat(pid):
    """(state, ppid, starttime) of a pid (or thread id) from /proc, or None."""
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


def pid_alive(pid):
    """True while `pid` is a live (not zombie) process.  A zombie that is our
    own child is reaped on the way."""
    if not pid:
        return False
    st = proc_stat(pid)
    if st is None:
        if os.path.isdir("/proc/self"):
            return False
        try:                        # no /proc: ask the kernel
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    if st[0] in ("Z", "X"):
        try:
            os.waitpid(pid, os.WNOHANG)
        except OSError:
            pass
        return False
    return True


def same_process_alive(pid, starttime):
    """True while `pid` is alive and still the process that started at
    `starttime` (not a later process that reused the pid)."""
    st = proc_stat(pid)
    return bool(st) and st[2] == starttime and st[0] != "Z"


def children(ppid):
    """{pid: starttime} of the live (not zombie) children of `ppid` - the
    workers of an nginx master."""
    kids = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return kids
    for d in entries:
        if not d.isdigit():
            continue
        st = proc_stat(int(d))
        if st and st[1] == ppid and st[0] != "Z":
            kids[int(d)] = st[2]
    return kids


def proc_cmdline(pid):
    """The raw command line of a pid (NUL-separated bytes), or None."""
    try:
        with open("/proc/%d/cmdline" % pid, "rb") as f:
            return f.read()
    except OSError:
        return None


def send_signal(pid, sig):
    """Signal one pid; False if it is gone."""
    try:
        os.kill(pid, sig)
        return True
    except OSError:
        return False


def _signal_and_wait(pid, popen, sig, wait):
    """Send `sig` to the process (through its Popen when we have one, which
    never signals a reaped pid) and wait up to `wait` s; True once gone."""
    if popen is not None:
        if popen.poll() is not None:
            return True
        try:
            popen.send_signal(sig)
        except OSError:
            pass
        try:
            popen.wait(timeout=wait)
            return True
        except subprocess.TimeoutExpired:
            return False
    if not pid_alive(pid):
        return True
    send_signal(pid, sig)
    return bool(wait_for(lambda: not pid_alive(pid), wait))


def stop_popen(popen, grace=3.0, sig=signal.SIGTERM, then=(signal.SIGKILL,), then_grace=2.0):
    """Stop one process we started (a Popen, signalled by its own PID): `sig`,
    up to `grace` s, then each signal of `then` with `then_grace` s.  Returns
    the seconds from the first signal until it exited (0.0 if it already
    had, None if it never did)."""
    if popen.poll() is not None:
        return 0.0
    t0 = time.monotonic()
    for signum, wait in [(sig, grace)] + [(later, then_grace) for later in then]:
        if _signal_and_wait(popen.pid, popen, signum, wait):
            return time.monotonic() - t0
    return None


def stop_nginx(master, grace=5.0, then=(signal.SIGKILL,), then_grace=2.0, workers=None):
    """Stop an nginx master - a Popen of ours, or a PID the caller knows to be
    an nginx master it started: SIGQUIT (graceful shutdown), up to `grace` s,
    then each signal of `then` with `then_grace` s.  Afterwards SIGKILL those
    of its workers still alive - the children it had (`workers`, {pid:
    starttime} seen earlier, plus its children now and before each signal),
    each identified by PID and start time - and wait up to 2 s for them.
    Returns (seconds until the master exited or None, graceful) where
    graceful means that SIGQUIT alone stopped it."""
    popen = master if isinstance(master, subprocess.Popen) else None
    pid = popen.pid if popen is not None else master
    kids = dict(workers or {})
    t0 = time.monotonic()
    secs, graceful = None, False
    steps = [(signal.SIGQUIT, grace)] + [(later, then_grace) for later in then]
    for i, (signum, wait) in enumerate(steps):
        kids.update(children(pid))
        if _signal_and_wait(pid, popen, signum, wait):
            secs, graceful = time.monotonic() - t0, i == 0
            break
    for k, st in kids.items():
        if same_process_alive(k, st) and b"nginx" in (proc_cmdline(k) or b""):
            send_signal(k, signal.SIGKILL)
    wait_for(lambda: not any(same_process_alive(k, st) for k, st in kids.items()), 2.0)
    return secs, graceful


class Registry:
    """The servers one program started and must stop: objects with a
    ``stop(quick=...)`` method (RedisServer, NginxServer, or the caller's
    own), stopped newest first by ``stop_all`` - at the end, on failure, from
    atexit or a signal handler.  The servers here add themselves when they
    start and remove themselves when they stop."""

    def __init__(self):
        self.items = []             # never rebound: callers may hold it
        self.lock = threading.RLock()
        self._stopping = False

    def add(self, obj):
        with self.lock:
            if obj not in self.items:
                self.items.append(obj)

    def discard(self, obj):
        with self.lock:
            if obj in self.items:
                self.items.remove(obj)

    def stop_all(self, quick=True, on_error=None):
        """Stop every object still registered, newest first.  Idempotent;
        an error stopping one (passed to on_error(obj, exc)) does not keep
        the others running."""
        if self._stopping:
            return
        self._stopping = True
        try:
            while True:
                with self.lock:
                    if not self.items:
                        break
                    obj = self.items.pop()
                try:
                    obj.stop(quick=quick)
                except Exception as e:      # noqa: BLE001 - keep stopping
                    if on_error is not None:
                        on_error(obj, e)
        finally:
            self._stopping = False


# --------------------------------------------------------------------------
# RESP: a small Redis client
# --------------------------------------------------------------------------


class RedisError(Exception):
    """An error reply of Redis: a value from resp_read and pipeline, raised
    by call() unless raise_errors=False."""


def resp_encode(args):
    """One command (a sequence of str/bytes/int) as a RESP array."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if not isinstance(a, bytes):
            a = str(a).encode("utf-8")
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def resp_read(f):
    """One reply from a binary file object: str, int, None, a list, or a
    RedisError for an error reply (bulk strings decoded as UTF-8 with
    surrogateescape, so bytes survive a round trip)."""
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
        return [resp_read(f) for _ in range(n)]
    raise ConnectionError("bad RESP line %r" % line)


class RedisConn:
    """One connection to a Redis on 127.0.0.1:port, kept open until close()
    (or the end of a ``with``): AUTH first when a password is given (its
    failure raised), then commands pipelined - each batch in one write, the
    replies read in order, error replies as RedisError values.  Every socket
    operation is bounded by `timeout` s."""

    def __init__(self, port, password=None, timeout=3.0):
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        self.f = self.sock.makefile("rb")
        if password is not None:
            try:
                r = self.pipeline([("AUTH", password)])[0]
                if isinstance(r, RedisError):
                    raise r
            except BaseException:
                self.close()
                raise

    def pipeline(self, commands):
        """Send the commands (sequences of str/bytes/int) in one write;
        their replies in order."""
        commands = [list(c) for c in commands]
        self.sock.sendall(b"".join(resp_encode(c) for c in commands))
        return [resp_read(self.f) for _ in commands]

    def cmd(self, *args, raise_errors=True):
        """One command's reply (an error reply raised, or returned when
        raise_errors=False)."""
        r = self.pipeline([args])[0]
        if isinstance(r, RedisError) and raise_errors:
            raise r
        return r

    def close(self):
        for x in (self.f, self.sock):
            try:
                x.close()
            except OSError:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def pipeline(port, commands, password=None, timeout=3.0):
    """Send several commands on one fresh connection to 127.0.0.1:port (AUTH
    first when a password is given; its failure is raised) and return their
    replies in order, error replies as RedisError values."""
    with RedisConn(port, password, timeout) as c:
        return c.pipeline(commands)


def call(port, *args, password=None, timeout=3.0, raise_errors=True):
    """One command on a fresh connection to 127.0.0.1:port; returns the
    reply (an error reply raised, or returned when raise_errors=False)."""
    with RedisConn(port, password, timeout) as c:
        return c.cmd(*args, raise_errors=raise_errors)


# --------------------------------------------------------------------------
# HTTP: a small client (GET, HTTP/1.1)
# --------------------------------------------------------------------------


def _latin1(x):
    return x if isinstance(x, bytes) else str(x).encode("latin-1")


def http_request(path, headers=None, close=False):
    """One GET request as bytes: `path` and the values of `headers` (a dict)
    str (sent as latin-1) or bytes (as they are: any byte a header value may
    hold); ``Connection: close`` when `close`."""
    out = [b"GET ", _latin1(path), b" HTTP/1.1\r\nHost: localhost\r\n"]
    if close:
        out.append(b"Connection: close\r\n")
    for k, v in (headers or {}).items():
        out += [_latin1(k), b": ", _latin1(v), b"\r\n"]
    out.append(b"\r\n")
    return b"".join(out)


class HttpClosed(ConnectionError):
    """The server closed the connection before a response began (a reused
    keep-alive connection that nginx had closed: a GET may be sent again)."""


class HttpResponse:
    """status (int), body (bytes), close (the server closes the connection
    after it), headers ({lower-case name: [values]}) and header(name) (the
    first value or None)."""

    __slots__ = ("status", "lines", "body", "close", "_headers")

    def __init__(self, status, lines, body, close):
        self.status = status
        self.lines = lines          # the header lines, bytes without CRLF
        self.body = body
        self.close = close
        self._headers = None

    @property
    def headers(self):
        if self._headers is None:
            self._headers = {}
            for line in self.lines:
                k, _, v = line.decode("latin-1").partition(":")
                self._headers.setdefault(k.strip().lower(), []).append(v.strip())
        return self._headers

    def header(self, name):
        v = self.headers.get(name.lower())
        return v[0] if v else None


def _status(line):
    m = re.match(rb"HTTP/1\.[01] (\d{3})", line)
    if not m:
        raise ValueError("bad status line: %r" % line[:100])
    return int(m.group(1))


class HttpConn:
    """HTTP/1.1 keep-alive connection to 127.0.0.1:port, opened when a
    request is sent and again after the server closed it (a response with
    ``Connection: close``); every socket operation is bounded by `timeout`
    s.  get() is one request and its response; send() and read() pipeline
    (statuses() in batches).  A response's body is read by its
    Content-Length, its chunks, or to the close.  An error closes the
    connection (the next request opens a new one)."""

    def __init__(self, port, timeout=3.0, nodelay=False):
        self.port = port
        self.timeout = timeout
        self.nodelay = nodelay
        self.sock = self.f = None

    @property
    def connected(self):
        return self.sock is not None

    def send(self, data):
        """Send request bytes (one or several: http_request)."""
        try:
            if self.sock is None:
                self.sock = socket.create_connection((HOST, self.port), timeout=self.timeout)
                if self.nodelay:
                    self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.f = self.sock.makefile("rb", buffering=1 << 16)
            self.sock.sendall(data)
        except BaseException:
            self.close()
            raise

    def read(self):
        """The next response (an HttpResponse)."""
        if self.f is None:
            raise HttpClosed("no connection to read a response from")
        try:
            r = self._read()
        except BaseException:
            self.close()
            raise
        if r.close:
            self.close()
        return r

    def _read(self):
        f = self.f
        line = f.readline()
        if not line:
            raise HttpClosed("the server closed the connection")
        status = _status(line)
        lines, length, chunked, close = [], None, False, line.startswith(b"HTTP/1.0")
        while True:
            h = f.readline()
            if h in (b"\r\n", b"\n"):
                break
            if not h:
                raise ConnectionError("the server closed the connection in the headers")
            h = h.rstrip(b"\r\n")
            lines.append(h)
            k, _, v = h.partition(b":")
            k = k.strip().lower()
            if k == b"content-length":
                length = int(v)
            elif k == b"transfer-encoding":
                chunked = v.strip().lower() == b"chunked"
            elif k == b"connection":
                close = v.strip().lower() == b"close"
        if status < 200 or status in (204, 304):
            body = b""
        elif chunked:
            body = self._chunks()
        elif length is not None:
            body = f.read(length) if length else b""
            if len(body) < length:
                raise ConnectionError("the server closed the connection in the body")
        else:
            body, close = f.read(), True
        return HttpResponse(status, lines, body, close)

    def _chunks(self):
        f = self.f
        parts = []
        while True:
            line = f.readline()
            if not line:
                raise ConnectionError("the server closed the connection in the body")
            n = int(line.split(b";")[0].strip(), 16)
            if n == 0:
                while f.readline() not in (b"\r\n", b"\n", b""):
                    pass                # trailers
                return b"".join(parts)
            parts.append(f.read(n))
            f.read(2)

    def get(self, path, headers=None):
        """GET `path` (headers: see http_request); the HttpResponse."""
        self.send(http_request(path, headers))
        return self.read()

    def statuses(self, paths, headers=None, batch=512):
        """GET every path, pipelined: a batch sent while the previous one's
        responses are read; their statuses."""
        out = []
        pending = 0
        for i in range(0, len(paths), batch):
            chunk = paths[i:i + batch]
            self.send(b"".join(http_request(p, headers) for p in chunk))
            out.extend(self.read().status for _ in range(pending))
            pending = len(chunk)
        out.extend(self.read().status for _ in range(pending))
        return out

    def close(self):
        for x in (self.f, self.sock):
            if x is not None:
                try:
                    x.close()
                except OSError:
                    pass
        self.sock = self.f = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def http_get(port, path, headers=None, timeout=2.0):
    """GET over a fresh connection (``Connection: close``), the response read
    to the close within `timeout` s in all.  Returns (status, headers, body,
    elapsed) with headers = {lower-case name: [values]} and the body as sent
    (chunks not decoded); raises OSError/ValueError on connection errors,
    timeouts or malformed responses."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    s = socket.create_connection((HOST, port), timeout=timeout)
    try:
        s.sendall(http_request(path, headers, close=True))
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
    lines = head.split(b"\r\n")
    r = HttpResponse(_status(lines[0]), lines[1:], body, True)
    return r.status, r.headers, body, elapsed


# --------------------------------------------------------------------------
# servers: what redis-server and nginx share
# --------------------------------------------------------------------------


class _Server:
    """One server process of ours, run in the foreground in its own session
    (a Ctrl-C in the terminal reaches only us: we stop it, by its PID), its
    stdout/stderr in a file, in the caller's registry (if any) while it may
    run.  Subclasses define stop(quick=...)."""

    popen = None
    registry = None

    def __repr__(self):
        return "<%s pid %s port %s>" % (type(self).__name__, self.pid, getattr(self, "port", None))

    @property
    def pid(self):
        return self.popen.pid if self.popen else None

    @property
    def running(self):
        return self.popen is not None and self.popen.poll() is None

    def _spawn(self, argv, out_path, out_mode="ab", cwd=None):
        with open(out_path, out_mode) as out:
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                          stderr=subprocess.STDOUT, cwd=cwd,
                                          start_new_session=True)
        if self.registry is not None:
            self.registry.add(self)

    def _wait_ready(self, ready, timeout, not_ready_msg):
        """wait_for(ready); if it fails or raises, stop the server first."""
        try:
            if not wait_for(ready, timeout, 0.02):
                raise RuntimeError(not_ready_msg)
        except BaseException:
            self.stop(quick=True)
            raise

    def _forget(self):
        if self.registry is not None:
            self.registry.discard(self)


# --------------------------------------------------------------------------
# redis-server
# --------------------------------------------------------------------------


def commandstats_of(info_text):
    """The text of INFO commandstats as {command: {calls: n, usec: n, ...}}."""
    stats = {}
    for line in info_text.splitlines():
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


def commands_in(stats, own=("info",)):
    """Commands a client sent, from `commandstats_of`: calls and
    rejected_calls (a command Redis refuses before running it, OOM or
    CLUSTERDOWN, is not in total_commands_processed), but those in `own`."""
    return sum(int(d.get("calls", 0)) + int(d.get("rejected_calls", 0))
               for c, d in stats.items() if c not in own)


class RedisServer(_Server):
    """One redis-server of ours in the foreground, on 127.0.0.1:port, without
    persistence, its files (redis.log, a cluster node's nodes.conf) in `dir`.
    start() returns once it answers PING (or raises, having stopped it);
    stop() stops it by its PID; restart() keeps the port and the dir."""

    def __init__(self, dir, port=None, extra_args=(), password=None, binary=None, registry=None):
        self.dir = dir
        os.makedirs(dir, exist_ok=True)
        self.port = port or free_port()
        self.extra_args = list(extra_args)
        self.password = password
        if password is not None:
            self.extra_args += ["--requirepass", password]
        self.binary = binary or REDIS_SERVER
        self.registry = registry
        self.log = os.path.join(dir, "redis.log")
        self.out = os.path.join(dir, "redis.out")      # stdout/stderr (fatal config errors)

    @property
    def url(self):
        return "redis://%s:%d" % (HOST, self.port)

    def start(self, timeout=5.0):
        if self.running:
            return self
        self._spawn([self.binary, "--port", str(self.port), "--bind", HOST,
                     "--daemonize", "no", "--save", "", "--appendonly", "no",
                     "--protected-mode", "no", "--dir", self.dir,
                     "--logfile", self.log] + self.extra_args, self.out, cwd=self.dir)

        def ready():
            if self.popen.poll() is not None:
                raise RuntimeError("redis-server exited (%s) at start; log:\n%s"
                                   % (self.popen.returncode, self.log_tail()))
            try:
                r = self.cmd("PING", timeout=0.3, auth=False, raise_errors=False)
            except OSError:
                return False
            return not (isinstance(r, RedisError) and str(r).startswith("LOADING"))

        self._wait_ready(ready, timeout, "redis-server on port %d not ready within %.0fs"
                         % (self.port, timeout))
        return self

    def stop(self, quick=False, sig=signal.SIGTERM):
        """Stop it by its PID: `sig`, then SIGKILL after 3 s (1 s if quick)."""
        if self.popen is None:
            return
        stop_popen(self.popen, 1.0 if quick else 3.0, sig)
        self._forget()

    def restart(self):
        """Stop, then start again on the SAME port and dir."""
        self.stop()
        return self.start()

    def cmd(self, *args, timeout=3.0, auth=True, raise_errors=True):
        """One command on a fresh connection (AUTH first if it has a password
        and `auth`)."""
        return call(self.port, *args, password=self.password if auth else None,
                    timeout=timeout, raise_errors=raise_errors)

    def commandstats(self):
        """INFO commandstats as {command: {calls: n, usec: n, ...}}."""
        return commandstats_of(self.cmd("INFO", "commandstats"))

    def commands(self, own=("info",)):
        """Commands Redis ran or refused so far (`commands_in`), but those
        named in `own` (the caller's own: INFO, CLIENT LIST, ...)."""
        return commands_in(self.commandstats(), own)

    def log_tail(self, n=15):
        """The last lines of its log (and of its stdout/stderr, if any)."""
        parts = []
        for path in (self.log, self.out):
            try:
                with open(path, errors="replace") as f:
                    lines = f.readlines()[-n:]
            except OSError:
                continue
            if lines:
                parts.append("".join(lines))
        return "".join(parts) or "(no redis log)"


# --------------------------------------------------------------------------
# Redis Cluster
# --------------------------------------------------------------------------

# repl-diskless-sync-delay 0: a replica gets its first full sync at once (the
# default waits 5 s, and a replica that never synced refuses to fail over)
CLUSTER_NODE_ARGS = ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
                     "--shutdown-on-sigterm", "now", "--repl-diskless-sync-delay", "0"]


class RedisCluster:
    """A Redis Cluster of RedisServer nodes started with CLUSTER_NODE_ARGS on
    cluster_ports() (``RedisCluster.in_dir`` makes them).  start() starts
    them, runs ``redis-cli --cluster create ... --cluster-replicas 1`` and
    waits until every node is ok (or raises, having stopped them)."""

    def __init__(self, nodes):
        self.nodes = list(nodes)

    @classmethod
    def in_dir(cls, base, n=6, binary=None, registry=None, exclude=()):
        """n nodes, each in its own directory below `base`."""
        nodes = []
        for port in cluster_ports(n, exclude):
            d = os.path.join(base, "node-%d" % port)
            nodes.append(RedisServer(d, port, CLUSTER_NODE_ARGS, binary=binary, registry=registry))
        return cls(nodes)

    @property
    def ports(self):
        return [r.port for r in self.nodes]

    def node(self, port):
        return next(r for r in self.nodes if r.port == port)

    def start(self, create=True, timeout=20.0):
        """Start the nodes; `create` the cluster (not when the nodes come back
        with their nodes.conf); wait until it is ok."""
        try:
            for r in self.nodes:
                r.start()
            if create:
                self.create(timeout)
            if not self.wait_ok(timeout):
                raise RuntimeError("cluster not ok within %.0fs: %s" % (timeout, self.states()))
        except BaseException:
            self.stop_all(quick=True)
            raise
        return self

    def create(self, timeout=20.0):
        """redis-cli --cluster create: 3 masters with a replica each (for 6)."""
        argv = [REDIS_CLI, "--cluster", "create"] + ["%s:%d" % (HOST, p) for p in self.ports] + \
            ["--cluster-replicas", "1", "--cluster-yes"]
        try:
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RuntimeError("redis-cli --cluster create did not finish within %.0fs" % timeout)
        out = (p.stdout + p.stderr).decode("utf-8", "replace")
        if p.returncode != 0 or "All 16384 slots covered" not in out:
            raise RuntimeError("redis-cli --cluster create failed (%d): %s" % (p.returncode, out[-1500:]))

    def stop_all(self, quick=False):
        for r in self.nodes:
            r.stop(quick=quick)

    stop = stop_all     # as a server's

    def restart_all(self, timeout=20.0):
        """Start the nodes again on the same ports and dirs (nodes.conf kept:
        the cluster reforms); waits until it is ok."""
        return self.start(create=False, timeout=timeout)

    # -- state ---------------------------------------------------------------
    def info(self, port):
        """CLUSTER INFO of one node ("" if it does not answer)."""
        try:
            return self.node(port).cmd("CLUSTER", "INFO", timeout=0.5)
        except (OSError, RedisError):
            return ""

    def is_ok(self, port):
        i = self.info(port)
        return "cluster_state:ok" in i and "cluster_slots_ok:16384" in i

    def knows_all(self, port):
        m = re.search(r"cluster_known_nodes:(\d+)", self.info(port))
        return bool(m) and int(m.group(1)) >= len(self.nodes)

    def link_up(self, port):
        """A master, or a replica whose replication link is up."""
        try:
            i = self.node(port).cmd("INFO", "replication", timeout=0.5)
        except (OSError, RedisError):
            return False
        return "role:master" in i or "master_link_status:up" in i

    def states(self):
        """"port=state ..." of every node, for messages."""
        out = []
        for r in self.nodes:
            if not r.running:
                out.append("%d=stopped" % r.port)
            else:
                m = re.search(r"cluster_state:(\w+)", self.info(r.port))
                out.append("%d=%s" % (r.port, m.group(1) if m else "?"))
        return " ".join(out)

    def wait_ok(self, timeout):
        """Every running node says cluster_state:ok with all slots ok and
        knows every node, every replica is in sync with its master, and they
        agree on the slot map."""
        def ok():
            live = [r.port for r in self.nodes if r.running]
            if not all(self.is_ok(p) and self.knows_all(p) and self.link_up(p) for p in live):
                return False
            maps = set()
            for p in live:
                try:
                    maps.add(tuple(sorted((m["port"], tuple(m["slots"])) for m in self.masters(p))))
                except (OSError, RedisError):
                    return False
            return len(maps) == 1
        return wait_for(ok, timeout, 0.05)

    def cluster_nodes(self, port=None):
        """[{id, port, flags, master_id, slots: [(lo, hi)...]}] as `port` (by
        default the first running node) sees it."""
        if port is None:
            port = next(r.port for r in self.nodes if r.running)
        text = self.node(port).cmd("CLUSTER", "NODES", timeout=1.0)
        out = []
        for line in text.splitlines():
            f = line.split()
            if len(f) < 8:
                continue
            m = re.match(r"[^:]*:(\d+)@", f[1])
            slots = []
            for s in f[8:]:
                if s.startswith("["):
                    continue
                lo, _, hi = s.partition("-")
                slots.append((int(lo), int(hi or lo)))
            out.append({"id": f[0], "port": int(m.group(1)) if m else None, "flags": f[2].split(","),
                        "master_id": f[3], "slots": slots})
        return out

    def masters(self, port=None):
        """The masters that serve slots and are not failed, as `port` sees it."""
        return [n for n in self.cluster_nodes(port)
                if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"]]


# --------------------------------------------------------------------------
# nginx
# --------------------------------------------------------------------------


class NginxServer(_Server):
    """One nginx that we run in the foreground (``daemon off``: the master is
    our child) in its own prefix with conf/, logs/ and html/; the caller
    writes ``conf_path``.  start() returns once the port accepts and the
    workers run (or raises, having stopped it); reload() is SIGHUP, quit()
    SIGQUIT then SIGTERM/SIGKILL, all by PID; the workers it had are
    remembered (``seen``) so that none outlives a killed master."""

    def __init__(self, binary, prefix, port, workers=1, name="nginx", registry=None):
        self.binary = binary
        self.prefix = prefix
        self.port = port
        self.workers = workers
        self.name = name
        self.registry = registry
        for d in ("", "conf", "logs", "html"):
            os.makedirs(os.path.join(prefix, d), exist_ok=True)
            os.chmod(os.path.join(prefix, d), 0o755)     # the workers run as nobody
        self.conf_path = os.path.join(prefix, "conf", "nginx.conf")
        self.error_log = os.path.join(prefix, "logs", "error.log")
        self.stderr_path = os.path.join(prefix, "logs", "stderr.log")
        self.seen = {}              # worker pid -> starttime, over its whole life

    def argv(self, *extra):
        return [self.binary, "-p", self.prefix + "/", "-c", "conf/nginx.conf"] + list(extra)

    def test_config(self):
        """nginx -t -q; RuntimeError with its output if the config is bad."""
        p = subprocess.run(self.argv("-t", "-q"), stdin=subprocess.DEVNULL,
                           capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise RuntimeError("nginx -t failed for %s:\n%s" % (self.name, p.stderr))

    def worker_pids(self):
        """{pid: starttime} of the master's live children."""
        if not self.running:
            return {}
        kids = children(self.popen.pid)
        self.seen.update(kids)
        return kids

    def start(self, timeout=5.0):
        self._spawn(self.argv("-g", "daemon off;"), self.stderr_path, "wb")

        def up():
            if self.popen.poll() is not None:
                raise RuntimeError("nginx %s exited (%s) at start:\n%s\n%s" % (
                    self.name, self.popen.returncode, self.stderr_text(), self.error_log_tail()))
            return port_accepts(self.port) and len(self.worker_pids()) >= self.workers

        self._wait_ready(up, timeout, "nginx %s not accepting on %d with %d workers within %.0fs"
                         % (self.name, self.port, self.workers, timeout))
        return self

    def reload(self, timeout=5.0):
        """SIGHUP the master; wait for the new workers and for the old ones to
        exit.  Returns {"old": [...], "new": [...], "old_gone_after": s|None,
        "still_alive": [...]} ("new" empty if they did not all come)."""
        old = self.worker_pids()
        t0 = time.monotonic()
        self.popen.send_signal(signal.SIGHUP)

        def new_workers():
            new = [p for p in self.worker_pids() if p not in old]
            return new if len(new) >= self.workers else None

        new = wait_for(new_workers, timeout)
        gone = wait_for(lambda: not any(same_process_alive(p, st) for p, st in old.items()),
                        max(0.0, timeout - (time.monotonic() - t0)), 0.01)
        return {"old": sorted(old), "new": sorted(new or []),
                "old_gone_after": (time.monotonic() - t0) if gone else None,
                "still_alive": sorted(p for p, st in old.items() if same_process_alive(p, st))}

    def quit(self, grace=5.0):
        """SIGQUIT the master; returns the seconds until it exited (if it did
        not within `grace`, it is SIGTERMed/SIGKILLed and the returned figure
        is the total time, > grace).  Workers left behind are SIGKILLed."""
        if self.popen is None:
            return 0.0
        exited = self.popen.poll() is not None
        self.worker_pids()
        t0 = time.monotonic()
        secs, _ = stop_nginx(self.popen, grace, then=(signal.SIGTERM, signal.SIGKILL),
                             workers=self.seen)
        self._forget()
        if exited:
            return 0.0
        return secs if secs is not None else time.monotonic() - t0

    def stop(self, quick=False):
        self.quit(grace=1.0 if quick else 5.0)

    def error_log_text(self):
        return _read_text(self.error_log)

    def error_log_tail(self, n=25):
        return "\n".join(self.error_log_text().splitlines()[-n:])

    def stderr_text(self):
        return _read_text(self.stderr_path)


def _read_text(path):
    """A log file's text ("" if there is none)."""
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""
