"""TLS to Redis (`rediss://`): counts travel encrypted, and a certificate
that cannot be verified is refused with a clear error (the zone then counts
on this node, as `on_error=local` says).

The Redis here listens on a plain port (to read the counts back) and a TLS
port (for nginx), with a self-signed certificate made by `openssl`. The URL
fragment `#insecure` is the redis crate's way to accept such a certificate.
"""

import os
import subprocess

from harness import HOST, free_port, wait_for
from test_redis import fail_lines, loc, redis_sum, statuses_str, zone


def make_cert(directory):
    key = os.path.join(directory, "key.pem")
    cert = os.path.join(directory, "cert.pem")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key,
         "-out", cert, "-days", "2", "-subj", "/CN=127.0.0.1"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=30)
    os.chmod(key, 0o644)
    return cert, key


def test_rediss(h):
    """rediss://...#insecure: 3 x 200 then 429 and the count 3 lands in Redis
    within 2 s; rediss:// with verification against a self-signed
    certificate: an error line naming the certificate problem, requests
    still answered (local counting: 3 x 200 then 429), nothing written."""
    cert, key = make_cert(h.tmp)
    tls_port = free_port()
    r = h.redis(extra_args=("--tls-port", str(tls_port), "--tls-cert-file", cert,
                            "--tls-key-file", key, "--tls-ca-cert-file", cert,
                            "--tls-auth-clients", "no"))
    http = (zone("zt", "rediss://%s:%d/#insecure" % (HOST, tls_port))
            + zone("zv", "rediss://%s:%d" % (HOST, tls_port)))
    server = loc("/t", "redis_ratelimit zt 3r/m;") + loc("/v", "redis_ratelimit zv 3r/m;")
    ng = h.nginx(http, server, files={"t": "t\n", "v": "v\n"})
    h.wait_minute_room(5)
    kt, kv = h.key("t"), h.key("v")
    t = []
    for _ in range(4):
        t.append(ng.get("/t?k=" + kt)[0])
    h.note("TLS zone: %s" % statuses_str(t))
    h.check(t == [200, 200, 200, 429], "TLS zone (3r/m): expected 3 x 200 then 429, got %s" % statuses_str(t))
    landed = wait_for(lambda: redis_sum(r, "rl:{zt:%s}:60:*" % kt) == 3, 2.0)
    h.note("count over TLS in Redis: %d" % redis_sum(r, "rl:{zt:%s}:60:*" % kt))
    h.expect(landed, "TLS zone: count 3 not in Redis within 2 s")

    v = [ng.get("/v?k=" + kv)[0] for _ in range(4)]
    h.note("verifying zone: %s" % statuses_str(v))
    h.expect(v == [200, 200, 200, 429], "verifying zone (local counting, 3r/m): expected 3 x 200 then 429, got %s"
             % statuses_str(v))
    got = wait_for(lambda: fail_lines(ng.error_log_text(), "zv"), 2.0)
    lines = [l for l in ng.error_log_text().splitlines() if "zone \"zv\"" in l and "failed" in l]
    h.note("verifying zone error: %s" % (lines[0][lines[0].find("redis_ratelimit"):][:200] if lines else "none"))
    h.check(got, 'no error line for zone "zv" within 2 s')
    h.expect(any("certificate" in l for l in lines), "the error does not say what is wrong with the certificate")
    h.expect(not r.keys("rl:{zv:*"), "the verifying zone wrote to Redis despite the failed handshake")
