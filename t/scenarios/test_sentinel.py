"""Redis Sentinel: `redis=` lists sentinels and `sentinel=name`
names the master they watch. 1 master + 1 replica + 3 sentinels on
loopback; the master is killed under traffic, the sentinels promote the
replica, and the module follows: counting (background and strict) resumes
on the new master within the failover time plus the backoff's cap, no
request waits, no worker crashes.
"""

import os
import signal
import threading
import time

from harness import HOST, Redis, free_port, wait_for

DOWN_AFTER_MS = 1000
# the master and the replica need it; the sentinels of most tests do not
# (a sentinel is asked without credentials first, the master with the URL's)
PASSWORD = "s3n/tin@l"


class Sentinel(Redis):
    """A redis-server in sentinel mode: its config file (which it rewrites)
    in its own dir, given first on the command line; stopped by its PID like
    every server of the test."""

    def __init__(self, ctx, master_port, tls=None, requirepass=None, ca=None):
        super().__init__(ctx)
        self.tls = tls
        self.ca = ca
        # a sentinel protected by a password (and asking the other
        # sentinels with it); cmd() authenticates with it
        self.password = requirepass
        self.conf = os.path.join(self.dir, "sentinel.conf")
        if tls:
            # TLS only (port 0: no plain port), and TLS to the master; with
            # `ca`, client certificates of that CA are required (Redis's
            # default), and its own certificate is its client certificate
            cert, key = tls
            listen = ("port 0\ntls-port %d\ntls-cert-file %s\ntls-key-file %s\n"
                      "tls-ca-cert-file %s\ntls-auth-clients %s\ntls-replication yes\n"
                      % (self.port, cert, key, ca or cert, "yes" if ca else "no"))
        else:
            listen = "port %d\n" % self.port
        with open(self.conf, "w") as f:
            f.write("%sbind %s\ndir %s\nlogfile %s\n"
                    "sentinel monitor mymaster %s %d 2\n"
                    "sentinel auth-pass mymaster %s\n"
                    "sentinel down-after-milliseconds mymaster %d\n"
                    "sentinel failover-timeout mymaster 3000\n"
                    "sentinel parallel-syncs mymaster 1\n"
                    % (listen, HOST, self.dir, self.log, HOST, master_port, PASSWORD,
                       DOWN_AFTER_MS))
            if requirepass:
                f.write("requirepass \"%s\"\nsentinel sentinel-pass \"%s\"\n" % (requirepass, requirepass))

    def start(self, timeout=5.0):
        self._spawn([self.binary, self.conf, "--sentinel"], self.out, cwd=self.dir)
        ready = (lambda: tls_ping(self.port, self.tls if self.ca else None)) if self.tls else self._pings
        self._wait_ready(ready, timeout, "sentinel on %d not ready" % self.port)
        return self

    def _pings(self):
        try:
            return self.cmd("PING", timeout=0.3) == "PONG"
        except OSError:
            return False

    def master(self):
        try:
            host, port = self.cmd("SENTINEL", "get-master-addr-by-name", "mymaster", timeout=0.5)
            return int(port)
        except (OSError, TypeError, ValueError):
            return None


def start_servers(h, sentinel_pass=None):
    auth = ["--masterauth", PASSWORD, "--repl-diskless-sync-delay", "0"]
    master = h.redis(extra_args=auth, password=PASSWORD)
    replica = h.redis(extra_args=auth + ["--replicaof", HOST, str(master.port)], password=PASSWORD)
    h.check(wait_for(lambda: "master_link_status:up" in replica.cmd("INFO", "replication"), 10.0),
            "the replica did not sync")
    sentinels = []
    for _ in range(3):
        s = Sentinel(h, master.port, requirepass=sentinel_pass)
        h.procs.append(s)
        sentinels.append(s.start())
    h.check(wait_for(lambda: all(s.master() == master.port for s in sentinels), 5.0),
            "the sentinels do not all name the master")
    # each sentinel must know the others and the replica before a failover
    h.check(wait_for(lambda: all(s.cmd("SENTINEL", "replicas", "mymaster") for s in sentinels)
                     and all(len(s.cmd("SENTINEL", "sentinels", "mymaster")) == 2 for s in sentinels),
                     15.0, 0.1),
            "the sentinels did not find the replica and each other")
    return master, replica, sentinels


def count(r, pattern):
    try:
        return sum(int(r.cmd("GET", k, timeout=0.5) or 0) for k in r.cmd("KEYS", pattern, timeout=0.5))
    except OSError:
        return None


