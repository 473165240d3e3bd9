"""Strict links: a worker sends its strict requests' script calls down a
connection of its own, on its event loop (no hand-off to the Redis thread
on the request's path). The link is named in CLIENT LIST; a link killed
under traffic loses and doubles nothing (the thread takes the calls, a new
link follows); a server that forgot the script (SCRIPT FLUSH) answers
NOSCRIPT, and those calls go through the thread, which loads it again; a
server that answers with bytes that are not RESP gets the link dropped; a
server far away (every reply held back) keeps its link while it answers.
A turn of the event loop that reads many requests sends their calls as
it goes, not all at its end.
"""

import hashlib
import json
import os
import queue
import signal
import socket
import threading
import time

from harness import HOST, proc_stat, wait_for
from servers import HttpConn

LINK_NAME = "ngx_redis_ratelimit_strict"

HTTP = """
    redis_ratelimit_zone $arg_k zone=s:1m redis=%s timeout=1s;
    redis_ratelimit_zone $arg_k zone=b:1m redis=%s;
"""
SERVER = """
        location = /strict { redis_ratelimit s 100r/m strict; }
        location = /one    { redis_ratelimit s 5r/m strict; }
        location = /bg     { redis_ratelimit b 100r/m; }
        location = /metrics { redis_ratelimit_metrics; }
"""
FILES = {"strict": "ok\n", "one": "ok\n", "bg": "ok\n"}


def clients(r):
    """CLIENT LIST as a list of {field: value}."""
    out = []
    for line in r.cmd("CLIENT", "LIST").splitlines():
        out.append(dict(kv.split("=", 1) for kv in line.split() if "=" in kv))
    return out


def links(r):
    return [c for c in clients(r) if c.get("name") == LINK_NAME]


def calls(r, cmd):
    return int(r.commandstats().get(cmd, {}).get("calls", 0))


def strict_figures(n):
    return json.loads(n.request("/metrics?format=json")[2])["zones"]["s"]["redis"]["strict"]


def count(r, key):
    return sum(int(r.cmd("GET", k) or 0) for k in r.keys("rl:{s:%s}:60:*" % key))


def test_strict_calls_go_down_the_workers_own_link(h):
    """Two workers, one strict zone and one background zone: one link per
    worker for the strict zone (none for the other), and every EVALSHA runs
    on a link, none on the threads' connections. Keys whose requests come
    in the same turn of the event loop share a call: at most one call per
    key, each key counted once."""
    r = h.redis()
    n = h.nginx(HTTP % (r.url, r.url), SERVER, workers=2, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 2, 3.0), "one link per worker: %s" % links(r))
    h.wait_minute_room(10)
    before = calls(r, "evalsha")
    sts = n.burst(["/strict?k=" + h.key("l%d" % i) for i in range(40)], threads=8, timeout=5.0)
    n.get("/bg?k=" + h.key("bg"))
    evalsha = calls(r, "evalsha") - before
    by_name = {}
    for c in clients(r):
        if c.get("cmd") == "evalsha":
            by_name[c.get("name", "")] = by_name.get(c.get("name", ""), 0) + 1
    h.note("40 strict requests on 40 keys: %d x 200, %d EVALSHA; clients whose last command "
           "was EVALSHA, by name: %s; links: %d" % (sts.count(200), evalsha, by_name, len(links(r))))
    h.check(sts == [200] * 40, "all pass: %s" % sts)
    h.check(1 <= evalsha <= 40, "at most one script call per key: %d" % evalsha)
    counts = [count(r, h.key("l%d" % i)) for i in range(40)]
    h.check(counts == [1] * 40, "each key counted once: %s" % counts)
    h.check(set(by_name) == {LINK_NAME}, "EVALSHA ran on the links only: %s" % by_name)
    h.check(len(links(r)) == 2, "still one link per worker")
    h.check(strict_figures(n)["timeouts"] == 0, "no strict request was decided by on_error")


