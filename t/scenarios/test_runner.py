"""The test runner keeps the project's promise: no test is skipped to get
green. A `.t` file that needs Redis when no redis-server can be started
fails (it is not skipped), and a block left out with `--- SKIP` counts as a
failure. t/runner.py is run on small `.t` files of its own here; their
output is captured and only summed up in notes, so the deliberate failures
inside never print as `not ok` lines in the main log.

And the build's first step: scripts/check-rust (run by the Makefile before
cargo) fails with one line saying what to do when cargo is missing or older
than Cargo.toml's rust-version, here with fake cargos on a PATH of their own.
"""

import os
import re
import subprocess
import sys

from harness import MODULE_SO, NGINX_BIN, ROOT

NEEDS_REDIS = """use Test::Nginx::Socket 'no_plan';
run_tests();

__DATA__

=== TEST 1: a zone on the runner's Redis
--- http_config
    redis_ratelimit_zone $arg_k zone=z:1m redis=redis://127.0.0.1:$TEST_NGINX_REDIS_PORT;
--- config
    location = /t { redis_ratelimit z 10r/s; }
--- user_files
>>> t
ok
--- request
GET /t?k=a
--- error_code: 200
"""

SKIPPED = """use Test::Nginx::Socket 'no_plan';
run_tests();

__DATA__

=== TEST 1: left out
--- SKIP
--- config
    location = /t { return 200; }
--- request
GET /t
--- error_code: 200
"""

# the preprocessor dies on one block and gives the other its config
PREPROCESSOR_DIES = """use Test::Nginx::Socket 'no_plan';
add_block_preprocessor(sub {
    my $block = shift;
    die "no zone for " . $block->name . "\\n" if $block->name =~ /dies/;
    $block->set_value("config", '    location = /t { return 200 "given\\n"; }')
        unless defined $block->config;
});
no_shuffle();
run_tests();

__DATA__

=== TEST 1: the preprocessor dies
--- config
    location = /t { return 200; }
--- request
GET /t

=== TEST 2: the preprocessor gives the config
--- request
GET /t
--- response_body
given
"""


def run_runner(h, name, text, path_env=None):
    f = os.path.join(h.tmp, name)
    with open(f, "w") as out:
        out.write(text)
    env = dict(os.environ, TEST_NGINX_BINARY=NGINX_BIN, TEST_NGINX_LOAD_MODULES=MODULE_SO)
    env.pop("TEST_NGINX_REDIS_PORT", None)
    if path_env is not None:
        env["PATH"] = path_env
    p = subprocess.run([sys.executable, os.path.join(ROOT, "t", "runner.py"), f],
                       capture_output=True, text=True, env=env, timeout=120)
    return p.returncode, p.stdout + p.stderr


def outcome(rc, out):
    """What an inner run reported, in words that are not TAP lines: the
    main log of `make test` must not show its deliberate failures as
    `not ok`."""
    ok = len(re.findall(r"^ok \d+ ", out, re.M))
    failed = len(re.findall(r"^not ok \d+ ", out, re.M))
    summary = re.findall(r"^\d+ passed, \d+ failed$", out, re.M)
    return "exit %d, %d block(s) passed and %d failed, summary line %r" % (
        rc, ok, failed, summary[-1] if summary else None)


def test_no_redis_fails_and_skip_fails(h):
    """PATH without redis-server: the file that needs Redis reports not ok,
    says why, and the run exits non-zero; a --- SKIP block is not ok too."""
    rc, out = run_runner(h, "needs-redis.t", NEEDS_REDIS, path_env=h.tmp)
    h.note("no redis-server on PATH: " + outcome(rc, out))
    h.check(rc != 0, "the run must fail without Redis, exit status was 0")
    h.check(re.search(r"^not ok 1 ", out, re.M), "the block must be reported not ok")
    h.check("Redis is not available" in out, "the failure must say Redis is not available")
    h.check("0 passed, 1 failed" in out, "the summary must count it failed")

    rc, out = run_runner(h, "skipped.t", SKIPPED)
    h.note("--- SKIP: " + outcome(rc, out))
    h.check(rc != 0, "a skipped block must fail the run, exit status was 0")
    h.check(re.search(r"^not ok 1 ", out, re.M), "the skipped block must be reported not ok")
    h.check("skipping a test fails the run" in out, "the skip must be reported as a failure")



def test_preprocessor_error_fails(h):
    """add_block_preprocessor: a handler that dies fails that block, saying
    why (it does not run without it), and the other block gets what the
    handler gave it."""
    rc, out = run_runner(h, "preprocessor.t", PREPROCESSOR_DIES)
    h.note("a handler dying on one of two blocks: " + outcome(rc, out))
    h.check(rc != 0, "the run must fail, exit status was 0")
    h.check(re.search(r"^not ok 1 .*the preprocessor dies$", out, re.M),
            "the block it died on must be reported not ok")
    h.check("no zone for TEST 1: the preprocessor dies" in out, "the failure must give the handler's message")
    h.check(re.search(r"^ok 2 .*gives the config$", out, re.M),
            "the other block must pass with the config the handler set")
    h.check("1 passed, 1 failed" in out, "the summary must count one of each")


CHECK_RUST = os.path.join(ROOT, "scripts", "check-rust")
RUSTUP = "curl https://sh.rustup.rs -sSf | sh"


def rust_version():
    with open(os.path.join(ROOT, "Cargo.toml")) as f:
        m = re.search(r'^rust-version\s*=\s*"([0-9.]+)"', f.read(), re.M)
    return m.group(1)