def test_master_killed_failover_followed(h):
    """SIGKILL of the master under ~100 req/s (a background key and a strict
    one), the master and replica behind a password given in the URLs
    (percent-encoded; these sentinels need none): every answer is 200 and quick (none waits past timeout=); once the
    sentinels have promoted the replica, new counts land on it within the
    failover time + 5 s (the backoff's cap); no [alert], no crash."""
    master, replica, sentinels = start_servers(h)
    # percent-encoded in the URL; the sentinels need none, the master gets it
    urls = ",".join("redis://:s3n%%2Ftin%%40l@%s:%d" % (HOST, s.port) for s in sentinels)
    http = ("    redis_ratelimit_zone $arg_k zone=sn:1m redis=%s sentinel=mymaster "
            "hold=0 timeout=300ms;\n" % urls)
    server = ("        location = /b { redis_ratelimit sn 1000000r/h; }\n"
              "        location = /s { redis_ratelimit sn 1000000r/h strict; }\n")
    ng = h.nginx(http, server, files={"b": "ok\n", "s": "ok\n"})
    kb, ks = h.key("bg"), h.key("st")
    for path in ("/b?k=" + kb, "/s?k=" + ks):
        h.check(ng.get(path)[0] == 200, "a first request through the master")
    h.check(wait_for(lambda: count(master, "rl:{sn:%s}:*" % kb) == 1, 3.0), "counted on the master")

    stop = threading.Event()
    answers = []

    def traffic():
        while not stop.is_set():
            for path in ("/b?k=" + kb, "/s?k=" + ks):
                answers.append(ng.get(path, timeout=3.0))
            time.sleep(0.02)

    t = threading.Thread(target=traffic)
    t.start()
    try:
        time.sleep(1.0)
        master.stop(quick=True, sig=signal.SIGKILL)
        t_kill = time.monotonic()
        promoted = resumed_b = resumed_s = None
        base_b = count(replica, "rl:{sn:%s}:*" % kb) or 0
        base_s = count(replica, "rl:{sn:%s}:*" % ks) or 0
        while time.monotonic() - t_kill < 20.0 and (resumed_b is None or resumed_s is None):
            now = time.monotonic() - t_kill
            if promoted is None and all(s.master() == replica.port for s in sentinels):
                promoted = now
            if promoted is not None:
                if resumed_b is None and (count(replica, "rl:{sn:%s}:*" % kb) or 0) > base_b + 5:
                    resumed_b = now
                if resumed_s is None and (count(replica, "rl:{sn:%s}:*" % ks) or 0) > base_s + 5:
                    resumed_s = now
            time.sleep(0.05)
        time.sleep(0.5)
    finally:
        stop.set()
        t.join(30)
    statuses = [st for st, _ in answers]
    slowest = max(el for _, el in answers)
    h.note("failover: %d answers during the test, statuses %s, slowest %.0f ms; sentinels "
           "promoted the replica %.1f s after the kill; counts resumed on it after %s s "
           "(background) and %s s (strict)"
           % (len(answers), sorted(set(statuses), key=str), slowest * 1000, promoted or -1,
              resumed_b and round(resumed_b, 1), resumed_s and round(resumed_s, 1)))
    h.check(set(statuses) == {200}, "every request answered 200: %s" % sorted(set(statuses), key=str))
    h.check(slowest < 0.3 + 0.1, "no request waited past timeout=300ms: %.0f ms" % (slowest * 1000))
    h.check(promoted is not None, "the sentinels promoted the replica")
    h.check(resumed_b is not None and resumed_b <= promoted + 5.5,
            "background counts resume on the new master within 5 s of the promotion: %s" % resumed_b)
    h.check(resumed_s is not None and resumed_s <= promoted + 5.5,
            "strict counts resume on the new master within 5 s of the promotion: %s" % resumed_s)
    log = ng.error_log_text()
    h.check("[alert]" not in log and "[crit]" not in log and "exited on signal" not in log,
            "no worker crashed")
    h.check(PASSWORD not in log and "s3n%2Ftin%40l" not in log, "the password is never logged")