def test_a_long_turn_writes_calls_early_while_few_are_out(h):
    """60 requests on 60 keys read in one turn of the event loop (the
    worker stopped while they come, then let go): a call goes out as soon
    as six keys can go, not at the end of the turn, while fewer than eight
    calls are out; the twelve keys read after that go in one call at the
    end of the turn. 9 script calls: 8 of 6 keys, 1 of 12 (1 call if every
    key waited for the end of the turn, 10 without the bound on calls
    out); each key counted once."""
    r = h.redis()
    n = h.nginx(HTTP % (r.url, r.url), SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "a link: %s" % links(r))
    h.wait_minute_room(10)
    conns = [HttpConn(n.port, timeout=5.0, nodelay=True) for _ in range(60)]
    pid = None
    try:
        for i, c in enumerate(conns):
            h.check(c.get("/strict?k=" + h.key("warm%d" % i)).status == 200, "warm-up %d" % i)
        pid = next(iter(n.worker_pids()))
        before = calls(r, "evalsha")
        os.kill(pid, signal.SIGSTOP)
        h.check(wait_for(lambda: (proc_stat(pid) or ("?",))[0] == "T", 3.0), "worker stopped")
        keys = [h.key("turn%d" % i) for i in range(60)]
        for c, k in zip(conns, keys):
            c.send(b"GET /strict?k=%s HTTP/1.1\r\nHost: x\r\n\r\n" % k.encode())
        time.sleep(0.2)
        os.kill(pid, signal.SIGCONT)
        pid = None
        sts = [c.read().status for c in conns]
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        for c in conns:
            c.close()
    evalsha = calls(r, "evalsha") - before
    counts = [count(r, k) for k in keys]
    h.note("60 requests read in one turn: %d script calls; statuses %s" % (evalsha, set(sts)))
    h.check(sts == [200] * 60, "all pass: %s" % sts)
    h.check(evalsha == 9, "8 early calls of 6 keys, then one of 12: %d calls" % evalsha)
    h.check(counts == [1] * 60, "each key counted once: %s" % counts)


def test_keys_of_another_type_among_many_fail_alone(h):
    """Strict requests on 30 keys at once, 6 of whose counters are lists
    (someone else's keys): in a call shared with other keys, such a key
    fails alone (called again alone through the thread, which logs its
    WRONGTYPE); every other key is counted exactly once per request, and
    the lists are left as they were."""
    r = h.redis()
    n = h.nginx(HTTP % (r.url, r.url), SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "a link: %s" % links(r))
    h.wait_minute_room(10)
    window = int(time.time()) // 60 * 60
    keys = [h.key("t%d" % i) for i in range(30)]
    lists = keys[::5]
    for k in lists:
        r.cmd("RPUSH", "rl:{s:%s}:60:%d" % (k, window), "x")
    before = calls(r, "evalsha")
    sts = n.burst(["/strict?k=" + k for k in keys for _ in range(2)], threads=16, timeout=5.0)
    evalsha = calls(r, "evalsha") - before
    good = [count(r, k) for k in keys if k not in lists]
    kept = [int(r.cmd("LLEN", "rl:{s:%s}:60:%d" % (k, window))) for k in lists]
    log = n.error_log_text()
    h.note("60 requests on 30 keys, 6 of them lists: %d EVALSHA; statuses %s; counts %s"
           % (evalsha, sorted(set(sts)), sorted(set(good))))
    h.check(len(sts) == 60 and all(st in (200, 429) for st in sts), "all answered: %s" % sts)
    h.check(good == [2] * 24, "every other key counted once per request: %s" % good)
    h.check(kept == [1] * 6, "the lists are left as they were: %s" % kept)
    h.check("WRONGTYPE" in log, "the error is logged")
    h.check(links(r) != [], "the link stays")


