"""The documentation cannot rot: every ```nginx block of README.md and
docs/*.md passes `nginx -t`, every relative link in them resolves to a file
of the repository (and, for a Markdown file, to one of its headings), the
README stays short, and the docs say what is rather than what happened.

How a block is checked is said by an HTML comment on the line before its
fence (Markdown renders nothing for it):

    (no comment)                  a complete nginx.conf, checked as it is
    <!-- nginx-test: main -->     main-context lines (an `http { ... }`
                                  block): `load_module` of this module and
                                  `events {}` are added when missing
    <!-- nginx-test: http -->     lines for `http {}`: wrapped in
                                  `events {}` and `http { ... }`
    <!-- nginx-test: server -->   lines for `server {}`: wrapped in a
                                  server inside http
    <!-- nginx-test: location --> lines for a `location`: wrapped in
                                  `location /nginx-test/ { ... }` of that
                                  server
    <!-- nginx-test: lua -->      a complete nginx.conf for Debian's nginx
                                  with its Lua module: checked by
                                  /usr/sbin/nginx, with ndk_http_module.so,
                                  ngx_http_lua_module.so and this module
                                  (make build-debian) in its modules/

For `server` and `location` blocks, every zone that a `redis_ratelimit`
line names is declared in the wrapper's http block
(`redis_ratelimit_zone $binary_remote_addr zone=NAME:1m
redis=redis://127.0.0.1:6379;`). Anything else a fragment needs (a `map`,
an upstream) belongs in the block, marked `main` or `http`. There is no
"skip": a block nginx cannot check is not an nginx block.
"""

import json
import os
import re
import shutil
import signal
import subprocess

import harness
from harness import DEBIAN_MODULE, DEBIAN_NGINX, LUA_MODULES, ROOT
from test_tls import example_certificates

LOAD = "load_module modules/ngx_http_redis_ratelimit_module.so;\n"
KINDS = ("complete", "main", "http", "server", "location", "lua")
README_MAX_LINES = 300

MARKER = re.compile(r"^\s*<!--\s*nginx-test:\s*([A-Za-z-]+)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")


def doc_files():
    """README.md and every docs/*.md, as paths relative to the repository."""
    files = ["README.md"]
    docs = os.path.join(ROOT, "docs")
    if os.path.isdir(docs):
        files += sorted("docs/" + f for f in os.listdir(docs) if f.endswith(".md"))
    return files


def read(rel):
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def blocks(rel):
    """The fenced blocks of a Markdown file: (language, first line number of
    the fence, kind from the marker or None, text with the fence's
    indentation removed)."""
    lines = read(rel).split("\n")
    out = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3).lower()
        start = i
        body = []
        i += 1
        while i < len(lines):
            close = lines[i].strip()
            if close.startswith(fence[0] * len(fence)) and close.strip(fence[0]) == "":
                break
            line = lines[i]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            i += 1
        i += 1
        kind = None
        j = start - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        if j >= 0:
            mk = MARKER.match(lines[j])
            if mk:
                kind = mk.group(1)
        out.append((lang, start + 1, kind, "\n".join(body) + "\n"))
    return out


def zones_named(text):
    """Zones that `redis_ratelimit` lines name (not `off`)."""
    names = []
    for m in re.finditer(r"\bredis_ratelimit\s+([^\s;]+)\s+[^\s;]", text):
        if m.group(1) not in names:
            names.append(m.group(1))
    return names


def wrap(kind, text):
    """(configuration text, number of lines before the block's first line)."""
    if kind in ("complete", "lua"):
        return text, 0
    if kind == "main":
        head = "" if "ngx_http_redis_ratelimit_module.so" in text else LOAD
        tail = "" if re.search(r"^\s*events\s*\{", text, re.M) else "events {}\n"
        return head + text + tail, head.count("\n")
    head = LOAD + "events {}\nhttp {\n"
    tail = "}\n"
    if kind in ("server", "location"):
        for z in zones_named(text):
            head += "redis_ratelimit_zone $binary_remote_addr zone=%s:1m redis=redis://127.0.0.1:6379;\n" % z
        head += "server {\nlisten 127.0.0.1:8080;\n"
        tail = "}\n" + tail
        if kind == "location":
            head += "location /nginx-test/ {\n"
            tail = "}\n" + tail
    return head + text + tail, head.count("\n")