def _counts_through_protected_sentinels(h, sentinel_pass, urls_pass, params):
    master, _replica, sentinels = start_servers(h, sentinel_pass=sentinel_pass)
    urls = ",".join("redis://:%s@%s:%d" % (urls_pass, HOST, s.port) for s in sentinels)
    http = ("    redis_ratelimit_zone $arg_k zone=sp:1m redis=%s sentinel=mymaster %s hold=0 "
            "timeout=300ms;\n" % (urls, params))
    server = ("        location = /b { redis_ratelimit sp 3r/m; }\n"
              "        location = /s { redis_ratelimit sp 3r/m strict; }\n"
              "        location = /metrics { redis_ratelimit_metrics; }\n")
    ng = h.nginx(http, server, files={"b": "ok\n", "s": "ok\n"})
    h.wait_minute_room(5)
    kb, ks = h.key("b"), h.key("s")
    b = [ng.get("/b?k=" + kb)[0] for _ in range(2)]
    st = [ng.get("/s?k=" + ks)[0] for _ in range(4)]
    landed = wait_for(lambda: count(master, "rl:{sp:%s}:*" % kb) == 2, 3.0)
    log = ng.error_log_text()
    h.note("sentinels with requirepass: background %s, strict %s; on the master: %s and %s"
           % (b, st, count(master, "rl:{sp:%s}:*" % kb), count(master, "rl:{sp:%s}:*" % ks)))
    h.check(landed, "background counts reach the master named by protected sentinels")
    h.check(st == [200, 200, 200, 429] and count(master, "rl:{sp:%s}:*" % ks) == 3,
            "strict decided on the master: %s" % st)
    h.check("NOAUTH" not in log, "no NOAUTH in the log")
    h.check(sentinel_pass not in log and PASSWORD not in log, "no password is logged")


def test_sentinels_protected_by_the_masters_password(h):
    """Sentinels with `requirepass` equal to the master's password: the URL's
    credentials, refused as missing (NOAUTH) at first, are given to the
    sentinels too; counts land on the master, strict is decided there."""
    _counts_through_protected_sentinels(h, PASSWORD, "s3n%2Ftin%40l", "")


def test_sentinels_with_a_password_of_their_own(h):
    """Sentinels with a password of their own (`sentinel_password=`), the
    master's in the URLs: both are used where they belong."""
    _counts_through_protected_sentinels(h, "watch/er:pw", "s3n%2Ftin%40l",
                                        "sentinel_password=watch/er:pw")


def test_sentinel_over_tls(h):
    """`rediss://...#insecure` URLs with `sentinel=`: the sentinel (TLS port
    only) is asked over TLS, and names the master's TLS port, which the
    module reaches over TLS with the URL's settings: counts land on the
    master (read back on its plain port)."""
    from test_tls import make_cert

    cert, key = make_cert(h.tmp)
    tls = ["--tls-cert-file", cert, "--tls-key-file", key, "--tls-ca-cert-file", cert,
           "--tls-auth-clients", "no"]
    master_tls = free_port()
    master = h.redis(extra_args=["--tls-port", str(master_tls)] + tls)
    s = Sentinel(h, master_tls, tls=(cert, key))
    h.procs.append(s)
    s.start()
    http = ("    redis_ratelimit_zone $arg_k zone=st:1m redis=rediss://%s:%d/#insecure "
            "sentinel=mymaster hold=0;\n" % (HOST, s.port))
    server = ("        location = /b { redis_ratelimit st 3r/m; }\n"
              "        location = /s { redis_ratelimit st 3r/m strict; }\n")
    ng = h.nginx(http, server, files={"b": "ok\n", "s": "ok\n"})
    h.wait_minute_room(5)
    kb, ks = h.key("b"), h.key("s")
    b = [ng.get("/b?k=" + kb)[0] for _ in range(2)]
    st = [ng.get("/s?k=" + ks)[0] for _ in range(4)]
    landed = wait_for(lambda: count(master, "rl:{st:%s}:*" % kb) == 2, 3.0)
    h.note("over TLS through a TLS sentinel: background %s, strict %s; on the master: %s and %s"
           % (b, st, count(master, "rl:{st:%s}:*" % kb), count(master, "rl:{st:%s}:*" % ks)))
    h.check(landed, "background counts reach the master over TLS")
    h.check(st == [200, 200, 200, 429] and count(master, "rl:{st:%s}:*" % ks) == 3,
            "strict decided on the master over TLS: %s" % st)


def tls_ping(port, client=None):
    """PING over TLS, unverified; `client`: (cert, key) to present."""
    import socket
    import ssl
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    if client:
        ctx.load_cert_chain(*client)
    try:
        with socket.create_connection((HOST, port), timeout=0.5) as raw:
            with ctx.wrap_socket(raw) as t:
                t.sendall(b"PING\r\n")
                return t.recv(16).startswith(b"+PONG")
    except OSError:
        return False