def fake_cargo(h, name, script):
    """A directory holding only an executable `cargo` running `script`
    (/bin/sh), to be the whole PATH."""
    d = os.path.join(h.tmp, name)
    os.makedirs(d)
    with open(os.path.join(d, "cargo"), "w") as f:
        f.write("#!/bin/sh\n" + script + "\n")
    os.chmod(os.path.join(d, "cargo"), 0o755)
    return d


def check_rust(path, *args, home=None):
    env = {"PATH": path, "HOME": home or path}
    p = subprocess.run(["/bin/bash", CHECK_RUST] + list(args), capture_output=True,
                       text=True, env=env, timeout=30)
    return p.returncode, p.stdout, p.stderr


def test_check_rust(h):
    """scripts/check-rust on an empty PATH (no cargo), with a cargo older
    than Cargo.toml's rust-version, one that does not run, one just new
    enough and one newer (1.100 > 1.88: numbers, not text): one line on
    stderr naming the version needed and rustup's install line, or nothing."""
    need = rust_version()
    parts = [int(x) for x in need.split(".")]
    older = "%d.%d.0" % (parts[0], parts[1] - 1) if parts[1] > 0 else "0.99.0"
    newer = "%d.%d.0" % (parts[0], parts[1] + 12)   # 1.88 -> 1.100: sorts first as text

    def fails_with_one_line(what, rc, out, err, *must):
        h.note("%s: exit %d, %s" % (what, rc, err.strip()))
        h.check(rc != 0, "%s: exit status 0" % what)
        h.check(out == "", "%s: nothing on stdout expected, got %r" % (what, out))
        h.check(err.endswith("\n") and err.count("\n") == 1,
                "%s: one line on stderr expected, got %r" % (what, err))
        for m in ("Rust %s or newer" % need, RUSTUP) + must:
            h.check(m in err, "%s: %r missing from %r" % (what, m, err))

    empty = os.path.join(h.tmp, "empty")
    os.makedirs(empty)
    rc, out, err = check_rust("")
    fails_with_one_line("empty PATH", rc, out, err, "cargo not found")
    rc, out, err = check_rust(empty)
    fails_with_one_line("PATH without cargo", rc, out, err, "cargo not found")

    old = fake_cargo(h, "old", 'echo "cargo %s (fake 2022-01-01)"' % older)
    rc, out, err = check_rust(old)
    fails_with_one_line("cargo %s" % older, rc, out, err, "cargo %s is too old" % older)

    debian = fake_cargo(h, "debian", 'echo "cargo 0.66.0"')
    rc, out, err = check_rust(debian)
    fails_with_one_line("Debian's cargo 0.66.0", rc, out, err, "cargo 0.66.0 is too old")

    broken = fake_cargo(h, "broken", 'echo "error: rustup could not choose a version of cargo to run" >&2\nexit 1')
    rc, out, err = check_rust(broken)
    fails_with_one_line("cargo --version failing", rc, out, err, "rustup could not choose")

    exact = fake_cargo(h, "exact", 'echo "cargo %s.0 (fake)"' % need)
    rc, out, err = check_rust(exact)
    h.check(rc == 0 and out == "" and err == "",
            "cargo %s.0 must pass silently: exit %d, %r %r" % (need, rc, out, err))
    new = fake_cargo(h, "new", 'echo "cargo %s-nightly (fake)"' % newer)
    rc, out, err = check_rust(new)
    h.check(rc == 0 and out == "" and err == "",
            "cargo %s must pass silently: exit %d, %r %r" % (newer, rc, out, err))


def test_make_checks_rust_before_cargo(h):
    """The Makefile runs scripts/check-rust before cargo: `make rust` fails
    with its line on a PATH whose cargo is too old (HOME too: the Makefile
    puts $HOME/.cargo/bin first), and in a dry run (nothing executed) of the
    targets that call cargo, the check comes before the first cargo line;
    build-debian (whose dry run would enter nginx's tree) lists it first
    among its prerequisites."""
    old = fake_cargo(h, "old", 'echo "cargo 1.0.0 (fake)"')
    env = {"PATH": old, "HOME": old}
    p = subprocess.run(["/usr/bin/make", "-s", "-C", ROOT, "rust"], capture_output=True,
                       text=True, env=env, timeout=60)
    h.note("make rust: exit %d, %s" % (p.returncode, p.stderr.strip().splitlines()[:1]))
    h.check(p.returncode != 0, "make rust must fail with cargo 1.0.0")
    h.check("cargo 1.0.0 is too old" in p.stderr and RUSTUP in p.stderr,
            "make rust must say why: %r" % p.stderr)
    for target in ("build", "unit", "check", "run"):
        p = subprocess.run(["/usr/bin/make", "-s", "-n", "-C", ROOT, target], capture_output=True,
                           text=True, env=env, timeout=60)
        lines = p.stdout.splitlines()
        first_check = next((i for i, l in enumerate(lines) if "scripts/check-rust" in l), None)
        first_cargo = next((i for i, l in enumerate(lines) if re.match(r"\s*cargo\s", l)), None)
        h.check(first_check is not None, "make -n %s: no scripts/check-rust line in %r" % (target, lines[:8]))
        h.check(first_cargo is None or first_check < first_cargo,
                "make -n %s: cargo comes before the check: %r" % (target, lines[:8]))
    with open(os.path.join(ROOT, "Makefile")) as f:
        h.check(re.search(r"^build-debian:\s*rust\b", f.read(), re.M),
                "build-debian must have rust as its first prerequisite")