def test_a_link_killed_under_traffic_loses_and_doubles_nothing(h):
    """The link is killed (CLIENT KILL) between requests of a key: every
    request is still decided by Redis (none by on_error), Redis counts
    each exactly once, and a new link follows within a few seconds."""
    r = h.redis()
    n = h.nginx(HTTP % (r.url, r.url), SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "a link: %s" % links(r))
    h.wait_minute_room(15)
    k = h.key("killed")
    first = [n.get("/strict?k=" + k)[0] for _ in range(20)]
    old = links(r)[0]["id"]
    r.cmd("CLIENT", "KILL", "ID", old)
    then = [n.get("/strict?k=" + k)[0] for _ in range(20)]
    back = wait_for(lambda: len(links(r)) == 1 and links(r)[0]["id"] != old, 4.0)
    before = calls(r, "evalsha")
    last = [n.get("/strict?k=" + k)[0] for _ in range(5)]
    on_link = [c for c in links(r) if c.get("cmd") == "evalsha"]
    in_redis = count(r, k)
    log = n.error_log_text()
    h.note("20 requests, link killed, 20 more, %s; then 5 (%d EVALSHA, on the new link: %s); "
           "Redis counts %d; strict figures %s"
           % ("a new link" if back else "NO new link", calls(r, "evalsha") - before,
              bool(on_link), in_redis, strict_figures(n)))
    h.check(first + then + last == [200] * 45, "all 45 pass: %s" % (first + then + last))
    h.check(in_redis == 45, "Redis counts each request once: %d" % in_redis)
    h.check(strict_figures(n)["timeouts"] == 0, "none was decided by on_error")
    h.check(back, "a new link within 4 s")
    h.check(bool(on_link), "the new link carries the calls")
    # killed between requests, with nothing out: no request was affected,
    # so it is an info line, not an error
    h.check("Redis closed the strict link" in log, "the lost link is logged")
    h.check("strict link to Redis failed" not in log, "not as an error: nothing was out")
    h.check("[alert]" not in log and "panicked" not in log, "no worker crashed")


def test_redis_idle_timeout_closing_the_link_is_not_an_error(h):
    """Redis's own `timeout 1` closes the idle strict link between
    requests: no error line, no transport error counted, the backend stays
    up, and the next strict requests are decided by Redis on a new link
    (none by on_error)."""
    r = h.redis()
    r.cmd("CONFIG", "SET", "timeout", "1")
    n = h.nginx(HTTP % (r.url, r.url), SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "a link: %s" % links(r))
    h.wait_minute_room(15)
    k = h.key("idle")
    first = [n.get("/one?k=" + k)[0] for _ in range(2)]
    old = links(r)[0]["id"]
    # Redis closes clients idle for more than `timeout` seconds
    closed = wait_for(lambda: all(c["id"] != old for c in links(r)), 6.0)
    then = [n.get("/one?k=" + k)[0] for _ in range(5)]
    back = wait_for(lambda: len(links(r)) == 1, 4.0)
    log = n.error_log_text()
    m = json.loads(n.request("/metrics?format=json")[2])["zones"]["s"]["redis"]
    h.note("2 requests, the link closed by Redis's timeout: %s; 5 more: %s; new link: %s; "
           "figures %s" % (closed, then, back, m))
    h.check(closed, "Redis closed the idle link within 6 s")
    h.check(first + then == [200] * 5 + [429] * 2, "5r/m decided exactly: %s" % (first + then))
    h.check("Redis closed the strict link" in log, "the close is logged at info")
    errors = [l for l in log.splitlines() if "[error]" in l and "redis_ratelimit:" in l]
    h.check(not errors, "no error line about Redis: %s" % errors)
    h.check(m["errors"]["transport"] == 0, "no transport error counted: %s" % m["errors"])
    h.check(m["strict"]["timeouts"] == 0, "no strict request decided by on_error")
    h.check(back, "a new link within 4 s")
    r.cmd("CONFIG", "SET", "timeout", "0")