def nginx_t(h, nginx, conf_text, modules):
    """`nginx -t` on conf_text in a fresh prefix whose modules/ holds
    `modules`: (exit code, output, path of the configuration)."""
    prefix = os.path.join(h.tmp, "prefix-%d" % len(os.listdir(h.tmp)))
    for d in ("conf", "logs", "modules", "html"):
        os.makedirs(os.path.join(prefix, d), exist_ok=True)
    for m in modules:
        shutil.copy(m, os.path.join(prefix, "modules", os.path.basename(m)))
    conf = os.path.join(prefix, "conf", "nginx.conf")
    with open(conf, "w") as f:
        f.write(conf_text)
    # the files the examples name, which nginx -t reads (password_file=, ssl_*=)
    for name in PASSWORD_FILES:
        with open(os.path.join(prefix, "conf", name), "w") as f:
            f.write("example-password\n")
    # the certificates TLS examples name (ssl_*=, read and checked by nginx -t)
    for name, path in example_certificates(h.tmp).items():
        shutil.copy(path, os.path.join(prefix, "conf", name))
    p = subprocess.run([nginx, "-p", prefix + "/", "-c", conf, "-t"],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=30)
    return p.returncode, p.stdout.decode("utf-8", "replace"), conf


# password files the docs' examples name, relative to nginx's configuration
# prefix (as a relative `password_file=` is)
PASSWORD_FILES = ("redis-ratelimit.pw",)


def where(out, conf, rel, first, offset, nlines):
    """nginx's `in .../nginx.conf:N` turned into the Markdown file's line."""
    m = re.search(re.escape(conf) + r":(\d+)", out)
    if not m:
        return "%s:%d" % (rel, first)
    n = int(m.group(1)) - offset
    if 1 <= n <= nlines:
        return "%s:%d" % (rel, first + n)
    return "%s:%d (in the wrapper the test adds, line %s)" % (rel, first, m.group(1))


def test_nginx_blocks_pass_nginx_t(h):
    """Every ```nginx block of README.md and docs/*.md, wrapped as its
    marker says, passes nginx -t (the vendored nginx with this module; Lua
    blocks on Debian's nginx with its Lua module)."""
    seen = {k: 0 for k in KINDS}
    for rel in doc_files():
        for lang, line, kind, text in blocks(rel):
            if lang != "nginx":
                if kind is not None:
                    h.expect(False, "%s:%d: an nginx-test marker before a ```%s block" % (rel, line, lang))
                continue
            kind = kind or "complete"
            if kind not in KINDS:
                h.expect(False, "%s:%d: unknown marker \"nginx-test: %s\" (one of %s; there is no skip)"
                         % (rel, line, kind, ", ".join(KINDS[1:])))
                continue
            if kind == "complete" and not re.search(r"^\s*events\s*\{", text, re.M):
                h.expect(False, "%s:%d: an nginx block without events {} and without a marker "
                         "(complete it, or mark it <!-- nginx-test: main|http|server|location -->)"
                         % (rel, line))
                continue
            seen[kind] += 1
            conf, offset = wrap(kind, text)
            if kind == "lua":
                missing = [p for p in (DEBIAN_NGINX, DEBIAN_MODULE) + LUA_MODULES if not os.path.exists(p)]
                if missing:
                    h.expect(False, "%s:%d: cannot check a Lua block: %s missing (make build-debian)"
                             % (rel, line, ", ".join(missing)))
                    continue
                rc, out, path = nginx_t(h, DEBIAN_NGINX, conf, (DEBIAN_MODULE,) + LUA_MODULES)
            else:
                rc, out, path = nginx_t(h, harness.NGINX_BIN, conf, [harness.MODULE_SO])
            if rc != 0:
                at = where(out, path, rel, line, offset, text.count("\n"))
                h.expect(False, "%s: nginx -t failed on the %s block:\n%s" % (at, kind, out.strip()))
    h.note("blocks checked: " + ", ".join("%s %d" % (k, n) for k, n in seen.items()))
    h.check(sum(seen.values()) > 0, "no ```nginx block found in README.md and docs/")


def strip_comment(line):
    """The line without its `#` comment (a `#` inside quotes stays)."""
    quote = None
    for i, c in enumerate(line):
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "#":
            return line[:i]
    return line


def block_body(text, name):
    """(body, text before, text after) of the first `name { ... }` block at
    the top level of text; braces inside quotes and comments do not count."""
    code = "\n".join(strip_comment(l) for l in text.split("\n"))
    m = re.search(r"(^|[;{}\s])%s\s*\{" % name, code)
    if not m:
        return None
    start = m.end()
    depth, quote = 1, None
    for i in range(start, len(code)):
        c = code[i]
        if quote:
            if c == quote:
                quote = None
        elif c in "\"'":
            quote = c
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return code[start:i], code[:m.start() + len(m.group(1))], code[i + 1:]
    return None


def recipe_blocks():
    return [(line, text) for lang, line, kind, text in blocks("docs/recipes.md")
            if lang == "nginx"]


