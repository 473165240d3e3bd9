"""The HTTP client the runner sends requests with, and what it reads back."""

import errno
import re
import select
import socket
import time

from tn_text import L1, show, BlockError


class Response:
    def __init__(self):
        self.code = None
        self.reason = ""
        self.headers = []
        self.raw_headers = ""
        self.body = None

    def header(self, name):
        vals = [v for k, v in self.headers if k.lower() == name.lower()]
        return ", ".join(vals) if vals else None


def parse_response(raw, head_req):
    """Returns (Response, left_over_bytes_or_None, error_or_None).  Mirrors
    HTTP::Response->parse plus Test::Nginx's chunked / Content-Length logic."""
    res = Response()
    m = re.match(r"(.*?\r\n)\r\n", raw, re.S)
    if m:
        res.raw_headers = m.group(1)
    if "\n" in raw:
        status_line, rest = raw.split("\n", 1)
    else:
        status_line, rest = raw, ""
    status_line = status_line.rstrip("\r")
    parts = status_line.split(None, 2) if not re.match(r"\d{3} ", status_line) else [None] + status_line.split(None, 1)
    code = parts[1] if len(parts) > 1 else None
    res.reason = parts[2] if len(parts) > 2 else ""
    res.code = code if code and code.isdigit() else None
    # headers, exactly like HTTP::Message->parse
    pos = 0
    hdr_re = re.compile(r"([^\s:]+)[ \t]*: ?(.*)\n?")
    cont_re = re.compile(r"([ \t].*)\n?")
    while True:
        hm = hdr_re.match(rest, pos)
        if hm:
            res.headers.append((hm.group(1), re.sub(r"\r\Z", "", hm.group(2))))
            pos = hm.end()
            continue
        cm = cont_re.match(rest, pos) if res.headers else None
        if cm:
            k, v = res.headers[-1]
            res.headers[-1] = (k, re.sub(r"\r\Z", "", v + "\n" + cm.group(1)))
            pos = cm.end()
            continue
        em = re.compile(r"\r?\n").match(rest, pos)
        if em:
            pos = em.end()
        break
    consumed = pos
    content = rest[consumed:]
    left = None
    if res.code and (res.code in ("304", "101") or res.code.startswith("1") or head_req):
        if head_req or res.code == "304":
            res.body = ""
            left = content or None
        else:
            res.body = content
        return res, left, None
    enc = res.header("Transfer-Encoding")
    clen = res.header("Content-Length")
    trailers = [v for k, v in res.headers if k.lower() == "trailer"]
    if enc is not None and enc == "chunked":
        pos = 0
        decoded = []
        while True:
            if not trailers:
                mm = re.compile(r"0[ \t]*\r\n\r\n").match(content, pos)
                if mm:
                    pos = mm.end()
                    left = content[pos:] or None
                    break
            else:
                mm = re.compile(r"0[ \t]*\r\n").match(content, pos)
                if mm:
                    pos = mm.end()
                    for t in trailers:
                        tm = re.compile(re.escape(t) + r": [^\n]*\r\n").match(content, pos)
                        if not tm:
                            return res, None, "invalid trailer data received (expected %s)" % t
                        pos = tm.end()
                    if not content.startswith("\r\n", pos):
                        return res, None, "invalid chunked data received (expected CRLF)"
                    pos += 2
                    left = content[pos:] or None
                    break
            mm = re.compile(r"[ \t]*([A-Fa-f0-9]+)[ \t]*\r\n").match(content, pos)
            if mm:
                size = int(mm.group(1), 16)
                pos = mm.end()
                if len(content) - pos < size:
                    res.body = "".join(decoded)
                    return res, None, "invalid chunked data received (not enough octets for the data section)"
                decoded.append(content[pos:pos + size])
                pos += size
                if not content.startswith("\r\n", pos):
                    res.body = "".join(decoded)
                    return res, None, "invalid chunked data received (expected CRLF)"
                pos += 2
            elif pos < len(content):
                res.body = "".join(decoded)
                return res, None, "invalid chunked body received: %s" % show(content[pos:pos + 100])
            else:
                res.body = "".join(decoded)
                return res, None, "no last chunk found - %s" % show(content, 200)
        res.body = "".join(decoded)
    elif clen is not None and clen.strip().isdigit():
        n = int(clen.strip())
        if len(content) > n:
            res.body = content[:n]
            left = content[n:]
        else:
            res.body = content
    else:
        res.body = content
    return res, left, None