def test_a_server_that_forgot_the_script_answers_through_the_thread(h):
    """SCRIPT FLUSH: the link's EVALSHA gets NOSCRIPT (it did not run); the
    call goes to the thread, which calls again with the script's text
    (EVAL, which leaves the script in the server's cache), so
    the decision stays exact (5r/m: 5 pass, 2 do not) and no request is
    decided by on_error; the link keeps working after."""
    r = h.redis()
    n = h.nginx(HTTP % (r.url, r.url), SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "a link")
    h.wait_minute_room(10)
    loads = calls(r, "eval")
    r.cmd("SCRIPT", "FLUSH")
    k = h.key("flushed")
    got = [n.get("/one?k=" + k)[0] for _ in range(7)]
    loaded = calls(r, "eval") - loads
    link_id = links(r)[0]["id"] if links(r) else None
    before = calls(r, "evalsha")
    more = [n.get("/strict?k=" + h.key("after%d" % i))[0] for i in range(3)]
    after = [c for c in links(r) if c.get("cmd") == "evalsha"]
    h.note("after SCRIPT FLUSH, 7 requests on 5r/m: %s; EVAL %d time(s); then 3 more: %s "
           "(%d EVALSHA, last on the link: %s); Redis counts %d"
           % (got, loaded, more, calls(r, "evalsha") - before, bool(after), count(r, k)))
    h.check(got == [200] * 5 + [429] * 2, "exact: %s" % got)
    h.check(count(r, k) == 5, "Redis counts 5")
    h.check(loaded >= 1, "the thread called the script by its text")
    h.check(strict_figures(n)["timeouts"] == 0, "none was decided by on_error")
    h.check(more == [200] * 3 and bool(after) and links(r)[0]["id"] == link_id,
            "the same link goes on: %s" % more)