def test_recipes_combine(h):
    """The recipes of docs/recipes.md, put together in one http and one
    server block, pass nginx -t: their names do not collide."""
    http_parts, server_parts = [], []
    for line, text in recipe_blocks():
        http = block_body(text, "http")
        h.check(http is not None, "docs/recipes.md:%d: a recipe is an http { ... } block" % line)
        server = block_body(http[0], "server")
        h.check(server is not None, "docs/recipes.md:%d: a recipe has a server { ... } block" % line)
        http_parts.append(server[1] + server[2])
        server_parts.append(server[0])
    h.check(len(http_parts) >= 5, "fewer recipes than expected: %d" % len(http_parts))
    conf = (LOAD + "events {}\nhttp {\n" + "\n".join(http_parts)
            + "\nserver {\nlisten 127.0.0.1:8080;\n" + "\n".join(server_parts) + "\n}\n}\n")
    rc, out, _ = nginx_t(h, harness.NGINX_BIN, conf, [harness.MODULE_SO])
    h.check(rc == 0, "the recipes together fail nginx -t:\n" + out + "\n" + conf)
    h.note("%d recipes combined" % len(http_parts))


def normal(line):
    return " ".join(strip_comment(line).split())


def test_recipes_conf_in_step(h):
    """nginx-conf/recipes.conf holds every line of every recipe of
    docs/recipes.md (comments and spacing aside)."""
    with open(os.path.join(ROOT, "nginx-conf", "recipes.conf")) as f:
        have = {normal(l) for l in f}
    for line, text in recipe_blocks():
        for n, l in enumerate(text.split("\n"), line + 1):
            want = normal(l)
            if want in ("", "}", "http {", "server {"):
                continue
            h.expect(want in have, "docs/recipes.md:%d: not in nginx-conf/recipes.conf: %s" % (n, want))


def slug(heading, used):
    """GitHub's anchor for a heading (lower case, punctuation dropped,
    spaces to hyphens; repeats get -1, -2, ...)."""
    s = re.sub(r"<[^>]+>", "", heading).strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    s = s.replace(" ", "-")
    n = used.get(s, 0)
    used[s] = n + 1
    return s if n == 0 else "%s-%d" % (s, n)


def anchors(rel):
    used = {}
    out = set()
    in_fence = False
    for line in read(rel).split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        m = None if in_fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            out.add(slug(m.group(1), used))
    return out