class HttpResult:
    def __init__(self):
        self.raw = ""
        self.timed_out = False
        self.error = None


def http_exchange(port, packets, timeout, middle_delay=None, shutdown_how=None,
                  alive_check=None, connect_budget=3.0, overall_cap=120.0):
    """Send `packets` (list of bytes) on one TCP connection to 127.0.0.1:port
    and read until the server closes.  `timeout` is the idle timeout like
    Test::Nginx's select() timeout."""
    result = HttpResult()
    deadline = time.monotonic() + connect_budget
    delay = 0.015
    sock = None
    last_err = None
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=min(timeout, 5.0))
            break
        except OSError as e:
            last_err = e
            if alive_check is not None and not alive_check():
                result.error = "Can't connect to 127.0.0.1:%d: %s (nginx is not running)" % (port, e)
                return result
            if time.monotonic() >= deadline:
                result.error = "Can't connect to 127.0.0.1:%d: %s (aborted)" % (port, last_err)
                return result
            time.sleep(delay)
            delay = min(delay * 2, 0.25)
    chunks = []
    try:
        sock.settimeout(timeout)
        for i, pkt in enumerate(packets):
            if i > 0 and middle_delay:
                time.sleep(middle_delay)
            try:
                sock.sendall(pkt)
            except OSError as e:
                result.error = "send failed: %s" % e
                break
        if shutdown_how is not None:
            try:
                sock.shutdown(shutdown_how)
            except OSError:
                pass
        end_by = time.monotonic() + overall_cap
        while True:
            if time.monotonic() > end_by:
                result.timed_out = True
                break
            try:
                r, _, _ = select.select([sock], [], [], timeout)
            except InterruptedError:
                continue
            if not r:
                result.timed_out = True
                break
            try:
                data = sock.recv(65536)
            except socket.timeout:
                result.timed_out = True
                break
            except OSError as e:
                if e.errno not in (errno.ECONNRESET, errno.EPIPE):
                    result.error = "recv failed: %s" % e
                break
            if not data:
                break
            chunks.append(data)
    finally:
        try:
            sock.close()
        except OSError:
            pass
    result.raw = b"".join(chunks).decode(L1)
    return result


def parse_more_headers(text):
    out = []
    chunked = False
    for h in re.split(r"\n+", text or ""):
        if h == "" or re.match(r"\s*#", h):
            continue
        kv = re.split(r":\s*", h, maxsplit=1)
        key = kv[0]
        val = kv[1] if len(kv) > 1 else ""
        if key.lower() == "transfer-encoding" and val == "chunked":
            chunked = True
        out.append("%s: %s\r\n" % (key, val))
    return "".join(out), chunked


def build_request(req, more_headers, chunked, conn):
    """Test::Nginx parse_request + build_request_from_packets for one string."""
    if req is None or req == "":
        raise BlockError("Request line should be non-empty")
    nl = req.find("\n")
    first = req if nl < 0 else req[:nl + 1]
    content = "" if nl < 0 else req[nl + 1:]
    m = re.match(r"^(\s*)(\S+)( *)((\S+)( *))?((\S+)( *))?(\s*)$", first)
    if not m:
        raise BlockError("Request line is not valid. Should be 'meth [url [version]]' but got %s" % show(first))
    meth = m.group(2)
    url = m.group(5) if m.group(5) is not None else "/"
    ver = m.group(8) if m.group(8) is not None else "HTTP/1.1"
    len_header = ""
    if not chunked and content != "" and not re.search(r"(?:^|\n)Content-Length:", more_headers):
        content = content.strip(" \t\n\r\f\v")
        len_header = "Content-Length: %d\r\n" % len(content)
    more_headers = re.sub(r"(?<!\r)\n", "\r\n", more_headers)
    headers = ""
    if not re.search(r"(?:^|\n)Host:", more_headers, re.I | re.M):
        headers += "Host: localhost\r\n"
    if not re.search(r"(?:^|\n)Connection", more_headers, re.I | re.M):
        headers += "Connection: %s\r\n" % conn
    headers += more_headers + len_header + "\r\n"
    return "%s %s %s\r\n%s%s" % (meth, url, ver, headers, content)
