"""What the module writes to the error log is one line per event, in its
own words, whatever a server sent back: a "Redis" that answers with bytes
that are not the Redis protocol (an HTTP server on the port, a hostile
server) gives one line saying so, never the parser's byte-by-byte report
on lines of their own, and no line that a server's bytes could forge.
"""

import re
import socket
import threading

from harness import HOST, free_port, wait_for

STAMP = re.compile(r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d \[\w+\] ")


class NotRedis:
    """A TCP server on loopback that answers every read with `answer`
    (stopped with the test, like every server it starts)."""

    def __init__(self, answer):
        self.answer = answer
        self.port = free_port()
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((HOST, self.port))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.stopping = threading.Event()
        self.accepted = 0
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        conns = []
        while not self.stopping.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conns.append(c)
            threading.Thread(target=self._answer, args=(c,), daemon=True).start()
        for c in conns:
            c.close()

    def _answer(self, c):
        c.settimeout(2.0)
        try:
            while not self.stopping.is_set():
                if not c.recv(4096):
                    return
                c.sendall(self.answer)
        except OSError:
            return

    def stop(self):
        self.stopping.set()
        self.thread.join(2.0)
        self.sock.close()


def test_a_server_answering_garbage_gives_one_line_in_our_words(h):
    """Every zone of a node whose "Redis" answers an HTTP error page with
    escape sequences: requests are still answered (on_error=local), and
    every line of the error log starts with nginx's time stamp; the
    failure is said once a second at most, as "not the Redis protocol"."""
    fake = NotRedis(b"HTTP/1.1 400 Bad Request\r\nServer: x\r\n\r\n\x1b[2J<html>\nforged [error] line\n")
    h.procs.append(fake)
    n = h.nginx("redis_ratelimit_zone $arg_k zone=g:1m redis=redis://%s:%d;\n" % (HOST, fake.port),
                "location = /t { redis_ratelimit g 5r/m; }\n")
    statuses = [n.get("/t?k=" + h.key("garbage"))[0] for _ in range(7)]
    said = wait_for(lambda: "not the Redis protocol" in n.error_log_text(), 5.0)
    text = n.error_log_text()
    lines = text.splitlines()
    odd = [l for l in lines if not STAMP.match(l)]
    ours = [l for l in lines if "redis_ratelimit:" in l and "[error]" in l]
    h.note("7 requests: %s; the fake server accepted %d connections; lines about Redis: %s"
           % (statuses, fake.accepted, ours[:3]))
    h.check(fake.accepted >= 1, "the module connected to the fake server")
    h.check(statuses == [200] * 5 + [429] * 2, "limited on this node's counts: %s" % statuses)
    h.check(said, "the failure says the answer is not the Redis protocol")
    h.check(not odd, "every error log line is one line with its time stamp: %s" % odd[:5])
    h.check(all("Unexpected" not in l for l in lines), "no parser report in the log")
    h.check("forged" not in text, "no byte of the server's answer in the log")


def test_a_silent_server_and_an_on_error_refusal_say_what_happened(h):
    """A "Redis" that accepts and never answers, timeout=200ms and
    on_error=deny: the failure says there was no answer within the
    timeout (not the socket's EAGAIN text), and a refusal that on_error
    made says Redis is down and which policy refused."""
    fake = NotRedis(b"")
    h.procs.append(fake)
    n = h.nginx("redis_ratelimit_zone $arg_k zone=q:1m redis=redis://%s:%d timeout=200ms on_error=deny;\n"
                % (HOST, fake.port), "location = /t { redis_ratelimit q 1000r/m; }\n")
    said = wait_for(lambda: n.get("/t?k=" + h.key("silent"))[0] == 429
                    and "no answer within timeout=200ms" in n.error_log_text(), 5.0, 0.1)
    ours = [l[l.find("[error]"):] for l in n.error_log_text().splitlines() if "[error]" in l]
    h.note("lines: %s" % ours[:4])
    h.check(said, "the failure says: no answer within timeout=200ms")
    h.check(not any("temporarily unavailable" in l or "os error 11" in l for l in ours),
            "no EAGAIN text in the log")
    h.check(any("limiting requests" in l and "Redis down (on_error=deny)" in l for l in ours),
            "the refusal says Redis is down and on_error=deny refused")