def links(rel):
    """(line number, target) of every inline and reference link and image
    outside code."""
    out = []
    in_fence = False
    for n, line in enumerate(read(rel).split("\n"), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        text = re.sub(r"`[^`]*`", "", line)
        for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text):
            out.append((n, m.group(1)))
        m = re.match(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(\s|$)", text)
        if m:
            out.append((n, m.group(1)))
    return out


def ignored(path):
    """Whether git ignores the path (build output, not part of the repo)."""
    try:
        p = subprocess.run(["git", "-C", ROOT, "check-ignore", "-q", path],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return p.returncode == 0


def test_relative_links_resolve(h):
    """Every relative link of README.md and docs/*.md names a file of the
    repository, and an anchor names a heading of its Markdown file."""
    checked = 0
    for rel in doc_files():
        base = os.path.dirname(os.path.join(ROOT, rel))
        for n, target in links(rel):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
                continue            # https:, mailto:
            checked += 1
            path, _, frag = target.partition("#")
            full = os.path.normpath(os.path.join(base, path)) if path else os.path.join(ROOT, rel)
            if not full.startswith(ROOT + os.sep) and full != ROOT:
                h.expect(False, "%s:%d: link %s leaves the repository" % (rel, n, target))
                continue
            if not os.path.exists(full):
                h.expect(False, "%s:%d: link %s: no such file" % (rel, n, target))
                continue
            if ignored(full):
                h.expect(False, "%s:%d: link %s: a file git ignores (not in a fresh clone)" % (rel, n, target))
                continue
            if frag and full.endswith(".md"):
                known = anchors(os.path.relpath(full, ROOT))
                h.expect(frag in known, "%s:%d: link %s: no heading with anchor #%s in %s"
                         % (rel, n, target, frag, os.path.relpath(full, ROOT)))
    h.note("%d relative links checked" % checked)


HISTORY = [
    (r"\bsession \d", "a session"),
    (r"\bissue #?\d", "an issue number"),
    (r"FACTS\.md", "a file outside the repository"),
    (r"\bbefore the fix\b", "what used to be"),
    (r"\bused to (take|be|read|cost|go|send|make|show)\b", "what used to be"),
    (r"\bno longer\b", "what used to be"),
    (r"\bsoak run\b", "a run's anecdote"),
]


def test_docs_say_what_is(h):
    """README.md and docs/*.md name no session, issue number or file
    outside the repository, and tell no history (git log has it)."""
    for rel in doc_files():
        for n, line in enumerate(read(rel).split("\n"), 1):
            for pat, what in HISTORY:
                if re.search(pat, line, re.I):
                    h.expect(False, "%s:%d: %s: %s" % (rel, n, what, line.strip()))


def test_readme_is_short(h):
    """README.md stays what a newcomer reads first: at most 300 lines."""
    n = read("README.md").count("\n")
    h.note("README.md: %d lines" % n)
    h.check(n <= README_MAX_LINES, "README.md has %d lines, more than %d: move detail to docs/" % (n, README_MAX_LINES))


def test_the_two_node_example_runs_as_written(h):
    """operations.md's two nodes, run as its shell block says (on this
    test's Redis and on two free ports in place of 8081 and 8082): 12
    requests alternating between the nodes, 10 pass in all, then 429.
    Both masters are stopped by the pids their files hold."""
    found = blocks("docs/operations.md")
    i = next(i for i, b in enumerate(found) if b[0] == "nginx" and "pid logs/node1.pid;" in b[3])
    conf, script = found[i][3], found[i + 1]
    h.check(script[0] == "sh", "the example's shell block follows it")
    r = h.redis()
    base = next(b for b in range(1500, 5500)
                if harness.servers._bindable(b * 10 + 1) and harness.servers._bindable(b * 10 + 2))
    ports = "%d" % base
    work = os.path.join(h.tmp, "nodes")
    harness.write_file(os.path.join(work, "node1.conf"),
                       "load_module %s;\n" % harness.MODULE_SO
                       + conf.replace("6379", str(r.port)).replace("8081", ports + "1"))
    sh = (script[3].replace("build/sbin/nginx", harness.NGINX_BIN).replace("8081", ports + "1")
          .replace("808$", ports + "$"))
    pids = []
    try:
        out = subprocess.run(["bash", "-e", "-c", sh], cwd=work, capture_output=True, text=True, timeout=60)
        for n in (1, 2):
            path = os.path.join(work, "node%d" % n, "logs", "node%d.pid" % n)
            if os.path.exists(path):
                pids.append(int(open(path).read().strip()))
        codes = out.stdout.split()
        h.note("nodes on %s1 and %s2: %s %s" % (ports, ports, " ".join(codes), out.stderr[-300:]))
        h.check(out.returncode == 0 and len(pids) == 2, "the example ran: %s" % out.stderr[-500:])
        h.check(codes == ["200"] * 10 + ["429"] * 2, "10 pass across the two nodes, then 429: %s" % codes)
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGQUIT)
        for pid in pids:
            if not harness.wait_for(lambda: not harness.servers.pid_alive(pid), 5.0):
                os.kill(pid, signal.SIGKILL)


def test_the_api_examples_run_as_written(h):
    """operations.md's API locations, and its two runbook scripts run as
    written (on this test's Redis and a free port in place of 8081): the
    customer's override is in force, the attacker's block was set and
    lifted, each change logged."""
    found = blocks("docs/operations.md")
    conf = next(b[3] for b in found if b[0] == "nginx" and "location /ratelimit-admin/" in b[3])
    scripts = [b[3] for b in found if b[0] == "sh" and "/ratelimit-admin/" in b[3]]
    h.check(len(scripts) == 2, "two runbook scripts: %d" % len(scripts))
    r = h.redis()
    port = harness.free_port()
    n = h.nginx(conf.replace("6379", str(r.port)).replace("8081", str(port)), "")
    outs = []
    for sh in scripts:
        out = subprocess.run(["bash", "-e", "-c", sh.replace("8081", str(port))],
                             capture_output=True, text=True, timeout=30)
        h.check(out.returncode == 0, "the script ran: %s" % out.stderr[-300:])
        outs.append(out.stdout)
    h.check('"key":"cust-42"' in outs[0] and '"rate":"10000r/m"' in outs[0],
            "the customer's state, then the override: %s" % outs[0][:400])
    state = json.loads(harness.servers.http_get(port, "/ratelimit/zones/api/keys/cust-42")[2])
    h.check(state["override"]["rate"] == "10000r/m" and state["override"]["ttl_s"] > 3500,
            "the override holds: %s" % state)
    h.check(outs[1].startswith("[") and '"blocked":{"ttl_s":900' in outs[1], "top, then the block: %s" % outs[1][:400])
    state = json.loads(harness.servers.http_get(port, "/ratelimit/zones/per_ip/keys/203.0.113.7")[2])
    h.check(state["blocked"] is None, "and lifted: %s" % state)
    log = n.error_log_text()
    for line in ('key "cust-42" limited at 10000r/m for 1h (API)', 'key "203.0.113.7" blocked for 15m (API)',
                 'key "203.0.113.7" unblocked (API)'):
        h.check(line in log, "logged: %s" % line)