class Loopback:
    """A server on a loopback port that serves each connection in a thread
    of its own (`serve`); `close` ends them all."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.conns = []
        self.stop = False
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while not self.stop:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(c)
            threading.Thread(target=self.serve, args=(c,), daemon=True).start()

    def serve(self, c):
        raise NotImplementedError

    def close(self):
        self.stop = True
        self.sock.close()
        for c in self.conns:
            try:
                c.close()
            except OSError:
                pass


class FakeRedis(Loopback):
    """A loopback server that speaks enough RESP for the module's
    handshakes (PING, CLIENT, SELECT, AUTH: OK; ROLE: master; SCRIPT LOAD:
    the script's SHA1) and answers every EVALSHA with bytes that are not RESP at all."""

    def __init__(self):
        self.names = 0
        self.evalsha = 0
        super().__init__()

    def serve(self, c):
        f = c.makefile("rb")
        try:
            while True:
                head = f.readline()
                if not head.startswith(b"*"):
                    return
                words = []
                for _ in range(int(head[1:])):
                    n = int(f.readline()[1:])
                    words.append(f.read(n + 2)[:-2])
                cmd = words[0].upper()
                if cmd == b"SCRIPT":
                    sha = hashlib.sha1(words[2]).hexdigest().encode()
                    c.sendall(b"$40\r\n" + sha + b"\r\n")
                elif cmd == b"EVALSHA":
                    self.evalsha += 1
                    c.sendall(b"?this is not RESP\r\n")
                elif cmd == b"PING":
                    c.sendall(b"+PONG\r\n")
                elif cmd == b"ROLE":
                    c.sendall(b"*3\r\n$6\r\nmaster\r\n:0\r\n*0\r\n")
                else:
                    if cmd == b"CLIENT" and words[1].upper() == b"SETNAME":
                        self.names += 1
                    c.sendall(b"+OK\r\n")
        except (OSError, ValueError, IndexError):
            return
        finally:
            c.close()


def test_a_link_that_reads_garbage_is_dropped(h):
    """A server that answers EVALSHA with bytes that are not RESP: the link
    is dropped at once (its request decided by on_error=deny, no wait for
    timeout=), the worker goes on serving, the failure is logged, and a new
    link is made after the backoff."""
    fake = FakeRedis()
    try:
        url = "redis://%s:%d" % (HOST, fake.port)
        http = ("    redis_ratelimit_zone $arg_k zone=s:1m redis=%s timeout=1s on_error=deny;\n"
                "    redis_ratelimit_zone $arg_k zone=b:1m redis=%s;\n" % (url, url))
        n = h.nginx(http, SERVER, files=FILES)
        h.check(wait_for(lambda: fake.names >= 1, 3.0), "a link was made: %d" % fake.names)
        t0 = time.monotonic()
        st = n.get("/strict?k=" + h.key("garbage"))[0]
        el = time.monotonic() - t0
        bg = n.get("/bg?k=" + h.key("bg"))[0]
        again = wait_for(lambda: fake.names >= 2, 5.0)
        log = n.error_log_text()
        h.note("a strict request on a link that reads garbage: %s in %.0f ms; a background "
               "request then: %s; links made: %d; EVALSHA seen: %d"
               % (st, el * 1000, bg, fake.names, fake.evalsha))
        h.check(st == 429 and el < 0.5, "decided by on_error=deny at once: %s in %.0f ms" % (st, el * 1000))
        h.check(bg == 200, "the worker goes on serving")
        h.check("strict link to Redis failed: not a Redis reply" in log, "the failure is logged")
        h.check(again, "a new link after the backoff: %d made" % fake.names)
        h.check("[alert]" not in log and "signal 11" not in log and "panicked" not in log,
                "no worker crashed")
    finally:
        fake.close()


def test_a_master_that_became_a_replica_drops_the_link(h):
    """The link's server becomes a replica (REPLICAOF): the script's write
    is refused with READONLY. The call did not count anything: it goes to
    the thread, which refuses it too and logs it (on_error=deny: 429); the
    link is dropped, not used again while the server does not serve. Once
    it is a master again, a new link carries exact decisions."""
    other = h.redis()
    r = h.redis()
    http = ("    redis_ratelimit_zone $arg_k zone=s:1m redis=%s timeout=1s on_error=deny;\n"
            "    redis_ratelimit_zone $arg_k zone=b:1m redis=%s;\n" % (r.url, r.url))
    n = h.nginx(http, SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "a link")
    h.wait_minute_room(15)
    first = links(r)[0]["id"]
    r.cmd("REPLICAOF", HOST, str(other.port))
    t0 = time.monotonic()
    st = n.get("/one?k=" + h.key("ro"))[0]
    el = time.monotonic() - t0
    log = n.error_log_text()
    dropped = wait_for(lambda: all(c["id"] != first for c in links(r)), 2.0)
    r.cmd("REPLICAOF", "NO", "ONE")
    back = wait_for(lambda: len(links(r)) == 1, 8.0)
    k = h.key("master-again")
    got = [n.get("/one?k=" + k)[0] for _ in range(7)]
    on_link = [c for c in links(r) if c.get("cmd") == "evalsha"]
    h.note("a replica now: %s in %.0f ms, the link dropped: %s; a master again: a new link %s, "
           "7 requests on 5r/m: %s (on the link: %s)" % (st, el * 1000, dropped, back, got, bool(on_link)))
    h.check(st == 429 and el < 0.5, "refused, decided by on_error=deny at once: %s in %.0f ms" % (st, el * 1000))
    h.check("READONLY" in log, "the refusal is logged, with its reason")
    h.check("strict link to Redis failed: the server does not serve the key (READONLY" in log,
            "the link is dropped and that is logged")
    h.check(dropped, "the old link is gone")
    h.check(back and got == [200] * 5 + [429] * 2 and bool(on_link),
            "exact again on a new link: %s" % got)
    h.check("[alert]" not in log and "signal 11" not in log and "panicked" not in log,
            "no worker crashed")


test_a_master_that_became_a_replica_drops_the_link.timeout = 40


def test_a_hung_server_under_steady_strict_traffic_is_found_within_the_timeout(h):
    """Redis paused while four clients keep sending strict requests, a new
    call written every ~350 ms (nginx moves a timer that is set again only
    by more than 300 ms): the calls written after the first do not put
    the link's timer off, so the link times out timeout=1s after the first
    unanswered call, the backend is down, and the requests after that are
    decided by on_error at once instead of each waiting timeout=."""
    r = h.redis()
    http = ("    redis_ratelimit_zone $arg_k zone=s:1m redis=%s timeout=1s on_error=allow;\n"
            "    redis_ratelimit_zone $arg_k zone=b:1m redis=%s;\n" % (r.url, r.url))
    n = h.nginx(http, SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "a link")
    times = []
    stop = threading.Event()

    def client(i):
        time.sleep(0.35 * i)
        j = 0
        while not stop.is_set():
            t0 = time.monotonic()
            st = n.get("/strict?k=" + h.key("hung%d-%d" % (i, j)), timeout=5.0)[0]
            times.append((t0, time.monotonic() - t0, st))
            j += 1
            time.sleep(0.05)

    r.cmd("CLIENT", "PAUSE", "3000", "ALL")
    start = time.monotonic()
    ts = [threading.Thread(target=client, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    time.sleep(2.5)
    stop.set()
    for t in ts:
        t.join(10)
    during = [(t0 - start, el, st) for t0, el, st in times if t0 - start < 2.5]
    slow = [x for x in during if x[1] >= 0.9]
    log = n.error_log_text()
    h.note("%d strict requests during the pause, %d of them waited timeout=1s: %s"
           % (len(during), len(slow), [("%.2f s" % t, "%.0f ms" % (el * 1000)) for t, el, _ in slow]))
    h.check(all(st == 200 for _, _, st in during), "on_error=allow answers every one")
    h.check(len(during) >= 20, "traffic went on: %d requests" % len(during))
    h.check(len(slow) <= 2, "only the first call's request waited timeout=: %d" % len(slow))
    h.check("strict link to Redis failed: no answer within timeout=" in log, "the link timed out")


test_a_hung_server_under_steady_strict_traffic_is_found_within_the_timeout.timeout = 40


class DelayProxy(Loopback):
    """A loopback proxy to a Redis that holds every reply `delay` seconds
    before passing it on (commands go through at once): a server far away,
    answering in order."""

    def __init__(self, port, delay):
        self.upstream, self.delay = port, delay
        super().__init__()

    def serve(self, c):
        try:
            u = socket.create_connection((HOST, self.upstream))
        except OSError:
            c.close()
            return
        # each write goes out at once, as Redis's own do (TCP_NODELAY)
        for s in (c, u):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conns.append(u)
        threading.Thread(target=self.pipe, args=(c, u, 0), daemon=True).start()
        self.pipe(u, c, self.delay)

    def pipe(self, src, dst, delay):
        # replies are passed on in order, each `delay` after it came
        held = queue.Queue()

        def write():
            while True:
                due, data = held.get()
                if data is None:
                    break
                time.sleep(max(0.0, due - time.monotonic()))
                try:
                    dst.sendall(data)
                except OSError:
                    break

        writer = threading.Thread(target=write, daemon=True)
        writer.start()
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                held.put((time.monotonic() + delay, data))
        except OSError:
            pass
        finally:
            held.put((0.0, None))
            writer.join(delay + 5)
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


def test_a_slow_link_with_calls_always_out_is_kept(h):
    """Every reply held 60 ms on its way back, timeout=100ms, and four
    clients sending strict requests without a pause: the link always has
    calls out, and answers come every few ms. nginx does not move a timer
    by less than 300 ms, so a timer put off by each answer would still
    fire 100 ms after the first call and drop a healthy link; the link
    measures its stall from its last answer instead, and stays, with every
    request decided by Redis within its wait."""
    r = h.redis()
    proxy = DelayProxy(r.port, 0.06)
    try:
        http = ("    redis_ratelimit_zone $arg_k zone=s:1m redis=redis://%s:%d timeout=100ms;\n"
                % (HOST, proxy.port))
        server = ("        location = /strict { redis_ratelimit s 100r/m strict; }\n"
                  "        location = /metrics { redis_ratelimit_metrics; }\n")
        n = h.nginx(http, server, files={"strict": "ok\n"})
        h.check(wait_for(lambda: len(links(r)) == 1, 5.0), "a link")
        first = [c["id"] for c in links(r)]
        # Redis learns the script first (a first call through the thread
        # takes more round trips than timeout= allows here)
        for _ in range(20):
            t0 = time.monotonic()
            n.get("/strict?k=" + h.key("warm"), timeout=5.0)
            if time.monotonic() - t0 < 0.095:
                break
        before = strict_figures(n)
        results = []

        def client(i):
            end, j = time.monotonic() + 2.0, 0
            while time.monotonic() < end:
                t0 = time.monotonic()
                k = "slow%d-%d" % (i, j)
                st = n.get("/strict?k=" + h.key(k), timeout=5.0)[0]
                results.append((st, time.monotonic() - t0, k))
                j += 1

        ts = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(15)
        fig = strict_figures(n)
        waited = sorted(el for _, el, _ in results)
        counted = sum(count(r, h.key(k)) for _, _, k in results)
        h.note("%d requests, waited %.0f to %.0f ms (median %.0f), %d counted in Redis; "
               "strict figures %s before, %s after"
               % (len(results), waited[0] * 1000, waited[-1] * 1000,
                  waited[len(waited) // 2] * 1000, counted, before, fig))
        h.check(len(results) >= 40, "traffic went on: %d requests" % len(results))
        h.check(all(st == 200 for st, _, _ in results), "every request allowed")
        h.check(waited[0] >= 0.055 and waited[-1] < 0.095,
                "each waited for its held answer, none for timeout=")
        h.check(fig["timeouts"] == before["timeouts"], "none was decided by on_error")
        h.check(counted == len(results), "each counted once in Redis")
        h.check("no answer within timeout=" not in n.error_log_text(), "the link was not dropped")
        h.check([c["id"] for c in links(r)] == first, "the same link throughout")
    finally:
        proxy.close()


test_a_slow_link_with_calls_always_out_is_kept.timeout = 40


def test_the_link_s_timer_does_not_hold_a_graceful_exit(h):
    """timeout=15s, one strict request answered at once, then `nginx -s
    quit` and a reload: the old worker exits in about a second, not after
    the link's read timer (15 s)."""
    r = h.redis()
    slow = HTTP.replace("timeout=1s", "timeout=15s") % (r.url, r.url)
    n = h.nginx(slow, SERVER, files=FILES)
    h.check(wait_for(lambda: len(links(r)) == 1, 3.0), "the worker's link: %s" % links(r))
    h.check(n.get("/strict?k=" + h.key("q"))[0] == 200, "a strict request")
    res = n.reload(timeout=20.0, check=False)
    h.check(n.get("/strict?k=" + h.key("q2"))[0] == 200, "a strict request on the new worker")
    secs = n.quit(grace=20.0)
    h.note("old worker gone %.1f s after the reload; quit took %.1f s" % (res["old_gone_after"] or -1, secs))
    h.expect(res["old_gone_after"] is not None and res["old_gone_after"] < 4.0,
             "the reload's old worker exits at once: %s" % res["old_gone_after"])
    h.expect(secs < 4.0, "quit takes about a second, not timeout=: %.1f s" % secs)


test_the_link_s_timer_does_not_hold_a_graceful_exit.timeout = 90
