"""TLS to Redis (`rediss://`): counts travel encrypted, and a certificate
that cannot be verified is refused with a clear error (the zone then counts
on this node, as `on_error=local` says). A private CA and client
certificates (`ssl_trusted_certificate=`, `ssl_certificate=`,
`ssl_certificate_key=`) for a standalone Redis, a cluster and a master
behind a sentinel; files that cannot work fail `nginx -t`.

Each Redis here listens on a plain port (to read the counts back) and a TLS
port (for nginx), with certificates made by `openssl` at test time. The URL
fragment `#insecure` is the redis crate's way to accept any certificate.
"""

import os
import re
import subprocess
import time

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


# --------------------------------------------------------------------------
# A private CA (ssl_trusted_certificate=) and client certificates
# (ssl_certificate=, ssl_certificate_key=), made with openssl at test time
# --------------------------------------------------------------------------

CA_CNF = """[ ca ]
default_ca = d
[ d ]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = p
unique_subject = no
copy_extensions = copy
x509_extensions = ext
[ p ]
commonName = supplied
[ ext ]
basicConstraints = CA:FALSE
"""


class Pki:
    """Certificates below `directory`: CAs, and certificates they sign
    (EC P-256 keys in PKCS#8 PEM, except where a test asks for RSA's PKCS#1
    form). Each file is world-readable: nginx's workers may not run as the
    test's user."""

    def __init__(self, directory):
        self.dir = os.path.join(directory, "pki")
        os.makedirs(self.dir, exist_ok=True)
        with open(os.path.join(self.dir, "ca.cnf"), "w") as f:
            f.write(CA_CNF)
        open(os.path.join(self.dir, "index.txt"), "w").close()
        with open(os.path.join(self.dir, "serial"), "w") as f:
            f.write("01\n")

    def path(self, name):
        return os.path.join(self.dir, name)

    def run(self, *argv):
        p = subprocess.run(["openssl"] + list(argv), cwd=self.dir, capture_output=True, text=True, timeout=30)
        if p.returncode != 0:
            raise RuntimeError("openssl %s failed: %s" % (argv[0], p.stderr[-500:]))

    def key(self, name, rsa=False):
        if rsa:
            self.run("genrsa", "-traditional", "-out", name + ".key", "2048")
        else:
            self.run("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", name + ".key")
        os.chmod(self.path(name + ".key"), 0o644)
        return self.path(name + ".key")

    def ca(self, name):
        """A self-signed CA: (cert, key)."""
        key = self.key(name)
        self.run("req", "-x509", "-new", "-key", key, "-out", name + ".pem", "-days", "2", "-subj", "/CN=" + name,
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
        return self.path(name + ".pem"), key

    def issue(self, name, ca, sans=None, dates=None, rsa=False):
        """A certificate for `name` signed by CA `ca` (a name given to
        `ca()`), with subjectAltNames `sans` (["IP:127.0.0.1", ...]);
        `dates`: (start, end) as openssl's YYYYMMDDHHMMSSZ. (cert, key)."""
        key = self.key(name, rsa)
        argv = ["req", "-new", "-key", key, "-out", name + ".csr", "-subj", "/CN=" + name]
        if sans:
            argv += ["-addext", "subjectAltName=" + ",".join(sans)]
        self.run(*argv)
        start, end = dates or (None, None)
        argv = ["ca", "-batch", "-config", "ca.cnf", "-cert", ca + ".pem", "-keyfile", ca + ".key",
                "-in", name + ".csr", "-out", name + ".pem", "-notext"]
        argv += ["-startdate", start, "-enddate", end] if dates else ["-days", "2"]
        self.run(*argv)
        return self.path(name + ".pem"), key

    def issue_v1(self, name, ca):
        """An X.509 v1 certificate (`openssl x509 -req` without extensions)
        signed by CA `ca`. (cert, key)."""
        key = self.key(name)
        self.run("req", "-new", "-key", key, "-out", name + ".csr", "-subj", "/CN=" + name)
        self.run("x509", "-req", "-in", name + ".csr", "-CA", ca + ".pem", "-CAkey", ca + ".key",
                 "-set_serial", "7", "-days", "2", "-out", name + ".pem")
        return self.path(name + ".pem"), key


def tls_redis(h, pki, extra=()):
    """A Redis with a plain port (for the test to read counts) and a TLS
    port whose certificate the private CA signed for 127.0.0.1 and
    redis.test; it asks every client for a certificate of that CA
    (tls-auth-clients: Redis's default). (redis, tls_port)."""
    cert, key = pki.issue("server", "ca", ["IP:127.0.0.1", "DNS:redis.test"])
    port = free_port()
    r = h.redis(extra_args=("--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key,
                            "--tls-ca-cert-file", pki.path("ca.pem")) + tuple(extra))
    return r, port


def zone_lines(h, ssl, *zones):
    """redis_ratelimit_zone lines: (name, url, params) each."""
    return "".join("    redis_ratelimit_zone $arg_k zone=%s:1m redis=%s %s %s;\n" % (z, url, ssl, extra)
                   for z, url, extra in zones)


def test_client_certificates_and_a_private_ca(h):
    """Redis with its TLS defaults (a client certificate required), verified
    against a private CA: with ssl_trusted_certificate=, ssl_certificate=
    and ssl_certificate_key= counts land (background and a small limit
    decided in Redis) without #insecure. A client certificate of another
    CA: the server refuses it, one clear error line a second at most, no
    busy reconnecting, on_error decides. A URL naming a host the server's
    certificate does not: refused, nothing written."""
    pki = Pki(h.tmp)
    pki.ca("ca")
    pki.ca("rogue")
    client, client_key = pki.issue("client", "ca")
    rogue, rogue_key = pki.issue("rogue-client", "rogue")
    r, port = tls_redis(h, pki)
    good = "ssl_trusted_certificate=%s ssl_certificate=%s ssl_certificate_key=%s" % (
        pki.path("ca.pem"), client, client_key)
    http = (zone_lines(h, good,
                       ("mt", "rediss://%s:%d" % (HOST, port), "hold=0"),
                       ("nm", "rediss://localhost:%d" % port, "on_error=allow"))
            + zone_lines(h, "ssl_trusted_certificate=%s ssl_certificate=%s ssl_certificate_key=%s" % (
                pki.path("ca.pem"), rogue, rogue_key),
                ("rg", "rediss://%s:%d" % (HOST, port), "on_error=allow")))
    server = (loc("/b", "redis_ratelimit mt 1000r/m;") + loc("/s", "redis_ratelimit mt 3r/m;")
              + loc("/g", "redis_ratelimit rg 2r/m;") + loc("/n", "redis_ratelimit nm 2r/m;"))
    ng = h.nginx(http, server, files={"b": "b\n", "s": "s\n", "g": "g\n", "n": "n\n"})
    h.wait_minute_room(5)
    kb, ks, kg, kn = h.key("b"), h.key("s"), h.key("g"), h.key("n")
    b = [ng.get("/b?k=" + kb)[0] for _ in range(3)]
    s = [ng.get("/s?k=" + ks)[0] for _ in range(5)]
    landed = wait_for(lambda: redis_sum(r, "rl:{mt:%s}:60:*" % kb) == 3, 3.0)
    h.note("mTLS, private CA: background %s (in Redis %d), 3r/m %s (in Redis %d)"
           % (statuses_str(b), redis_sum(r, "rl:{mt:%s}:60:*" % kb), statuses_str(s),
              redis_sum(r, "rl:{mt:%s}:60:*" % ks)))
    h.check(landed, "background counts over mTLS land in Redis")
    h.check(s == [200] * 3 + [429] * 2 and redis_sum(r, "rl:{mt:%s}:60:*" % ks) == 3,
            "3r/m decided in Redis over mTLS: %s" % statuses_str(s))

    g = [ng.get("/g?k=" + kg)[0] for _ in range(4)]
    n = [ng.get("/n?k=" + kn)[0] for _ in range(4)]
    h.check(g == [200] * 4 and n == [200] * 4, "on_error=allow decides while the handshake fails: %s %s"
            % (statuses_str(g), statuses_str(n)))
    before = int(re.search(r"total_connections_received:(\d+)", r.cmd("INFO", "stats")).group(1))
    time.sleep(3.0)
    after = int(re.search(r"total_connections_received:(\d+)", r.cmd("INFO", "stats")).group(1))
    log = ng.error_log_text().splitlines()
    rg = [l for l in log if 'zone "rg"' in l and "[error]" in l]
    nm = [l for l in log if 'zone "nm"' in l and "[error]" in l]
    h.note("another CA's client certificate: %d error lines, e.g. %s" % (
        len(rg), rg[0][rg[0].find("redis_ratelimit"):][:220] if rg else "none"))
    h.note("a name the certificate does not hold: %s" % (nm[0][nm[0].find("redis_ratelimit"):][:220] if nm else "none"))
    h.note("connections Redis accepted in 3 s while both zones fail: %d" % (after - before))
    h.check(rg, 'an error line for zone "rg"')
    h.check(nm and any("not valid for name" in l or "NotValidForName" in l for l in nm),
            "the error names the server name mismatch: %s" % nm[:1])
    h.check(len(rg) <= 6, "at most about one error line a second: %d" % len(rg))
    h.check(after - before <= 12, "no busy reconnecting: %d connections in 3 s" % (after - before))
    h.check(not r.keys("rl:{rg:*") and not r.keys("rl:{nm:*"), "nothing written by the refused zones")
    h.check(all(ng.get("/b?k=" + kb)[0] == 200 for _ in range(2)), "the worker still answers")


def test_mtls_one_node_cluster_and_sentinel(h):
    """The ssl_*= parameters reach every kind of backend: a one-node Redis
    Cluster on TLS (tls-cluster yes) requiring client certificates, and a
    master followed through a sentinel, both on TLS, both requiring client
    certificates, both verified against the private CA."""
    from cluster import NODE_ARGS, cluster_port
    from test_sentinel import Sentinel

    pki = Pki(h.tmp)
    pki.ca("ca")
    client, client_key = pki.issue("client", "ca")
    scert, skey = pki.issue("server", "ca", ["IP:127.0.0.1"])
    tls = ("--tls-cert-file", scert, "--tls-key-file", skey, "--tls-ca-cert-file", pki.path("ca.pem"))
    ssl = "ssl_trusted_certificate=%s ssl_certificate=%s ssl_certificate_key=%s" % (
        pki.path("ca.pem"), client, client_key)

    p = cluster_port()
    ctls = free_port()
    node = h.redis(port=p, extra_args=tuple(NODE_ARGS) + ("--tls-port", str(ctls), "--tls-cluster", "yes") + tls)
    node.cmd("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
    h.check(wait_for(lambda: "cluster_state:ok" in node.cmd("CLUSTER", "INFO"), 5.0), "the cluster is ok")

    mtls = free_port()
    master = h.redis(extra_args=("--tls-port", str(mtls), "--tls-replication", "yes") + tls)
    s = Sentinel(h, mtls, tls=(scert, skey), ca=pki.path("ca.pem"))
    h.procs.append(s)
    s.start()

    http = zone_lines(h, ssl,
                      ("cl", "rediss://%s:%d" % (HOST, ctls), "cluster hold=0"),
                      ("se", "rediss://%s:%d" % (HOST, s.port), "sentinel=mymaster hold=0"))
    server = (loc("/c", "redis_ratelimit cl 1000r/h;") + loc("/cs", "redis_ratelimit cl 3r/h;")
              + loc("/e", "redis_ratelimit se 1000r/h;") + loc("/es", "redis_ratelimit se 3r/h strict;"))
    ng = h.nginx(http, server, files={"c": "c\n", "cs": "c\n", "e": "e\n", "es": "e\n"})
    kc, kcs, ke, kes = h.key("c"), h.key("cs"), h.key("e"), h.key("es")
    c = [ng.get("/c?k=" + kc)[0] for _ in range(3)]
    cs = [ng.get("/cs?k=" + kcs)[0] for _ in range(4)]
    e = [ng.get("/e?k=" + ke)[0] for _ in range(3)]
    es = [ng.get("/es?k=" + kes)[0] for _ in range(4)]
    landed = wait_for(lambda: redis_sum(node, "rl:{cl:%s}:*" % kc) == 3
                      and redis_sum(master, "rl:{se:%s}:*" % ke) == 3, 3.0)
    errs = [l for l in ng.error_log_text().splitlines() if "[error]" in l and "redis_ratelimit:" in l]
    h.note("TLS cluster: background %s (in Redis %d), 3r/h %s; TLS sentinel's master: background %s "
           "(in Redis %d), strict 3r/h %s; error lines: %s"
           % (statuses_str(c), redis_sum(node, "rl:{cl:%s}:*" % kc), statuses_str(cs), statuses_str(e),
              redis_sum(master, "rl:{se:%s}:*" % ke), statuses_str(es), errs[:2]))
    h.check(landed, "background counts land on the cluster and on the master")
    h.check(cs == [200] * 3 + [429] and redis_sum(node, "rl:{cl:%s}:*" % kcs) == 3, "3r/h in the cluster")
    h.check(es == [200] * 3 + [429] and redis_sum(master, "rl:{se:%s}:*" % kes) == 3, "strict through the sentinel")
    h.check(not errs, "no error line: %s" % errs[:2])


def test_ssl_files_that_cannot_work_fail_nginx_t(h):
    """Each file that cannot work fails nginx -t with [emerg] naming the
    directive and the file, never what it holds: a missing file, a file
    that is not PEM, a key that is not the certificate's, an expired
    certificate, one not valid yet, a CA bundle of expired certificates,
    an X.509 v1 client certificate (TLS refuses it at every handshake).
    A PKCS#1 RSA key and a CA bundle holding one expired CA beside a valid
    one pass."""
    pki = Pki(h.tmp)
    ca, _ = pki.ca("ca")
    cert, key = pki.issue("client", "ca")
    other, other_key = pki.issue("other", "ca")
    old, old_key = pki.issue("old", "ca", dates=("20200101000000Z", "20210101000000Z"))
    late, late_key = pki.issue("late", "ca", dates=("20990101000000Z", "21000101000000Z"))
    rsa, rsa_key = pki.issue("rsa", "ca", rsa=True)
    v1, v1_key = pki.issue_v1("v1", "ca")
    junk = pki.path("junk.pem")
    with open(junk, "w") as f:
        f.write("not a certificate\n")
    both = pki.path("both.pem")
    with open(both, "w") as f:
        f.write(open(old).read() + open(ca).read())
    secret = open(key).read().splitlines()[1][:24]

    def nginx_t(params):
        ng = h.nginx("    redis_ratelimit_zone $arg_k zone=z:1m redis=rediss://127.0.0.1:6390 %s;\n" % params,
                     loc("/t", "redis_ratelimit z 1r/s;"), start=False)
        p = subprocess.run(ng.argv("-t"), capture_output=True, text=True, timeout=60)
        return p.returncode, p.stderr

    refused = [
        ("ssl_trusted_certificate=%s" % pki.path("missing.pem"), "missing.pem", "No such file"),
        ("ssl_trusted_certificate=%s" % junk, "junk.pem", "no PEM certificate"),
        ("ssl_certificate=%s ssl_certificate_key=%s" % (cert, other_key), "other.key",
         "is not the key of ssl_certificate"),
        ("ssl_certificate=%s ssl_certificate_key=%s" % (old, old_key), "old.pem", "expired on 2021-01-01 00:00:00 UTC"),
        ("ssl_certificate=%s ssl_certificate_key=%s" % (late, late_key), "late.pem", "not valid before 2099-01-01"),
        ("ssl_trusted_certificate=%s" % old, "old.pem", "expired on"),
        ("ssl_certificate=%s ssl_certificate_key=%s" % (cert, junk), "junk.pem", "no unencrypted private key"),
        ("ssl_certificate=%s ssl_certificate_key=%s" % (v1, v1_key), "v1.pem",
         "is an X.509 v1 certificate, which TLS refuses in a client's chain: make it v3"),
    ]
    for params, name, why in refused:
        rc, err = nginx_t(params)
        line = next((l for l in err.splitlines() if "[emerg]" in l), "")
        h.note("%s -> %s" % (params.replace(pki.dir + "/", ""), line[line.find("[emerg]"):][:200]))
        h.check(rc != 0 and "redis_ratelimit_zone" in line and name in line and why in line,
                "%s: expected [emerg] naming the directive, %s and %r, got %r" % (params, name, why, err[-400:]))
        h.check(secret not in err and "BEGIN" not in err, "the file's contents are not shown")
    for params in ["ssl_certificate=%s ssl_certificate_key=%s" % (rsa, rsa_key),
                   "ssl_trusted_certificate=%s" % both]:
        rc, err = nginx_t(params)
        h.check(rc == 0, "%s: accepted, got %s" % (params, err[-300:]))


# the certificate files the examples (docs/, nginx-conf/) name, relative to
# nginx's configuration prefix
EXAMPLE_FILES = ("redis-ca.pem", "redis-client.pem", "redis-client.key")


def example_certificates(directory):
    """A CA and a client certificate it signed, under the names the
    examples use, made once in `directory`; {name: path}."""
    pki = Pki(directory)
    if not os.path.exists(pki.path("redis-client.key")):
        pki.ca("redis-ca")
        pki.issue("redis-client", "redis-ca")
    return {name: pki.path(name) for name in EXAMPLE_FILES}


def test_ssl_name_verifies_a_name_where_the_address_is_an_ip(h):
    """Certificates that name a host only (DNS:redis.test), reached by IP
    address: with ssl_name=redis.test the server is verified by that name
    (counts land, a small limit decided in Redis); without it the
    connection is refused (the certificate does not hold 127.0.0.1); with
    another name too. The same through a TLS sentinel, which names the
    master by IP address: both the sentinel and the master are verified by
    ssl_name=."""
    from test_sentinel import Sentinel

    pki = Pki(h.tmp)
    pki.ca("ca")
    client, client_key = pki.issue("client", "ca")
    scert, skey = pki.issue("named", "ca", ["DNS:redis.test"])
    tls = ("--tls-cert-file", scert, "--tls-key-file", skey, "--tls-ca-cert-file", pki.path("ca.pem"))
    port = free_port()
    r = h.redis(extra_args=("--tls-port", str(port), "--tls-replication", "yes") + tls)
    s = Sentinel(h, port, tls=(scert, skey), ca=pki.path("ca.pem"))
    h.procs.append(s)
    s.start()
    ssl = "ssl_trusted_certificate=%s ssl_certificate=%s ssl_certificate_key=%s" % (
        pki.path("ca.pem"), client, client_key)
    url = "rediss://%s:%d" % (HOST, port)
    http = zone_lines(h, ssl,
                      ("nd", url, "ssl_name=redis.test hold=0"),
                      ("ip", url, "on_error=allow"),
                      ("wn", url, "ssl_name=other.test on_error=allow"),
                      ("sn", "rediss://%s:%d" % (HOST, s.port), "sentinel=mymaster ssl_name=redis.test hold=0"))
    server = (loc("/b", "redis_ratelimit nd 1000r/m;") + loc("/s", "redis_ratelimit nd 3r/m;")
              + loc("/i", "redis_ratelimit ip 2r/m;") + loc("/w", "redis_ratelimit wn 2r/m;")
              + loc("/e", "redis_ratelimit sn 1000r/m;") + loc("/es", "redis_ratelimit sn 3r/m strict;"))
    ng = h.nginx(http, server, files={p: "x\n" for p in ("b", "s", "i", "w", "e", "es")})
    h.wait_minute_room(5)
    kb, ks, ki, kw, ke, kes = (h.key(x) for x in ("b", "s", "i", "w", "e", "es"))
    b = [ng.get("/b?k=" + kb)[0] for _ in range(3)]
    sm = [ng.get("/s?k=" + ks)[0] for _ in range(4)]
    e = [ng.get("/e?k=" + ke)[0] for _ in range(3)]
    es = [ng.get("/es?k=" + kes)[0] for _ in range(4)]
    for path, k in (("/i", ki), ("/w", kw)):
        ng.get("%s?k=%s" % (path, k))
    landed = wait_for(lambda: redis_sum(r, "rl:{nd:%s}:60:*" % kb) == 3
                      and redis_sum(r, "rl:{sn:%s}:60:*" % ke) == 3, 3.0)
    got = wait_for(lambda: fail_lines(ng.error_log_text(), "ip") and fail_lines(ng.error_log_text(), "wn"), 3.0)
    log = ng.error_log_text().splitlines()
    ip = [l for l in log if 'zone "ip"' in l and "[error]" in l]
    wn = [l for l in log if 'zone "wn"' in l and "[error]" in l]
    others = [l for l in log if "[error]" in l and "redis_ratelimit:" in l and 'zone "ip"' not in l
              and 'zone "wn"' not in l]
    h.note("ssl_name=redis.test by IP: background %s (in Redis %d), 3r/m %s; through the sentinel: %s, strict %s"
           % (statuses_str(b), redis_sum(r, "rl:{nd:%s}:60:*" % kb), statuses_str(sm), statuses_str(e),
              statuses_str(es)))
    h.note("without ssl_name: %s" % (ip[0][ip[0].find("redis_ratelimit"):][:200] if ip else "none"))
    h.note("ssl_name=other.test: %s" % (wn[0][wn[0].find("redis_ratelimit"):][:200] if wn else "none"))
    h.check(landed, "counts land, directly and through the sentinel")
    h.check(sm == [200] * 3 + [429] and es == [200] * 3 + [429], "small and strict limits decided in Redis")
    h.check(got and any("not valid for name" in l for l in ip + wn), "the other zones are refused by name")
    h.check(not others, "no error for the named zones: %s" % others[:2])
    h.check(not r.keys("rl:{ip:*") and not r.keys("rl:{wn:*"), "nothing written by the refused zones")
