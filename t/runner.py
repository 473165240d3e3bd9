#!/usr/bin/env python3
"""Run Test::Nginx::Socket-format ``.t`` files against a real nginx.

Stdlib-only Python 3 (3.11) reimplementation of the parts of the Perl
Test::Nginx::Socket scaffold that this project uses.  The Perl module is NOT
needed; the system ``perl`` (with its core JSON::PP) is used as a subprocess
to evaluate ``--- xxx eval`` sections and ``--- init`` code, because those
are real Perl.  Blocks share configuration as in Test::Nginx: a preamble
variable read by an eval section (``our $HttpConfig = qq{...};`` and
``--- http_config eval: $::HttpConfig``), or ``add_block_preprocessor(sub
{...})``, whose handlers get each block (section accessors, ``set_value``)
before it runs, e.g. to give ``http_config`` to the blocks without one.

Usage::

    python3 t/runner.py [--nginx PATH] [--module PATH ...] [-v]
                        [--seed N] [--no-shuffle] [files or dirs ...]

Environment (as in Test::Nginx): TEST_NGINX_BINARY, TEST_NGINX_LOAD_MODULES,
TEST_NGINX_SERVER_PORT (default: a free port), TEST_NGINX_SERVROOT,
TEST_NGINX_LOG_LEVEL, TEST_NGINX_TIMEOUT, TEST_NGINX_SLEEP,
TEST_NGINX_NO_SHUFFLE, TEST_NGINX_USE_HUP, TEST_NGINX_MASTER_PROCESS,
TEST_NGINX_WORKER_USER, TEST_NGINX_EVENT_TYPE, TEST_NGINX_POSTPONE_OUTPUT,
TEST_NGINX_CHECK_ACCUM_ERR_LOG.  Every TEST_NGINX_* variable is available as
``$TEST_NGINX_NAME`` in config text and in %ENV for Perl code.  The runner
adds TEST_NGINX_SERVER_PORT, TEST_NGINX_SERVER_ROOT, TEST_NGINX_HTML_DIR and
(when Redis is needed and available) TEST_NGINX_REDIS_PORT; for files that
mention TEST_NGINX_REDIS_CLUSTER it starts a 3 masters + 3 replicas Redis
Cluster and adds TEST_NGINX_REDIS_CLUSTER_PORTS ("P1 ... P6") and
TEST_NGINX_REDIS_CLUSTER_PORT_1 .. _6 (masters FLUSHALLed before each file).

Output: one ``ok N - <file> <block name>`` / ``not ok ...`` line per block,
diagnostics indented below failures, and a final line
``<P> passed, <F> failed``.  Exit status 0 iff nothing failed and at least
one block ran.  This project does not skip tests: a block left out by
``--- SKIP``, ``--- ONLY`` or ``--- LAST`` is reported as ``not ok`` (those
markers are for debugging a file by hand, never for a green run).
"""

import argparse
import atexit
import errno
import json
import os
import random
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

import servers  # noqa: E402
from servers import free_port, pid_alive  # noqa: E402

L1 = "latin-1"   # all test data is handled as byte-transparent latin-1 text

# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------


def to_bytes(s):
    if isinstance(s, bytes):
        return s
    try:
        return s.encode(L1)
    except UnicodeEncodeError:
        # Perl would print wide characters as UTF-8 (with a warning)
        return s.encode("utf-8")


def emit(line=""):
    """Write one line of output, byte-transparently."""
    try:
        sys.stdout.buffer.write(to_bytes(line) + b"\n")
        sys.stdout.flush()
    except (BrokenPipeError, ValueError):
        pass


def show(s, limit=600):
    """Human readable, escaped rendering of a (possibly binary) string."""
    if s is None:
        return "(undef)"
    if isinstance(s, Regex):
        return str(s)
    if not isinstance(s, str):
        return repr(s)
    r = s.replace("\\", "\\\\").replace("\r", "\\r").replace("\n", "\\n").replace("\t", "\\t")
    r = "".join(ch if (32 <= ord(ch) < 127 or ord(ch) > 255) else "\\x%02x" % ord(ch) for ch in r)
    if len(r) > limit:
        r = r[:limit] + "...(%d chars total)" % len(s)
    return '"' + r + '"'


def parse_time(v):
    """Test::Nginx parse_time: '500ms' -> 0.5, '2s' -> 2, '1.5' -> 1.5."""
    if v is None:
        return None
    v = str(v).strip()
    m = re.fullmatch(r"(.*[^_a-zA-Z])ms", v)
    if m:
        return float(m.group(1)) / 1000.0
    m = re.fullmatch(r"(.*[^_a-zA-Z])s", v)
    if m:
        return float(m.group(1))
    try:
        return float(v)
    except ValueError:
        return None


def perl_true(v):
    return v is not None and v != "" and v != "0"


# --------------------------------------------------------------------------
# process bookkeeping: everything we start is stopped BY PID, never by name
# (the process control itself: t/lib/servers.py)
# --------------------------------------------------------------------------


def pid_is_nginx(pid):
    """A pid read from a pid file is only signalled while it is still nginx."""
    cmd = servers.proc_cmdline(pid)
    return pid_alive(pid) if cmd is None else b"nginx" in cmd


def worker_shutting_down(pid):
    cmd = servers.proc_cmdline(pid)
    return cmd is None or b"shutting down" in cmd


class Reaper:
    """Registry of every process the runner started: nginx masters by pid
    (nginx daemonizes as in Test::Nginx; the pid comes from its pid file) and
    the Redis servers (a servers.Registry)."""

    def __init__(self):
        self.nginx = set()
        self.servers = servers.Registry()

    def cleanup(self):
        for pid in list(self.nginx):
            stop_nginx(pid, grace=1.0)
        self.nginx.clear()
        self.servers.stop_all()


REAPER = Reaper()


def stop_nginx(pid, grace=5.0):
    """SIGQUIT the given nginx master/single process, wait up to `grace`
    seconds, then SIGKILL that pid (and its own worker children, by pid).
    Returns (exited_gracefully, message)."""
    REAPER.nginx.discard(pid)
    if not pid_alive(pid):
        return True, None
    if not pid_is_nginx(pid):
        return True, "pid %d is no longer nginx; not killing it" % pid
    _, graceful = servers.stop_nginx(pid, grace)
    if graceful:
        return True, None
    return False, ("nginx (pid %d) did not exit within %.1fs after SIGQUIT; sent SIGKILL "
                   "(a leaked timer/connection keeps a worker alive?)" % (pid, grace))


def _on_signal(signum, frame):
    # Turn the signal into an exception so that finally: blocks run.
    raise SystemExit(128 + signum)


# --------------------------------------------------------------------------
# Redis (the servers themselves: t/lib/servers.py)
# --------------------------------------------------------------------------


class _LazyRedis:
    """What both managers share: a Redis of ours is started at most once,
    and only if some selected file needs it (``ensure``); one that the
    environment names is used as is (``external``, never flushed); ours is
    registered in REAPER and stopped by its PID, its files in a temp dir."""

    ENV = None                  # the variable naming an external one

    def __init__(self, verbose=False):
        self.verbose = verbose
        self.server = None          # servers.RedisServer / RedisCluster of ours
        self.tmpdir = None
        self.error = None
        self.tried = False
        self.external = False

    def ensure(self, used_ports):
        if self.tried:
            return
        self.tried = True
        ext = os.environ.get(self.ENV)
        if ext:
            self.use_external(ext)
        else:
            self.start(used_ports)

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


class RedisManager(_LazyRedis):
    """Starts ONE standalone redis-server lazily (only if some selected file
    mentions TEST_NGINX_REDIS); exports TEST_NGINX_REDIS_PORT."""

    ENV = "TEST_NGINX_REDIS_PORT"

    def __init__(self, verbose=False):
        super().__init__(verbose)
        self.port = None

    def use_external(self, ext):
        self.port = int(ext)
        self.external = True

    def start(self, used_ports):
        if not shutil.which("redis-server"):
            self.error = "redis-server is not on PATH"
            return
        self.tmpdir = tempfile.mkdtemp(prefix="ngxtest-redis-")
        err = None
        for _attempt in range(3):
            server = servers.RedisServer(self.tmpdir, free_port(used_ports),
                                         registry=REAPER.servers)
            try:
                server.start()
            except RuntimeError as e:   # it stopped the server
                err = e
                continue
            self.server, self.port = server, server.port
            used_ports.add(server.port)
            if self.verbose:
                emit("# started redis-server pid %d on port %d" % (server.pid, server.port))
            return
        self.error = "could not start redis-server: %s" % str(err).strip()

    def flush(self):
        """FLUSHALL our own (never an external) Redis before each file."""
        if self.port and not self.external:
            try:
                servers.call(self.port, "FLUSHALL", timeout=2.0)
            except (OSError, servers.RedisError):
                pass


class RedisClusterManager(_LazyRedis):
    """Starts ONE 3+3 Redis Cluster lazily (only if some selected file
    mentions TEST_NGINX_REDIS_CLUSTER); exports TEST_NGINX_REDIS_CLUSTER_PORTS
    ("P1 ... P6", space-separated) and TEST_NGINX_REDIS_CLUSTER_PORT_1..6.
    An externally given TEST_NGINX_REDIS_CLUSTER_PORTS is used as is (and
    never flushed)."""

    ENV = "TEST_NGINX_REDIS_CLUSTER_PORTS"

    def __init__(self, verbose=False):
        super().__init__(verbose)
        self.ports = []

    def use_external(self, ext):
        try:
            self.ports = [int(x) for x in ext.replace(",", " ").split()]
        except ValueError:
            self.error = "TEST_NGINX_REDIS_CLUSTER_PORTS=%r is not a list of ports" % ext
            self.ports = []
            return
        self.external = True

    def start(self, used_ports):
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            self.error = "could not start a Redis Cluster: redis-server/redis-cli not on PATH"
            return
        self.tmpdir = tempfile.mkdtemp(prefix="ngxtest-rcluster-")
        err = None
        for attempt in range(3):
            cluster = servers.RedisCluster.in_dir(os.path.join(self.tmpdir, str(attempt)),
                                                  registry=REAPER.servers, exclude=used_ports)
            try:
                cluster.start(timeout=30.0)
            except Exception as e:      # it stopped its nodes
                err = e
                continue
            self.server, self.ports = cluster, cluster.ports
            used_ports.update(self.ports)
            used_ports.update(p + 10000 for p in self.ports)
            if self.verbose:
                emit("# started Redis Cluster (pids %s) on ports %s" % (
                    " ".join(str(r.pid) for r in cluster.nodes), " ".join(map(str, self.ports))))
            return
        self.error = "could not start a Redis Cluster: %s" % err

    def env(self):
        if not self.ports:
            return {}
        e = {"TEST_NGINX_REDIS_CLUSTER_PORTS": " ".join(str(p) for p in self.ports)}
        for i, p in enumerate(self.ports, 1):
            e["TEST_NGINX_REDIS_CLUSTER_PORT_%d" % i] = str(p)
        return e

    def flush(self):
        """FLUSHALL every master of our own (never an external) cluster,
        then wait (briefly) for the replicas to follow."""
        if not self.ports or self.external:
            return
        for port in self.ports:
            try:
                role = servers.call(port, "ROLE", timeout=2.0)
                if isinstance(role, list) and role and role[0] == "master":
                    servers.call(port, "FLUSHALL", timeout=2.0)
            except (OSError, servers.RedisError):
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                if all(servers.call(port, "DBSIZE", timeout=2.0) == 0 for port in self.ports):
                    break
            except (OSError, servers.RedisError):
                break
            time.sleep(0.02)


# --------------------------------------------------------------------------
# Perl regex -> Python regex
# --------------------------------------------------------------------------

_POSIX_CLASSES = {
    "alpha": "a-zA-Z", "digit": "0-9", "alnum": "a-zA-Z0-9", "upper": "A-Z",
    "lower": "a-z", "space": " \\t\\n\\r\\f\\v", "xdigit": "0-9A-Fa-f",
    "word": "\\w", "punct": "!-/:-@\\[-`{-~", "blank": " \\t", "cntrl": "\\x00-\\x1f\\x7f",
    "print": "\\x20-\\x7e", "graph": "\\x21-\\x7e",
}


def perl_to_py_regex(pat):
    out = []
    i, n = 0, len(pat)
    in_class = False
    while i < n:
        c = pat[i]
        if c == "\\" and i + 1 < n:
            d = pat[i + 1]
            if d == "Q":
                j = pat.find("\\E", i + 2)
                lit = pat[i + 2:] if j < 0 else pat[i + 2:j]
                if in_class:
                    out.append("".join("\\" + ch if ch in "\\]^-[" else ch for ch in lit))
                else:
                    out.append(re.escape(lit))
                i = n if j < 0 else j + 2
                continue
            if d == "E":
                i += 2
                continue
            if d == "h":
                out.append(" \\t" if in_class else "[ \\t]")
                i += 2
                continue
            if d == "H" and not in_class:
                out.append("[^ \\t]")
                i += 2
                continue
            if d == "e":
                out.append("\\x1b")
                i += 2
                continue
            if d in "xo" and i + 2 < n and pat[i + 2] == "{":
                j = pat.find("}", i + 3)
                if j > 0:
                    try:
                        cp = int(pat[i + 3:j], 16 if d == "x" else 8)
                        out.append("\\x%02x" % cp if cp < 256 else "\\u%04x" % cp)
                        i = j + 1
                        continue
                    except ValueError:
                        pass
            if not in_class:
                if d == "z":
                    out.append("\\Z")
                    i += 2
                    continue
                if d == "Z":
                    out.append("(?=\\n?\\Z)")
                    i += 2
                    continue
                if d == "k" and i + 2 < n and pat[i + 2] in "<{'":
                    close = {"<": ">", "{": "}", "'": "'"}[pat[i + 2]]
                    j = pat.find(close, i + 3)
                    if j > 0:
                        out.append("(?P=%s)" % pat[i + 3:j])
                        i = j + 1
                        continue
            out.append(pat[i:i + 2])
            i += 2
            continue
        if in_class:
            if c == "[" and pat.startswith("[:", i):
                j = pat.find(":]", i + 2)
                if j > 0:
                    name = pat[i + 2:j]
                    neg = name.startswith("^")
                    if not neg and name in _POSIX_CLASSES:
                        out.append(_POSIX_CLASSES[name])
                        i = j + 2
                        continue
            if c == "[":
                out.append("\\[")
                i += 1
                continue
            if c == "]":
                in_class = False
            out.append(c)
            i += 1
            continue
        if c == "[":
            in_class = True
            out.append(c)
            i += 1
            if pat[i:i + 1] == "^":
                out.append("^")
                i += 1
            if pat[i:i + 1] == "]":
                out.append("\\]")
                i += 1
            continue
        if c == "(" and pat.startswith("(?<", i) and pat[i + 3:i + 4] not in ("=", "!"):
            out.append("(?P<")
            i += 3
            continue
        if c == "(" and pat.startswith("(?'", i):
            j = pat.find("'", i + 3)
            if j > 0:
                out.append("(?P<%s>" % pat[i + 3:j])
                i = j + 1
                continue
        if c == "(" and pat.startswith("(?^", i):
            # (?^flags: ...) from a stringified qr// nested in a pattern
            m = re.match(r"\(\?\^([a-z]*):", pat[i:])
            if m:
                fl = "".join(ch for ch in m.group(1) if ch in "imsx")
                out.append("(?%s:" % fl if fl else "(?:")
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


class Regex:
    """A Perl regex (qr// object, or a text pattern from a *_like section)."""

    def __init__(self, pattern, flags=""):
        self.pattern = pattern
        self.flags = flags or ""
        self._re = None

    def compile(self, extra=0):
        if self._re is None or extra:
            fl = re.ASCII
            for ch in self.flags:
                fl |= {"i": re.I, "m": re.M, "s": re.S, "x": re.X}.get(ch, 0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    rx = re.compile(perl_to_py_regex(self.pattern), fl | extra)
                except re.error as e:
                    raise BlockError("cannot translate Perl regex %s to Python: %s" % (self, e))
            if extra:
                return rx
            self._re = rx
        return self._re

    def search(self, s, extra=0):
        return self.compile(extra).search(s)

    def __str__(self):
        return "qr/%s/%s" % (self.pattern, self.flags)


# --------------------------------------------------------------------------
# Perl helper (eval sections, preamble side effects, block preprocessors, init)
# --------------------------------------------------------------------------

PERL_HELPER = r'''
BEGIN { $SIG{__WARN__} = sub { print STDERR "perl warning: ", @_ }; }
package Test::Base::Filter;
use strict; use warnings;
sub __runner_eval { return CORE::eval($_[0]); }

# A block as add_block_preprocessor's handlers get it, Test::Base's way: every
# section (and name, description) an array in the object's hash, read
# through an accessor of its name (the first value, or all of them in list
# context; nothing for a section the block lacks), written with set_value.
package Test::Base::Block;
use Carp ();
our $AUTOLOAD;
sub new { my ($class, %h) = @_; return bless {%h}, $class; }
sub seq_num { return $_[0]{seq_num}; }
sub set_value {
    my ($self, $name, @value) = @_;
    $self->{$name} = [@value];
}
sub AUTOLOAD {
    my $self = shift;
    (my $name = $AUTOLOAD) =~ s/.*:://;
    return if $name eq 'DESTROY';
    Carp::croak("Not allowed to set values for '$name'") if @_;
    my @list = @{ $self->{$name} || [] };
    return wantarray ? @list : $list[0];
}

package main;
use JSON::PP ();
binmode STDIN;
# the replies go to the real stdout; what the .t file's code prints, to stderr
open(my $__rn_reply, '>&', \*STDOUT) or die "dup stdout: $!";
open(STDOUT, '>&', \*STDERR) or die "stdout to stderr: $!";
binmode $__rn_reply;
$__rn_reply->autoflush(1);
my $__rn_json = JSON::PP->new->latin1->canonical->allow_nonref;

our @__rn_preprocessors;
sub add_block_preprocessor(&) { unshift @__rn_preprocessors, shift; }
{
    no strict 'refs';
    *{"Test::Nginx::${_}::add_block_preprocessor"} = \&add_block_preprocessor for qw(Socket Util);
}

sub __rn_conv {
    my ($v, $d) = @_;
    return undef unless defined $v;
    return { __unsupported__ => 'too deep' } if ($d || 0) > 50;
    my $r = ref $v;
    return "$v" unless $r;
    if ($r eq 'Regexp') {
        my ($p, $m) = re::regexp_pattern($v);
        return { __regex__ => $p, flags => $m };
    }
    return [ map { __rn_conv($_, ($d || 0) + 1) } @$v ] if $r eq 'ARRAY';
    return { __hash__ => { map { ($_ => __rn_conv($v->{$_}, ($d || 0) + 1)) } keys %$v } }
        if $r eq 'HASH';
    return __rn_conv($$v, ($d || 0) + 1) if $r eq 'SCALAR' || $r eq 'REF';
    return { __unsupported__ => $r eq 'Test::Nginx::Runner::Unsupported' ? $v->{what} : $r };
}

# the inverse: a value the runner holds, as Perl
sub __rn_from {
    my ($v) = @_;
    my $r = ref $v;
    return $v unless $r;
    return [ map { __rn_from($_) } @$v ] if $r eq 'ARRAY';
    if (exists $v->{__regex__}) {
        my $p = $v->{__regex__};
        (my $flags = $v->{flags} // '') =~ s/[^msixpn]//g;
        return eval "qr/\$p/$flags" || die "qr/$p/$flags: $@";
    }
    return { map { ($_ => __rn_from($v->{__hash__}{$_})) } keys %{ $v->{__hash__} } }
        if exists $v->{__hash__};
    return bless { what => $v->{__unsupported__} }, 'Test::Nginx::Runner::Unsupported';
}

sub __rn_env { return { map { ($_ => $ENV{$_}) } grep { /^TEST_NGINX_/ } keys %ENV }; }

# first request: stubs, the preamble, the eval sections
sub __rn_eval {
    my ($req) = @_;
    {
        no strict 'refs';
        my $vals = $req->{stub_values} || {};
        for my $f (@{ $req->{stubs} || [] }) {
            next if defined &{"main::$f"};
            my $v = $vals->{$f};
            *{"main::$f"} = sub { return defined $v ? $v : 1 };
        }
    }
    my $pre_err;
    if (defined $req->{preamble} && length $req->{preamble}) {
        local $@;
        my $ok = eval("package main; no strict; no warnings;\n#line 1 \"preamble\"\n"
                      . $req->{preamble} . "\n;1");
        $pre_err = "$@" unless $ok;
    }
    my @out;
    for my $code (@{ $req->{codes} || [] }) {
        local $@;
        my @r = Test::Base::Filter::__runner_eval($code);
        if ($@) {
            push @out, { ok => 0, error => "$@" };
        } else {
            push @out, { ok => 1, values => [ map { __rn_conv($_) } @r ] };
        }
    }
    return { results => \@out, env => __rn_env(), preamble_error => $pre_err,
             preprocessors => scalar @__rn_preprocessors };
}

# second request: every block through the preprocessors, as Test::Nginx does
# before running it; the reply holds the sections they set or removed
my %__rn_own = map { ($_ => 1) } qw(name description seq_num);
sub __rn_preprocess {
    my ($req) = @_;
    my @out;
    for my $in (@{ $req->{blocks} }) {
        my %h = (name => [$in->{name}], description => [$in->{name}], seq_num => $in->{seq});
        my $block;
        my %before;
        my $ok = eval {
            for my $s (keys %{ $in->{sections} }) {
                $h{$s} = __rn_from($in->{sections}{$s});
            }
            $block = Test::Base::Block->new(%h);
            %before = map { ($_ => $__rn_json->encode(__rn_conv($block->{$_}))) }
                      grep { !$__rn_own{$_} } keys %$block;
            $_->($block) for @__rn_preprocessors;
            1;
        };
        if (!$ok) {
            push @out, { error => "$@" };
            next;
        }
        my (%set, @removed);
        for my $s (keys %$block) {
            next if $__rn_own{$s} || $s =~ /^_/;
            my $v = $block->{$s};
            $v = [$v] unless ref $v eq 'ARRAY';
            my $now = __rn_conv($v);
            $set{$s} = $now if !exists $before{$s} || $before{$s} ne $__rn_json->encode($now);
        }
        @removed = grep { !exists $block->{$_} } sort keys %before;
        push @out, { set => \%set, removed => \@removed };
    }
    return { blocks => \@out, env => __rn_env() };
}

while (defined(my $line = <STDIN>)) {
    my $req = $__rn_json->decode($line);
    my $op = $req->{op} // '';
    my $reply = $op eq 'eval' ? __rn_eval($req)
              : $op eq 'preprocess' ? __rn_preprocess($req)
              : { error => "unknown request '$op'" };
    print $__rn_reply $__rn_json->encode($reply), "\n";
}
'''

PERL_INIT_HELPER = r'''
package Test::Nginx::Util;
use Time::HiRes qw(sleep time);
binmode STDIN;
my $__rn_code = do { local $/; <STDIN> };
my $__rn_ok = eval("use strict; use warnings;\n#line 1 \"init\"\n" . $__rn_code . "\n;1");
if (!$__rn_ok) { print STDERR "init failed: $@"; exit 1; }
exit 0;
'''

PREAMBLE_STUBS = [
    "master_on", "master_off", "workers", "worker_connections", "repeat_each",
    "no_shuffle", "use_hup", "no_long_string", "log_level", "no_root_location",
    "plan", "run_tests", "blocks", "env_to_nginx", "config_preamble",
    "master_process_enabled", "timeout", "server_name", "server_addr",
    "server_root", "html_dir", "server_port", "server_port_for_client",
    "no_nginx_manager", "check_accum_error_log", "bail_out",
    "add_test_cleanup_handler", "add_cleanup_handler", "add_response_body_check", "set_http_config_filter", "no_diff", "filters",
    "no_diag_on_only", "run_tests", "is_str", "sleep_time", "verbose",
]


def from_perl_json(v):
    if isinstance(v, dict):
        if "__regex__" in v:
            return Regex(v["__regex__"], v.get("flags") or "")
        if "__hash__" in v:
            return {k: from_perl_json(x) for k, x in v["__hash__"].items()}
        if "__unsupported__" in v:
            return Unsupported(v["__unsupported__"])
        return {k: from_perl_json(x) for k, x in v.items()}
    if isinstance(v, list):
        return [from_perl_json(x) for x in v]
    return v


class Unsupported:
    def __init__(self, what):
        self.what = what

    def __repr__(self):
        return "<unsupported Perl value %s>" % self.what


def to_perl_json(v):
    """A section's value as from_perl_json reads it (the helper's __rn_from
    turns it back into Perl: qr// for a Regex)."""
    if isinstance(v, Regex):
        return {"__regex__": v.pattern, "flags": v.flags}
    if isinstance(v, Unsupported):
        return {"__unsupported__": v.what}
    if isinstance(v, dict):
        return {"__hash__": {k: to_perl_json(x) for k, x in v.items()}}
    if isinstance(v, list):
        return [to_perl_json(x) for x in v]
    return v


class PerlError(Exception):
    """The Perl helper failed (died, timed out, answered nonsense)."""


class PerlSession:
    """PERL_HELPER running for one .t file: ask() sends one request (a JSON
    line) and returns its reply (a JSON line).  The process is ours and is
    killed (by its Popen) when the whole session takes over `timeout` s."""

    def __init__(self, env, timeout=120.0):
        self.timeout = timeout
        self.expired = False
        self.stderr = tempfile.TemporaryFile()
        self.error = None
        try:
            self.p = subprocess.Popen(["perl", "-e", PERL_HELPER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=self.stderr, env=env)
        except OSError as e:
            self.p = None
            self.error = "cannot run perl: %s" % e
            return
        self.timer = threading.Timer(timeout, self._expire)
        self.timer.daemon = True
        self.timer.start()

    def _expire(self):
        self.expired = True
        try:
            self.p.kill()
        except OSError:
            pass

    def ask(self, req):
        if self.p is None:
            raise PerlError(self.error)
        try:
            self.p.stdin.write(json.dumps(req).encode("ascii") + b"\n")
            self.p.stdin.flush()
            line = self.p.stdout.readline()
        except OSError:
            line = b""
        if not line:
            raise PerlError(self.failure())
        try:
            return json.loads(line.decode(L1))
        except ValueError as e:
            raise PerlError("perl helper answered %s: %s" % (show(line.decode(L1), 200), e))

    def failure(self):
        if self.expired:
            return "perl helper timed out after %.0fs" % self.timeout
        try:
            rc = self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            rc = None
        return "perl helper failed (exit %s): %s" % (rc, self.stderr_text()[-2000:])

    def stderr_text(self):
        self.stderr.seek(0)
        return self.stderr.read().decode(L1)

    def close(self):
        """End the process (EOF on its stdin); returns its stderr."""
        if self.p is None:
            return ""
        try:
            self.p.stdin.close()
        except OSError:
            pass
        try:
            self.p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        self.timer.cancel()
        self.p.stdout.close()
        text = self.stderr_text()
        self.stderr.close()
        return text


# --------------------------------------------------------------------------
# .t file parsing (Test::Base format)
# --------------------------------------------------------------------------


class BlockError(Exception):
    """Something Test::Nginx would bail out on; fails the current block."""


class Block:
    def __init__(self, name, seq):
        self.name = name
        self.seq = seq
        self.values = {}     # section -> list of values (Test::Base semantics)
        self.order = []
        self.pending = []    # [(section, code, post_filters)] eval jobs
        self.errors = []
        self.preprocessed = set()   # sections set by add_block_preprocessor

    def has(self, k):
        """Perl: defined $block->k"""
        v = self.values.get(k)
        return bool(v) and v[0] is not None

    def get(self, k):
        v = self.values.get(k)
        return v[0] if v else None

    def exists(self, k):
        return k in self.values


SECTION_RE = re.compile(r"^---[ ]+\(?(\w+)\)?[ ]*(.*)\n", re.M)
HUNK_RE = re.compile(r"^(===.*?(?=^===|\Z))", re.M | re.S)
ONE_LINE_RE = re.compile(r":(\s|\Z)")


def f_norm(vals):
    return [v.replace("\r\n", "\n").replace("\r", "\n") if isinstance(v, str) else v for v in vals]


def f_trim(vals):
    res = []
    for v in vals:
        if isinstance(v, str):
            v = re.sub(r"\A([ \t]*\n)+", "", v)
            v = re.sub(r"(?<=\n)\s*\Z", "", v, count=1, flags=re.ASCII)
        res.append(v)
    return res


def f_chomp(vals):
    return [v[:-1] if isinstance(v, str) and v.endswith("\n") else v for v in vals]


def f_chop(vals):
    return [v[:-1] if isinstance(v, str) else v for v in vals]


def f_lines(vals):
    if not vals or not isinstance(vals[0], str) or not vals[0]:
        return []
    return re.findall(r"[^\n]*\n|[^\n]+\Z", vals[0])


def f_array(vals):
    return [list(vals)]


def f_unchomp(vals):
    return [v + "\n" if isinstance(v, str) else v for v in vals]


FILTERS = {"norm": f_norm, "trim": f_trim, "chomp": f_chomp, "chop": f_chop,
           "lines": f_lines, "array": f_array, "unchomp": f_unchomp}


def apply_filters(block, section, vals, filters):
    for i, flt in enumerate(filters):
        if flt == "eval":
            block.pending.append((section, "".join(v for v in vals if isinstance(v, str)),
                                  filters[i + 1:]))
            return None
        fn = FILTERS.get(flt)
        if fn is None:
            block.errors.append("section '%s': unsupported Test::Base filter '%s'" % (section, flt))
            return vals
        vals = fn(vals)
    return vals


def parse_blocks(data):
    blocks = []
    for seq, hunk in enumerate(HUNK_RE.findall(data), 1):
        m = re.match(r"===[ \t]*(.*)\s+", hunk)
        if not m:
            m = re.match(r"===[ \t]*(.*)", hunk)
        name = m.group(1).strip()
        rest = hunk[m.end():]
        blk = Block(name, seq)
        parts = SECTION_RE.split(rest)
        parts.pop(0)   # description
        while len(parts) >= 3:
            stype, filt, value = parts[0], parts[1] or "", parts[2] or ""
            parts = parts[3:]
            if ONE_LINE_RE.search(filt):
                if re.search(r"\S", value):
                    blk.errors.append("extra lines not allowed in '%s' section" % stype)
                sp = re.split(r"\s*:(?:\s+|\Z)", filt, maxsplit=1)
                filt = sp[0]
                value = sp[1] if len(sp) > 1 else ""
                value = value.strip()
            flist = ["norm", "trim"]
            append = []
            for f in filt.split():
                if f.startswith("-"):
                    flist = [x for x in flist if x != f[1:]]
                elif f.startswith("+"):
                    append.append(f[1:])
                else:
                    flist.append(f)
            flist += append
            blk.order.append(stype)
            vals = apply_filters(blk, stype, [value], flist)
            blk.values[stype] = vals if vals is not None else []
        blocks.append(blk)
    return blocks


def strip_perl_comments(text):
    out = []
    for line in text.split("\n"):
        res, q, i = [], None, 0
        while i < len(line):
            ch = line[i]
            if q:
                if ch == "\\":
                    res.append(line[i:i + 2])
                    i += 2
                    continue
                if ch == q:
                    q = None
            elif ch in "'\"":
                q = ch
            elif ch == "#" and (i == 0 or line[i - 1] != "$"):
                break
            res.append(ch)
            i += 1
        out.append("".join(res))
    # drop POD
    return re.sub(r"(?ms)^=[a-zA-Z].*?^=cut\b.*?$", "", "\n".join(out))


KNOWN_PREAMBLE = {
    "master_on", "master_off", "workers", "worker_connections", "repeat_each",
    "no_shuffle", "use_hup", "no_long_string", "log_level", "no_root_location",
    "plan", "run_tests", "env_to_nginx", "timeout", "check_accum_error_log",
    "no_diff", "master_process_enabled",
}
PERL_WORDS = {
    "if", "unless", "elsif", "else", "for", "foreach", "while", "until", "my",
    "our", "local", "sub", "print", "printf", "warn", "die", "push", "pop",
    "shift", "unshift", "return", "sleep", "system", "exec", "eval", "do",
    "require", "use", "no", "BEGIN", "END", "defined", "qw", "q", "qq", "map",
    "grep", "join", "split", "sprintf", "length", "substr", "lc", "uc", "keys",
    "values", "exists", "delete", "open", "close", "chomp", "ref", "scalar",
    "abs", "int", "rand", "srand", "time", "exit", "binmode", "mkdir", "unlink",
    "sort", "reverse", "wantarray", "blocks", "server_port", "html_dir",
    "server_root", "sleep_time", "verbose", "catfile", "rel2abs", "cwd",
    "dirname", "basename", "not", "and", "or",
}


class Preamble:
    def __init__(self, text, env):
        self.text = text
        self.warnings = []
        self.master = None
        self.workers = 1
        self.worker_connections = 64
        self.repeat_each = 1
        self.no_shuffle = bool(env.get("TEST_NGINX_NO_SHUFFLE"))
        self.use_hup = bool(env.get("TEST_NGINX_USE_HUP"))
        self.log_level = None
        self.no_root_location = False
        self.timeout = None
        self.env_to_nginx = []
        self.check_accum = bool(env.get("TEST_NGINX_CHECK_ACCUM_ERR_LOG"))
        self.preprocessed = False   # add_block_preprocessor(...) in it
        self.parse()

    def parse(self):
        s = strip_perl_comments(self.text)
        if re.search(r"\bmaster_on\s*\(\s*\)", s):
            self.master = True
        if re.search(r"\bmaster_off\s*\(\s*\)", s):
            self.master = False
        m = re.search(r"\bmaster_process_enabled\s*\(\s*(\d+)\s*\)", s)
        if m:
            self.master = m.group(1) != "0"
        for name in ("workers", "worker_connections", "repeat_each"):
            for m in re.finditer(r"\b%s\s*\(\s*(\d+)\s*\)" % name, s):
                setattr(self, name, int(m.group(1)))
        if re.search(r"\bno_shuffle\s*\(\s*\)", s):
            self.no_shuffle = True
        if re.search(r"\buse_hup\s*\(\s*\)", s):
            self.use_hup = True
        if re.search(r"\bno_root_location\s*\(\s*\)", s):
            self.no_root_location = True
        if re.search(r"\bcheck_accum_error_log\s*\(\s*\)", s):
            self.check_accum = True
        for m in re.finditer(r"\blog_level\s*\(\s*(['\"])(\w+)\1\s*\)", s):
            self.log_level = m.group(2)
        for m in re.finditer(r"\btimeout\s*\(\s*['\"]?([\d.]+(?:ms|s)?)['\"]?\s*\)", s):
            self.timeout = parse_time(m.group(1))
        for m in re.finditer(r"\benv_to_nginx\s*\(([^)]*)\)", s):
            self.env_to_nginx += [a or b for a, b in re.findall(r"'([^']*)'|\"([^\"]*)\"", m.group(1))]
        if not re.search(r"\brun_tests\s*\(\s*\)|\brun_tests\s*;", s):
            self.warnings.append("preamble does not call run_tests()")
        self.preprocessed = re.search(r"\badd_block_preprocessor\b", s) is not None
        for m in re.finditer(r"(?:^|[;{}])\s*&?([A-Za-z_][\w:]*)\s*\(", s, re.M):
            name = m.group(1)
            if name in KNOWN_PREAMBLE or name in PERL_WORDS or "::" in name:
                continue
            if name == "add_block_preprocessor":
                continue
            self.warnings.append("unknown preamble call %s(...) ignored" % name)

    def perl_code(self):
        """Preamble text as run (with stubs) by the eval helper: only for its
        side effects on %ENV and package variables used by eval sections."""
        lines = []
        for line in self.text.split("\n"):
            if re.match(r"\s*use\s+(Test::Nginx|t::)", line) or re.match(r"\s*__(END|DATA)__", line):
                lines.append("")
            else:
                lines.append(line)
        return "\n".join(lines)


# --------------------------------------------------------------------------
# HTTP client
# --------------------------------------------------------------------------


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


# --------------------------------------------------------------------------
# the runner
# --------------------------------------------------------------------------


class Settings:
    pass


class BlockOutcome:
    def __init__(self):
        self.failures = []
        self._seen = {}
        self.warnings = []
        self.verbose = []

    def fail(self, msg):
        if msg in self._seen:
            self._seen[msg] += 1
            return
        self._seen[msg] = 1
        self.failures.append(msg)

    def final_failures(self, limit=40):
        out = []
        for m in self.failures[:limit]:
            n = self._seen.get(m, 1)
            out.append(m + ("  [x%d]" % n if n > 1 else ""))
        if len(self.failures) > limit:
            out.append("... and %d more distinct failure(s)" % (len(self.failures) - limit))
        return out


class FileRunner:
    def __init__(self, runner, path):
        self.runner = runner
        self.cfg = runner.cfg
        self.path = path
        self.rel = os.path.relpath(path) if not path.startswith("..") else path
        self.nginx_pid = None
        self.prev_config = None
        self.first_time = True
        self.config_version = None
        self.root = None
        self.servroot = None
        self.any_failed = False
        self.started_nginx = False
        self.own_servroot = True
        self.file_needs_redis = False
        self.file_needs_cluster = False
        self.file_warnings = []
        self.use_hup_now = False
        self.block_used_nginx = False

    # ---- paths ----
    @property
    def logdir(self):
        return os.path.join(self.servroot, "logs")

    @property
    def errlog(self):
        return os.path.join(self.servroot, "logs", "error.log")

    @property
    def acclog(self):
        return os.path.join(self.servroot, "logs", "access.log")

    @property
    def htmldir(self):
        return os.path.join(self.servroot, "html")

    @property
    def confdir(self):
        return os.path.join(self.servroot, "conf")

    @property
    def conffile(self):
        return os.path.join(self.servroot, "conf", "nginx.conf")

    @property
    def pidfile(self):
        return os.path.join(self.servroot, "logs", "nginx.pid")

    def vprint(self, msg):
        if self.cfg.verbose:
            for line in msg.split("\n"):
                emit("    | " + line)

    # ---- setup ----
    def setup_root(self):
        self.root = tempfile.mkdtemp(prefix="ngxtest-")
        os.chmod(self.root, 0o755)
        if os.environ.get("TEST_NGINX_SERVROOT"):
            self.servroot = os.path.abspath(os.environ["TEST_NGINX_SERVROOT"])
            self.own_servroot = False
        else:
            self.servroot = os.path.join(self.root, "servroot")
            self.own_servroot = True
        os.makedirs(self.servroot, exist_ok=True)
        os.chmod(self.servroot, 0o755)
        # warn if nobody-workers cannot traverse to the servroot
        p = os.path.dirname(self.servroot)
        while p and p != "/":
            try:
                if not (os.stat(p).st_mode & 0o001):
                    emit("# WARNING: %s is not world-traversable; nginx workers running as "
                         "an unprivileged user may not reach %s" % (p, self.servroot))
                    break
            except OSError:
                break
            p = os.path.dirname(p)

    def clean_servroot(self, hup=False):
        if hup:
            # Test::Nginx (use_hup): remove every plain file except the pid
            # file, sockets, certificates and keys; keep directories.
            for dirpath, dirnames, filenames in os.walk(self.servroot):
                for fn in filenames:
                    if re.search(r"(?:\bnginx\.pid|\.sock|\.crt|\.key)$", fn):
                        continue
                    try:
                        os.unlink(os.path.join(dirpath, fn))
                    except OSError:
                        pass
        else:
            if self.own_servroot:
                for e in os.listdir(self.servroot):
                    full = os.path.join(self.servroot, e)
                    if os.path.isdir(full) and not os.path.islink(full):
                        shutil.rmtree(full, ignore_errors=True)
                    else:
                        try:
                            os.unlink(full)
                        except OSError:
                            pass
            else:
                for e in os.listdir(self.servroot):
                    if e in ("conf", "logs", "html", "cache") or e.endswith("_temp") or e.endswith("_cache"):
                        shutil.rmtree(os.path.join(self.servroot, e), ignore_errors=True)
        for d in (self.logdir, self.htmldir, self.confdir):
            os.makedirs(d, exist_ok=True)
            os.chmod(d, 0o755)
        idx = os.path.join(self.htmldir, "index.html")
        with open(idx, "wb") as f:
            f.write(b"<html><head><title>It works!</title></head><body>It works!</body></html>")
        os.chmod(idx, 0o644)

    # ---- env expansion ----
    def expand_env(self, text, ctx):
        if text is None:
            return None
        if not isinstance(text, str):
            return text

        def rep(m):
            name = m.group(1)
            if re.fullmatch(r"TEST_NGINX_RAND_PORT_[0-9]+", name):
                if name not in ctx.rand_ports:
                    ctx.rand_ports[name] = free_port(self.runner.used_ports | set(ctx.rand_ports.values()))
                return str(ctx.rand_ports[name])
            v = self.env.get(name)
            if v is None:
                hint = ""
                if name == "TEST_NGINX_REDIS_PORT":
                    hint = " (Redis could not be started: %s)" % (self.runner.redis.error or "unknown reason")
                elif name.startswith("TEST_NGINX_REDIS_CLUSTER"):
                    hint = " (Redis Cluster could not be started: %s)" % (
                        self.runner.cluster.error or "unknown reason")
                raise BlockError("No environment %s defined%s." % (name, hint))
            return v
        return re.sub(r"\$(TEST_NGINX_[_A-Z0-9]+)", rep, text)

    # ---- Perl ----
    def run_perl(self, blocks, preamble):
        """One Perl process for the file: the preamble once, then the eval
        sections, then (if the preamble added any) the block preprocessors
        on every block, whose changes replace the block's sections."""
        jobs = []
        for b in blocks:
            for j in b.pending:
                jobs.append((b, j))
        if not (jobs or preamble.preprocessed or "$ENV{" in preamble.text):
            return
        req = {
            "op": "eval",
            "preamble": preamble.perl_code(),
            "codes": [code for _, (_, code, _) in jobs],
            "stubs": PREAMBLE_STUBS,
            "stub_values": {
                "repeat_each": str(preamble.repeat_each), "workers": str(preamble.workers),
                "blocks": str(len(blocks)), "server_port": self.env["TEST_NGINX_SERVER_PORT"],
                "server_port_for_client": self.env["TEST_NGINX_SERVER_PORT"],
                "html_dir": self.htmldir, "server_root": self.servroot,
                "log_level": preamble.log_level or self.cfg.log_level,
                "timeout": str(self.timeout_default), "sleep_time": str(self.cfg.sleep),
                "worker_connections": str(preamble.worker_connections),
                "server_name": "localhost", "server_addr": "127.0.0.1", "verbose": "0",
            },
        }
        perl = PerlSession(self.env)
        try:
            try:
                resp = perl.ask(req)
            except PerlError as e:
                for b, (sec, _, _) in jobs:
                    b.errors.append("section '%s eval': %s" % (sec, e))
                if preamble.preprocessed:
                    for b in blocks:
                        b.errors.append("add_block_preprocessor: %s" % e)
                return
            self.apply_evals(blocks, jobs, resp)
            if preamble.preprocessed:
                self.preprocess(perl, blocks, resp)
        finally:
            stderr = perl.close()
            if stderr and self.cfg.verbose:
                self.vprint("perl stderr: " + stderr)

    def take_env(self, resp):
        for k, v in (resp.get("env") or {}).items():
            if self.env.get(k) != v and v is not None:
                self.env[k] = v

    def apply_evals(self, blocks, jobs, resp):
        if resp.get("preamble_error"):
            self.file_warnings.append("running the preamble in Perl (for %%ENV / package variables) "
                                      "failed: %s" % resp["preamble_error"].strip())
        self.take_env(resp)
        for (b, (sec, code, post)), r in zip(jobs, resp.get("results") or []):
            if not r.get("ok"):
                b.errors.append("section '%s eval' failed to evaluate in Perl: %s" % (sec, r.get("error", "").strip()))
                b.values[sec] = []
                continue
            vals = [from_perl_json(v) for v in r.get("values") or []]
            for flt in post:
                fn = FILTERS.get(flt)
                if fn is None:
                    b.errors.append("section '%s': unsupported filter '%s' after eval" % (sec, flt))
                    break
                vals = fn(vals)
            b.values[sec] = vals
        for b in blocks:
            b.pending = []

    def preprocess(self, perl, blocks, resp):
        """Test::Nginx runs each add_block_preprocessor handler (the last
        added first) on a block before running it; here they run on every
        block once, in file order, after the eval sections."""
        if not resp.get("preprocessors"):
            why = resp.get("preamble_error") or "the preamble never called it"
            for b in blocks:
                b.errors.append("add_block_preprocessor: no handler was added (%s)" % why.strip())
            return
        try:
            out = perl.ask({"op": "preprocess", "blocks": [
                {"name": b.name, "seq": b.seq,
                 "sections": {s: to_perl_json(v) for s, v in b.values.items()}} for b in blocks]})
        except PerlError as e:
            for b in blocks:
                b.errors.append("add_block_preprocessor: %s" % e)
            return
        self.take_env(out)
        for b, r in zip(blocks, out.get("blocks") or []):
            if r.get("error") is not None:
                b.errors.append("add_block_preprocessor failed: %s" % r["error"].strip())
                continue
            for s, vals in (r.get("set") or {}).items():
                b.values[s] = [from_perl_json(v) for v in vals]
                b.preprocessed.add(s)
                if s not in b.order:
                    b.order.append(s)
            for s in r.get("removed") or []:
                b.values.pop(s, None)
                if s in b.order:
                    b.order.remove(s)

    def run_init(self, code, outcome):
        try:
            p = subprocess.run(["perl", "-e", PERL_INIT_HELPER], input=to_bytes(code),
                               capture_output=True, env=self.env, timeout=180)
        except subprocess.TimeoutExpired:
            raise BlockError("init code timed out after 180s")
        if p.returncode != 0:
            raise BlockError("init failed: %s" % p.stderr.decode(L1).strip())
        if p.stderr.strip():
            outcome.warnings.append("init stderr: " + p.stderr.decode(L1).strip())

    # ---- nginx config ----
    def write_user_files(self, block, ctx):
        files = block.get("user_files")
        if files is None:
            return
        entries = []
        if isinstance(files, str):
            fname = body = date = None
            for line in files.splitlines(True):
                m = re.search(r">>> (\S+)(?:\s+(.+))?", line)
                if m:
                    if fname:
                        entries.append((fname, body, date))
                    fname, date, body = m.group(1), m.group(2), None
                else:
                    body = (body or "") + line
            if fname:
                entries.append((fname, body, date))
        elif isinstance(files, list):
            for e in files:
                if not isinstance(e, list) or not e:
                    raise BlockError("user_files eval: each entry must be [name, body, date?]")
                entries.append((e[0], e[1] if len(e) > 1 else None, e[2] if len(e) > 2 else None))
        else:
            raise BlockError("user_files: wrong value type, only scalar or ARRAY are accepted")
        for fname, body, date in entries:
            body = self.expand_env(body or "", ctx)
            path = fname if fname.startswith("/") else os.path.join(self.htmldir, fname)
            d = os.path.dirname(path)
            if not os.path.isdir(d):
                os.makedirs(d, exist_ok=True)
                q = d
                while q.startswith(self.htmldir) and q != self.htmldir:
                    os.chmod(q, 0o755)
                    q = os.path.dirname(q)
            with open(path, "wb") as f:
                f.write(to_bytes(body))
            os.chmod(path, 0o644)
            if date:
                env = dict(os.environ, TZ="GMT")
                subprocess.run(["touch", "-t", str(date).strip(), path], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)

    def build_config(self, block, config, ctx, log_level):
        cfg = self.cfg
        port = self.env["TEST_NGINX_SERVER_PORT"]
        http_config = self.expand_env(block.get("http_config"), ctx) or ""
        main_config = self.expand_env(block.get("main_config"), ctx) or ""
        post_main_config = self.expand_env(block.get("post_main_config"), ctx) or ""
        for name, val in (("http_config", http_config), ("main_config", main_config),
                          ("post_main_config", post_main_config)):
            if not isinstance(val, str):
                raise BlockError("section %s must be a string" % name)
        extra_http = ""
        pp = os.environ.get("TEST_NGINX_POSTPONE_OUTPUT")
        if pp and not re.search(r"\bpostpone_output\b", http_config):
            extra_http = "\n    postpone_output %s;\n" % pp
        master = "on" if self.master_on else "off"
        lines = []
        for mod in cfg.modules:
            lines.append("load_module %s;" % mod)
        lines.append("worker_processes  %d;" % self.pre.workers)
        lines.append("daemon on;")
        lines.append("master_process %s;" % master)
        lines.append("error_log %s %s;" % (self.errlog, log_level))
        lines.append("pid       %s;" % self.pidfile)
        for v in self.pre.env_to_nginx:
            lines.append("env %s;" % (("'%s'" % v) if re.search(r"\s", v) else v))
        temp = ["client_body_temp_path %s/client_body_temp;" % self.servroot,
                "proxy_temp_path %s/proxy_temp;" % self.servroot,
                "fastcgi_temp_path %s/fastcgi_temp;" % self.servroot,
                "scgi_temp_path %s/scgi_temp;" % self.servroot,
                "uwsgi_temp_path %s/uwsgi_temp;" % self.servroot]
        nv = self.runner.nginx_V
        if "--without-http_fastcgi_module" in nv:
            temp[2] = ""
        if "--without-http_scgi_module" in nv:
            temp[3] = ""
        if "--without-http_uwsgi_module" in nv:
            temp[4] = ""
        if re.search(r"\bproxy_temp_path\b", http_config):
            temp[1] = ""
        if re.search(r"\bclient_body_temp_path\b", http_config):
            temp[0] = ""
        conf = "\n".join(lines) + "\n\n"
        conf += main_config + "\n\n"
        conf += "http {\n"
        conf += "    access_log %s; %s\n" % (self.acclog, " ".join(t for t in temp if t))
        conf += "    default_type text/plain;\n"
        conf += "    keepalive_timeout  68000ms;\n\n"
        conf += http_config + "\n"
        conf += "    server {\n"
        conf += "        listen          127.0.0.1:%s;\n" % port
        conf += "        server_name     'localhost';\n"
        conf += "        client_max_body_size 30M;\n\n"
        conf += "        # Begin test case config...\n"
        conf += config + "\n"
        conf += "        # End test case config.\n\n"
        if not self.pre.no_root_location:
            conf += "        location / {\n"
            conf += "            root %s;\n" % self.htmldir
            conf += "            index index.html index.htm;\n"
            conf += "        }\n"
        conf += "    }\n"
        if self.use_hup_now:
            conf += "    server {\n"
            conf += "        listen          127.0.0.1:%s;\n" % port
            conf += "        server_name     'Test-Nginx';\n\n"
            conf += "        location = /ver {\n"
            conf += "            return 200 '%s';\n" % self.config_version
            conf += "        }\n"
            conf += "    }\n"
        conf += extra_http
        conf += "}\n\n"
        conf += post_main_config + "\n\n"
        conf += "events {\n"
        conf += "    accept_mutex off;\n\n"
        conf += "    worker_connections  %d;\n" % self.pre.worker_connections
        if os.environ.get("TEST_NGINX_EVENT_TYPE"):
            conf += "    use %s;\n" % os.environ["TEST_NGINX_EVENT_TYPE"]
        conf += "}\n"
        if os.environ.get("TEST_NGINX_WORKER_USER"):
            conf += "user %s;\n" % os.environ["TEST_NGINX_WORKER_USER"]
        return conf

    def write_config(self, text):
        with open(self.conffile, "wb") as f:
            f.write(to_bytes(text))
        os.chmod(self.conffile, 0o644)

    # ---- nginx process control ----
    def nginx_cmd(self):
        cmd = [self.cfg.nginx, "-p", self.servroot + "/", "-c", self.conffile]
        if self.runner.nginx_has_e:
            cmd += ["-e", self.errlog]
        return cmd

    def run_nginx_startup(self):
        """Run the nginx binary (daemon on => returns as soon as it forked).
        Returns (exit_status or None on timeout, stderr_text)."""
        errpath = os.path.join(self.root, "nginx-startup.stderr")
        with open(errpath, "wb") as ef:
            p = subprocess.Popen(self.nginx_cmd(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=ef, env=self.env, start_new_session=True)
            try:
                rc = p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                servers.stop_popen(p, 5.0, signal.SIGKILL, then=())
                rc = None
        try:
            with open(errpath, "rb") as f:
                err = f.read().decode(L1)
        except OSError:
            err = ""
        return rc, err

    def read_pidfile(self, wait=3.0):
        deadline = time.monotonic() + wait
        while True:
            try:
                with open(self.pidfile) as f:
                    txt = f.read().strip()
                if txt.isdigit():
                    return int(txt)
            except OSError:
                pass
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.01)

    def start_nginx(self, outcome):
        tries_until = time.monotonic() + 5.0
        while True:
            rc, err = self.run_nginx_startup()
            if rc == 0:
                break
            text = err + self.read_log_from(self.errlog, 0)
            if rc is not None and "Address already in use" in text and time.monotonic() < tries_until:
                time.sleep(0.2)
                continue
            msg = "cannot start nginx (%s)" % ("timed out" if rc is None else "exit status %s" % rc)
            if err.strip():
                msg += "\n  stderr: " + err.strip().replace("\n", "\n  stderr: ")
            if 'duplicate location "/"' in text:
                msg += ("\n  hint: Test::Nginx always adds 'location / {...}' to the default "
                        "server unless the preamble calls no_root_location()")
            raise BlockError(msg)
        pid = self.read_pidfile()
        if pid is None:
            raise BlockError("nginx started but wrote no pid file %s" % self.pidfile)
        self.nginx_pid = pid
        REAPER.nginx.add(pid)
        self.started_nginx = True
        if not pid_alive(pid):
            self.nginx_pid = None
            raise BlockError("nginx (pid %d) exited right after startup" % pid)
        time.sleep(self.cfg.sleep)

    def stop_current_nginx(self, outcome=None, crash_exempt=None):
        pid = self.nginx_pid
        if pid is None:
            return
        self.nginx_pid = None
        before = self.log_size(self.errlog)
        graceful, msg = stop_nginx(pid, grace=5.0)
        if outcome is not None:
            if msg:
                outcome.fail(msg)
            lines = self.read_log_lines(self.errlog, before)
            self.crash_scan(lines, outcome, crash_exempt or set(), when="during nginx shutdown")

    # ---- log helpers ----
    @staticmethod
    def log_size(path):
        try:
            return os.path.getsize(path)
        except OSError:
            return 0

    @staticmethod
    def read_log_from(path, pos):
        try:
            with open(path, "rb") as f:
                f.seek(pos)
                return f.read().decode(L1)
        except OSError:
            return ""

    def read_log_lines(self, path, pos):
        return self.read_log_from(path, pos).splitlines(True)

    def error_log_data(self, ctx):
        """Test::Nginx error_log_data(): sleep a bit, return the lines since
        the last call (unless check_accum_error_log)."""
        time.sleep(self.cfg.sleep * 3)
        try:
            with open(self.errlog, "rb") as f:
                if not self.pre.check_accum and ctx.err_pos > 0:
                    size = os.fstat(f.fileno()).st_size
                    f.seek(ctx.err_pos if ctx.err_pos <= size else 0)
                data = f.read()
                if not self.pre.check_accum:
                    ctx.err_pos = f.tell()
        except OSError:
            return []
        return data.decode(L1).splitlines(True)

    def log_tail(self, n=40):
        lines = self.read_log_lines(self.errlog, 0)
        return lines[-n:]

    # ---- crash detection (stricter than Test::Nginx) ----
    def crash_exemptions(self, block):
        ex = set()
        for sec in ("error_log", "no_error_log", "grep_error_log"):
            v = block.get(sec)
            for needle in ("[alert", "[emerg", "exited on signal", "[crit"):
                if value_contains(v, needle):
                    ex.add(needle)
        return ex

    def crash_scan(self, lines, outcome, exempt, when):
        for line in lines:
            if re.search(r"process \d+ exited on signal", line):
                if "exited on signal" not in exempt:
                    outcome.fail("nginx process crashed %s: %s" % (when, line.rstrip()))
                continue
            if "[alert]" in line and "[alert" not in exempt:
                outcome.fail("unexpected [alert] in error.log %s: %s" % (when, line.rstrip()))
            elif "[emerg]" in line and "[emerg" not in exempt:
                outcome.fail("unexpected [emerg] in error.log %s: %s" % (when, line.rstrip()))
            elif "[crit]" in line and "[crit" not in exempt:
                outcome.warnings.append("[crit] in error.log %s: %s" % (when, line.rstrip()))
            if re.search(r"\bAssertion .*?failed\b", line):
                outcome.fail(line.rstrip())

    # ---- main per-file flow ----
    def run(self):
        results = []
        self.file_warnings = []
        try:
            with open(self.path, "rb") as f:
                text = f.read().decode(L1)
        except OSError as e:
            return self.file_error("cannot read: %s" % e)
        m = re.search(r"^__DATA__[ \t]*\r?\n", text, re.M)
        if not m:
            return self.file_error("no __DATA__ section found")
        preamble_text = text[:m.start()]
        data = text[m.end():]
        self.env = dict(os.environ)
        self.pre = Preamble(preamble_text, self.env)
        self.file_warnings += self.pre.warnings
        self.master_on = self.pre.master if self.pre.master is not None else \
            (os.environ.get("TEST_NGINX_MASTER_PROCESS", "off") == "on")
        if self.pre.use_hup:
            self.master_on = True   # Test::Nginx: config reload is buggy when master is off
        self.timeout_default = self.pre.timeout or self.cfg.timeout
        blocks = parse_blocks(data)
        if not blocks:
            return self.file_error("no test blocks found after __DATA__")

        self.setup_root()
        try:
            port = self.cfg.server_port
            if port is None:
                port = free_port(self.runner.used_ports)
            self.env["TEST_NGINX_SERVER_PORT"] = str(port)
            self.env["TEST_NGINX_SERVER_ROOT"] = self.servroot
            self.env["TEST_NGINX_HTML_DIR"] = self.htmldir
            self.env["TEST_NGINX_BINARY"] = self.cfg.nginx
            if self.cfg.modules:
                self.env["TEST_NGINX_LOAD_MODULES"] = " ".join(self.cfg.modules)
            redis = self.runner.redis
            if redis.port:
                self.env["TEST_NGINX_REDIS_PORT"] = str(redis.port)
                redis.flush()
            cluster = self.runner.cluster
            if cluster.ports:
                self.env.update(cluster.env())
                cluster.flush()
            self.run_perl(blocks, self.pre)
            if self.env.get("TEST_NGINX_SERVER_PORT") != str(port):
                port = int(self.env["TEST_NGINX_SERVER_PORT"])
            self.port = port
            self.runner.used_ports.add(port)

            # choose blocks: ONLY / SKIP / LAST
            chosen, skipped = [], []
            only = [b for b in blocks if b.exists("ONLY")]
            if only:
                self.file_warnings.append("--- ONLY found in %s: running only that block, "
                                          "the other %d block(s) are NOT run" % (only[0].name, len(blocks) - 1))
                chosen = [only[0]]
                skipped = [(b, "not run because of --- ONLY") for b in blocks if b is not only[0]]
            else:
                for i, b in enumerate(blocks):
                    if b.exists("SKIP"):
                        skipped.append((b, "--- SKIP"))
                        continue
                    chosen.append(b)
                    if b.exists("LAST"):
                        skipped += [(x, "after --- LAST") for x in blocks[i + 1:]]
                        break
            order_note = "no_shuffle"
            if not self.pre.no_shuffle and not self.cfg.no_shuffle:
                seed = self.cfg.seed if self.cfg.seed is not None else random.randrange(1 << 30)
                random.Random(seed).shuffle(chosen)
                order_note = "shuffled with --seed %d" % seed
            emit("# %s (port %d, %s%s)" % (self.rel, port, order_note,
                                          ", use_hup" if self.pre.use_hup else ""))
            for w in self.file_warnings:
                emit("# WARNING: %s" % w)
            self.file_needs_redis = "TEST_NGINX_REDIS_PORT" in text
            self.file_needs_cluster = "TEST_NGINX_REDIS_CLUSTER" in text
            for b, why in skipped:
                results.append((b.name, "skip", [why], []))
                self.runner.report(self.rel, results[-1])

            for i, b in enumerate(chosen):
                nxt = chosen[i + 1] if i + 1 < len(chosen) else None
                outcome = self.run_block(b, nxt, text)
                status = "fail" if outcome.failures else "ok"
                msgs = []
                if outcome.failures:
                    self.any_failed = True
                    msgs = outcome.final_failures() + self.failure_context(b)
                results.append((b.name, status, msgs, outcome.warnings))
                self.runner.report(self.rel, results[-1])
            return results
        finally:
            if self.nginx_pid:
                stop_nginx(self.nginx_pid, grace=3.0)
                self.nginx_pid = None
            self.sweep_strays()
            self.finish()

    def sweep_strays(self):
        """Safety net: stop (by pid) any nginx still running with this
        file's unique conf path on its command line (e.g. a daemon whose
        pid file could not be read)."""
        if not self.servroot or not self.own_servroot:
            return
        needle = to_bytes(self.conffile)
        try:
            entries = os.listdir("/proc")
        except OSError:
            return
        for d in entries:
            if not d.isdigit():
                continue
            cmd = servers.proc_cmdline(int(d)) or b""
            if needle in cmd and b"nginx" in cmd and pid_alive(int(d)):
                emit("# WARNING: stopping stray nginx pid %s of %s" % (d, self.rel))
                stop_nginx(int(d), grace=2.0)

    def file_error(self, msg):
        res = [("(file-level error)", "fail", [msg], [])]
        self.runner.report(self.rel, res[0])
        return res

    def failure_context(self, block):
        ctx = []
        tail = self.log_tail(30) if self.block_used_nginx else []
        if tail:
            ctx.append("error.log tail (%s):\n%s" % (self.errlog, "".join(tail).rstrip()))
        if not self.block_used_nginx:
            return ctx
        snap = os.path.join(self.root, "failed", re.sub(r"[^\w.-]+", "_", block.name)[:60])
        try:
            os.makedirs(snap, exist_ok=True)
            for d in ("conf", "logs"):
                src = os.path.join(self.servroot, d)
                if os.path.isdir(src):
                    shutil.copytree(src, os.path.join(snap, d), dirs_exist_ok=True,
                                    ignore=shutil.ignore_patterns("*.pid"))
            ctx.append("conf/ and logs/ of this block kept in %s" % snap)
        except OSError as e:
            ctx.append("could not snapshot servroot: %s" % e)
        return ctx

    def finish(self):
        if self.root is None:
            return
        if self.any_failed:
            emit("# servroot kept for debugging: %s (failed blocks' conf/logs under %s)"
                 % (self.servroot, os.path.join(self.root, "failed")))
        else:
            shutil.rmtree(self.root, ignore_errors=True)

    # ---- one block ----
    def run_block(self, block, next_block, text):
        outcome = BlockOutcome()
        ctx = type("Ctx", (), {})()
        ctx.rand_ports = {}
        ctx.err_pos = 0
        self.cur_ctx = ctx
        exempt = self.crash_exemptions(block)
        self.block_used_nginx = False
        must_die = block.get("must_die") if block.has("must_die") else None
        stop_after = True
        ctx.block_log_start = None
        try:
            try:
                self._run_block(block, ctx, outcome, must_die)
            finally:
                # stricter than Test::Nginx: crashes / [alert] / [emerg] in the
                # error log during the block fail it
                if ctx.block_log_start is not None and must_die is None:
                    lines = self.read_log_lines(self.errlog, ctx.block_log_start)
                    self.crash_scan(lines, outcome, exempt, when="during this block")
                # Decide whether nginx must be stopped now (so that shutdown
                # problems are attributed to this block).
                if next_block is None:
                    stop_after = True
                elif next_block.has("config"):
                    stop_after = not (self.pre.use_hup and not next_block.has("must_die")
                                      and self.nginx_pid and pid_alive(self.nginx_pid))
                else:
                    stop_after = False
                if self.nginx_pid and not pid_alive(self.nginx_pid) and must_die is None:
                    outcome.fail("nginx (pid %d) is gone (crashed?)" % self.nginx_pid)
                    REAPER.nginx.discard(self.nginx_pid)
                    self.nginx_pid = None
                if stop_after and self.nginx_pid:
                    self.stop_current_nginx(outcome, exempt)
        except BlockError as e:
            outcome.fail(str(e))
        except Exception as e:   # runner bug: report, never hang
            import traceback
            outcome.fail("runner internal error: %s\n%s" % (e, traceback.format_exc()))
        return outcome

    def _run_block(self, block, ctx, outcome, must_die):
        name = block.name
        for err in block.errors:
            outcome.fail(err)
        if block.errors:
            raise BlockError("block has invalid sections (see above)")
        unsupported = [s for s in block.order if s not in SUPPORTED_SECTIONS]
        if unsupported:
            raise BlockError("unsupported section(s) for t/runner.py: %s" % ", ".join(unsupported))
        for s in block.order:
            for v in (block.values.get(s) or []):
                if isinstance(v, Unsupported):
                    raise BlockError("section %s: %r" % (s, v))

        # Redis requirement (never skip: fail)
        blob = json.dumps([str(v) for vs in block.values.values() for v in vs])
        if ("TEST_NGINX_REDIS_CLUSTER" in blob or self.file_needs_cluster) \
                and not self.env.get("TEST_NGINX_REDIS_CLUSTER_PORTS"):
            raise BlockError("this test file uses TEST_NGINX_REDIS_CLUSTER but the Redis Cluster is not "
                             "available: %s" % (self.runner.cluster.error or "not started"))
        if ("TEST_NGINX_REDIS_PORT" in blob or self.file_needs_redis) and not self.env.get("TEST_NGINX_REDIS_PORT"):
            raise BlockError("this test file uses TEST_NGINX_REDIS_PORT but Redis is not available: %s"
                             % (self.runner.redis.error or "not started"))

        log_level = block.get("log_level") or self.pre.log_level or self.cfg.log_level
        config = block.get("config")
        if config is not None and not isinstance(config, str):
            raise BlockError("--- config must be a string")
        config = self.expand_env(config, ctx)

        use_hup_block = self.pre.use_hup and must_die is None
        self.use_hup_now = self.pre.use_hup
        block_log_start = 0
        self.block_used_nginx = True
        if config is None:
            # Test::Nginx: no --- config => reuse the running nginx as is
            if self.prev_config is None:
                raise BlockError("No '--- config' section specified and could not get previous one.")
            for s in ("http_config", "main_config", "user_files", "post_main_config"):
                # (a preprocessor's are ignored, as Test::Nginx does)
                if block.exists(s) and s not in block.preprocessed:
                    raise BlockError("block has --- %s but no --- config: Test::Nginx would silently "
                                     "reuse the previous block's nginx and ignore it; add --- config" % s)
            if must_die is not None:
                raise BlockError("--- must_die needs a --- config section")
            block_log_start = self.log_size(self.errlog)
        else:
            self.prev_config = config
            hupped = False
            if use_hup_block and not self.first_time and self.nginx_pid and pid_alive(self.nginx_pid):
                hupped = self.hup_reload(block, config, ctx, log_level, outcome)
                block_log_start = 0
            if not hupped:
                if self.nginx_pid:
                    self.stop_current_nginx()
                self.config_version = "".join(random.choice("abcdefghijklmnopqrstuvwxyz0123456789")
                                              for _ in range(10))
                self.clean_servroot(hup=False)
                self.write_user_files(block, ctx)
                conf = self.build_config(block, config, ctx, log_level)
                self.write_config(conf)
                self.vprint("nginx.conf for %s:\n%s" % (name, conf))
                if must_die is not None:
                    self.first_time = False
                    self.run_must_die(block, ctx, outcome, must_die)
                    return
                self.start_nginx(outcome)
            self.first_time = False

        if perl_true(block.get("init")):
            self.run_init(block.get("init"), outcome)

        ctx.err_pos = 0
        ctx.block_log_start = block_log_start
        for rep in range(self.pre.repeat_each):
            if rep > 0:
                self.write_user_files(block, ctx)
            self.run_requests(block, ctx, outcome, rep)

    def hup_reload(self, block, config, ctx, log_level, outcome):
        pid = self.nginx_pid
        self.config_version = "".join(random.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(10))
        self.clean_servroot(hup=True)
        self.write_user_files(block, ctx)
        conf = self.build_config(block, config, ctx, log_level)
        self.write_config(conf)
        self.vprint("nginx.conf for %s (HUP reload):\n%s" % (block.name, conf))
        old_workers = servers.children(pid)
        if not servers.send_signal(pid, signal.SIGUSR1):
            return False
        time.sleep(self.cfg.sleep)
        # the log files were removed: wait until the master reopened them, so
        # that the reload's own messages ("reconfiguring") land in the new log
        deadline = time.monotonic() + 3.0
        while not os.path.exists(self.errlog) and time.monotonic() < deadline:
            time.sleep(0.005)
        if not servers.send_signal(pid, signal.SIGHUP):
            return False
        time.sleep(self.cfg.sleep * 3)
        # wait until the new configuration answers (Test::Nginx test_config_version)
        nsucc = 0
        deadline = time.monotonic() + 15.0
        ok = False
        tries = 0
        while time.monotonic() < deadline:
            tries += 1
            r = http_exchange(self.port, [b"GET /ver HTTP/1.1\r\nHost: Test-Nginx\r\nConnection: close\r\n\r\n"],
                              timeout=2.0, connect_budget=0.5, alive_check=lambda: pid_alive(pid))
            body = None
            if not r.error and r.raw:
                res, _, _ = parse_response(r.raw, False)
                body = res.body
            if body == self.config_version:
                nsucc += 1
                if nsucc == 5:
                    time.sleep(self.cfg.sleep)
                if nsucc >= 20:
                    ok = True
                    break
                continue
            nsucc = 0
            if not pid_alive(pid):
                break
            time.sleep(min(1.0, (self.cfg.sleep + self.cfg.sleep * tries) * tries / 2))
        if not ok:
            raise BlockError("failed to reload the configuration with SIGHUP (the new config "
                             "version never answered on /ver)")
        # The new workers answer; now make sure no old worker still accepts
        # connections with the previous configuration: each must have exited
        # or be "shutting down" (listening sockets closed).
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            busy = [w for w in old_workers if pid_alive(w) and not worker_shutting_down(w)]
            if not busy:
                break
            time.sleep(0.01)
        else:
            outcome.warnings.append("old worker(s) %s still not shutting down 5s after the HUP" % busy)
        newpid = self.read_pidfile(wait=1.0)
        if newpid != pid or not pid_alive(pid):
            raise BlockError("nginx master pid changed across HUP reload (%s -> %s)" % (pid, newpid))
        return True

    def run_must_die(self, block, ctx, outcome, must_die):
        for rep in range(self.pre.repeat_each):
            rc, err = self.run_nginx_startup()
            if rc is None:
                outcome.fail("must_die: nginx startup timed out")
            elif rc < 0:
                outcome.fail("must_die: nginx was killed by signal %d (crash?)" % -rc)
            elif re.fullmatch(r"\s*-?\d+(\.\d+)?\s*", str(must_die) or ""):
                if rc != int(float(must_die)):
                    outcome.fail("must_die: expected exit code %s, got %s" % (must_die, rc))
            elif rc == 0:
                outcome.fail("nginx must die but it does not")
            # error_log checks against startup stderr + error.log (like Test::Nginx)
            self.check_error_log(block, ctx, outcome, rep, extra_lines=err.splitlines(True),
                                 startup=True)
            if rc == 0:
                outcome.warnings.append("nginx must die but it does not; killing it")
                pid = self.read_pidfile(wait=1.0)
                if pid:
                    REAPER.nginx.add(pid)
                    stop_nginx(pid, grace=3.0)

    # ---- requests ----
    def get_requests(self, block, ctx):
        """Returns list of dicts: {packets: [bytes], pipelined: n or 0, head: bool}."""
        reqs = []
        more = block.get("more_headers")
        if more is None:
            more = ""

        def hdr_for(i):
            if isinstance(more, list):
                if i >= len(more) or more[i] is None:
                    raise BlockError("--- more_headers lacks data for the %dth request" % i)
                return parse_more_headers(more[i])
            return parse_more_headers(more)

        if block.has("raw_request"):
            raw = block.get("raw_request")
            pk = raw if isinstance(raw, list) else [raw]
            pk = [to_bytes(p if isinstance(p, str) else (p.get("value", "") if isinstance(p, dict) else str(p)))
                  for p in pk]
            joined = b"".join(pk)
            reqs.append({"packets": pk, "pipelined": 0, "head": bool(re.match(rb"\s*HEAD\s+", joined))})
            return reqs
        if perl_true(block.get("pipelined_requests")) or isinstance(block.get("pipelined_requests"), list):
            prs = block.get("pipelined_requests")
            if not isinstance(prs, list):
                raise BlockError("invalid entries in --- pipelined_requests (need an array ref)")
            out = ""
            for i, r in enumerate(prs):
                r = self.expand_env(r, ctx)
                h, ch = hdr_for(i)
                out += build_request(r, h, ch, "close" if i == len(prs) - 1 else "keep-alive")
            reqs.append({"packets": [to_bytes(out)], "pipelined": len(prs), "head": False})
            return reqs
        request = block.get("request")
        if request is None:
            raise BlockError("request empty (no --- request section)")
        if isinstance(request, str):
            request = re.sub(r"\A(?:\s*#[^\n]+\s+|\s+)+", "", request)
            h, ch = hdr_for(0)
            s = build_request(request, h, ch, "close")
            reqs.append({"packets": [to_bytes(s)], "pipelined": 0,
                         "head": bool(re.match(r"\s*HEAD\s+", s))})
        elif isinstance(request, list):
            for i, one in enumerate(request):
                h, ch = hdr_for(i)
                if isinstance(one, list):
                    # packet arrays: approximated as one write (see report)
                    joined = "".join(p if isinstance(p, str) else (p.get("value", "") if isinstance(p, dict) else "")
                                     for p in one)
                    s = build_request(joined, h, ch, "close")
                elif isinstance(one, str):
                    s = build_request(one, h, ch, "close")
                else:
                    raise BlockError("Invalid syntax. request elements should be strings or arrays of packets")
                reqs.append({"packets": [to_bytes(s)], "pipelined": 0,
                             "head": bool(re.match(r"\s*HEAD\s+", s))})
        else:
            raise BlockError("invalid --- request: MUST be string or array of requests")
        return reqs

    def run_requests(self, block, ctx, outcome, rep):
        reqs = self.get_requests(block, ctx)
        if not reqs:
            raise BlockError("request empty")
        timeout = parse_time(block.get("timeout")) if block.has("timeout") else None
        if timeout is None:
            timeout = self.timeout_default
        wait = parse_time(block.get("wait")) if perl_true(block.get("wait")) else None
        middle = parse_time(block.get("raw_request_middle_delay")) if block.has("raw_request_middle_delay") else None
        shut = None
        if block.exists("shutdown"):
            sv = block.get("shutdown")
            shut = 1 if sv in (None, "") else int(sv)
        pid = self.nginx_pid
        req_idx = 0
        for ri, one in enumerate(reqs):
            self.vprint("request %d:\n%s" % (ri, b"".join(one["packets"]).decode(L1)))
            r = http_exchange(self.port, one["packets"], timeout, middle_delay=middle, shutdown_how=shut,
                              alive_check=(lambda: pid_alive(pid)) if pid else None)
            self.vprint("response %d:\n%s" % (ri, r.raw if len(r.raw) < 20000 else r.raw[:20000] + "..."))
            if r.error:
                outcome.fail("%s (req %d)" % (r.error, ri))
            if r.timed_out and not block.exists("abort"):
                outcome.fail("ERROR: client socket timed out (timeout %.3gs) (req %d)" % (timeout, ri))
            n = one["pipelined"]
            need_array = bool(n) or len(reqs) > 1
            raw = r.raw
            while True:
                res = None
                if one["pipelined"] and req_idx > 0 and not raw and not block.exists("ignore_response"):
                    outcome.fail("no response for pipelined requests %d..%d: the server closed the "
                                 "connection after %d response(s) (nginx's keepalive_requests "
                                 "defaults to 1000)" % (req_idx, one["pipelined"] - 1, req_idx))
                    break
                if not block.exists("ignore_response"):
                    res, left, perr = parse_response(raw or "", one["head"])
                    if perr:
                        outcome.fail("%s (req %d)" % (perr, req_idx))
                else:
                    left = None
                if n:
                    raw = left or ""
                    n -= 1
                elif left:
                    outcome.warnings.append("unexpected extra bytes after the response: %s" % show(left, 200))
                if not block.exists("ignore_response"):
                    self.check_response(block, res, req_idx, rep, need_array, outcome)
                if n or ri < len(reqs) - 1:
                    if wait:
                        time.sleep(wait)
                    # Test::Nginx checks the error log after every request of
                    # an array / pipeline too (each check only sees the lines
                    # logged since the previous one).  That only matters for
                    # error_log and grep_error_log; no_error_log / access_log
                    # give the same result when checked once at the end, so
                    # skip the 45 ms log settling sleep per request then.
                    if block.has("error_log") or block.has("grep_error_log"):
                        self.check_error_log(block, ctx, outcome, rep)
                req_idx += 1
                if not n:
                    break
        if wait:
            time.sleep(wait)
        self.check_error_log(block, ctx, outcome, rep)
        if not block.exists("ignore_response"):
            self.check_access_log(block, outcome, rep)

    # ---- checks ----
    def indexed(self, block, sec, req_idx, need_array):
        v = block.get(sec)
        if need_array:
            if isinstance(v, list):
                return v[req_idx] if req_idx < len(v) else None
            raise BlockError("%s: You asked for many requests, the expected results should be arrays "
                             "as well (--- %s eval [...])" % (block.name, sec))
        if isinstance(v, list):
            return v[0] if v else None
        return v

    def check_response(self, block, res, idx, rep, need_array, outcome):
        port = str(self.port)
        code = res.code if res is not None and res.code else ""
        tag = "(req %d)" % idx if need_array else "(repeat %d)" % rep
        # status code
        if block.has("error_code_like"):
            pat = self.indexed(block, "error_code_like", idx, need_array)
            rx = pat if isinstance(pat, Regex) else Regex(str(pat), "sm")
            if not rx.search(code):
                outcome.fail("status code %s: got %s, expected to match %s" % (tag, show(code), rx))
        else:
            exp = self.indexed(block, "error_code", idx, need_array) if block.has("error_code") else "200"
            if exp is None or str(code) != str(exp).strip():
                outcome.fail("status code %s: got %s, expected %s" % (tag, show(code), show(exp)))
        # raw headers
        raw_headers = res.raw_headers if res is not None else ""
        for sec, want in (("raw_response_headers_like", True), ("raw_response_headers_unlike", False)):
            if block.has(sec):
                pat = self.indexed(block, sec, idx, need_array)
                rx = pat if isinstance(pat, Regex) else Regex(str(pat), "s")
                if bool(rx.search(raw_headers)) != want:
                    outcome.fail("%s %s: %s %s match %s" % (sec, tag, show(raw_headers), "does not" if want else "does", rx))
        # headers
        if block.has("response_headers"):
            spec = self.indexed(block, "response_headers", idx, need_array)
            for key, val in parse_header_spec(spec):
                if val is None:
                    if re.search(r"^\s*" + re.escape(key) + r"\s*:", raw_headers, re.M):
                        outcome.fail("header %s %s: should not be present, got %s"
                                     % (key, tag, show(res.header(key) if res else None)))
                    continue
                val = re.sub(r"\$ServerPort\b", port, val)
                val = re.sub(r"\$ServerPortForClient\b", port, val)
                actual = res.header(key) if res is not None else None
                if actual is None:
                    actual = ""
                if actual != val:
                    outcome.fail("header %s %s: got %s, expected %s" % (key, tag, show(actual), show(val)))
        elif block.has("response_headers_like"):
            spec = self.indexed(block, "response_headers_like", idx, need_array)
            for key, val in parse_header_spec(spec):
                if val is None:
                    continue
                actual = (res.header(key) if res is not None else None) or ""
                if not Regex("^" + val + "$").search(actual):
                    outcome.fail("header %s %s: got %s, expected to match /^%s$/" % (key, tag, show(actual), val))
        # body
        content = res.body if res is not None else None
        content = self.apply_body_filters(block, content, idx)
        if content is not None:
            content = re.sub(r"(?m)^TE: deflate,gzip;q=0\.3\r\n", "", content)
            content = re.sub(r"(?m)^Connection: TE, close\r\n", "", content)
        if block.has("response_body"):
            exp = self.indexed(block, "response_body", idx, need_array)
            if isinstance(exp, Regex):
                if content is None or not exp.search(content):
                    outcome.fail("response_body %s: %s does not match %s" % (tag, show(content), exp))
            else:
                if exp is not None:
                    exp = re.sub(r"\$ServerPort\b", port, exp)
                    exp = re.sub(r"\$ServerPortForClient\b", port, exp)
                    exp = self.expand_env(exp, self.cur_ctx)
                if content != exp:
                    outcome.fail("response_body %s mismatch:\n  got:      %s\n  expected: %s%s"
                                 % (tag, show(content), show(exp), diff_hint(content, exp)))
        elif block.has("response_body_like") or block.has("response_body_unlike"):
            sec = "response_body_like" if block.has("response_body_like") else "response_body_unlike"
            pat = self.indexed(block, sec, idx, need_array)
            if isinstance(pat, Regex):
                rx = pat
            else:
                pat = "" if pat is None else str(pat)
                pat = re.sub(r"\$ServerPort\b", port, pat)
                pat = re.sub(r"\$ServerPortForClient\b", port, pat)
                rx = Regex(pat, "s")
            matched = content is not None and bool(rx.search(content))
            if matched != (sec == "response_body_like"):
                outcome.fail("%s %s: %s %s %s" % (sec, tag, show(content),
                                                 "does not match" if sec == "response_body_like" else "matches", rx))

    def apply_body_filters(self, block, content, idx):
        if content is None or not block.has("response_body_filters"):
            return content
        flt = block.get("response_body_filters")
        if isinstance(flt, str):
            flt = flt.split()
        if isinstance(flt, list) and flt and isinstance(flt[0], list):
            flt = flt[idx] if idx < len(flt) else []
        if not isinstance(flt, list):
            flt = [flt]
        import hashlib
        for f in flt:
            if f == "md5_hex":
                content = hashlib.md5(to_bytes(content)).hexdigest()
            elif f == "sha1_hex":
                content = hashlib.sha1(to_bytes(content)).hexdigest()
            elif f == "uc":
                content = content.upper()
            elif f == "lc":
                content = content.lower()
            elif f == "ucfirst":
                content = content[:1].upper() + content[1:]
            elif f == "lcfirst":
                content = content[:1].lower() + content[1:]
            elif f == "length":
                content = str(len(content))
            else:
                raise BlockError("unknown filter %r in --- response_body_filters" % (f,))
        return content

    def check_error_log(self, block, ctx, outcome, rep, extra_lines=None, startup=False):
        lines = None

        def get_lines():
            nonlocal lines
            if lines is None:
                lines = self.error_log_data(ctx)
                if extra_lines:
                    lines = lines + extra_lines
            return lines

        tag = "(req %d)" % rep
        if block.has("grep_error_log"):
            gp = block.get("grep_error_log")
            if isinstance(gp, list):
                gp = gp[rep] if rep < len(gp) else None
            if gp is not None:
                if not block.has("grep_error_log_out"):
                    raise BlockError("No --- grep_error_log_out defined but --- grep_error_log is defined")
                exp = block.get("grep_error_log_out")
                exp = self.expand_env(exp, ctx) if isinstance(exp, str) else exp
                if isinstance(exp, list):
                    exp = exp[rep] if rep < len(exp) else None
                got = []
                for line in get_lines():
                    m = gp.search(line) if isinstance(gp, Regex) else None
                    if m:
                        mt = m.group(0)
                    elif not isinstance(gp, Regex) and gp in line:
                        mt = gp
                    else:
                        continue
                    if "\n" not in mt:
                        got.append(mt + "\n")
                got = "".join(got)
                if isinstance(exp, Regex):
                    if not exp.search(got):
                        outcome.fail("grep_error_log_out %s: %s does not match %s" % (tag, show(got), exp))
                elif got != exp:
                    outcome.fail("grep_error_log_out %s:\n  got:      %s\n  expected: %s"
                                 % (tag, show(got), show(exp)))
        elif block.has("grep_error_log_out"):
            raise BlockError("No --- grep_error_log defined but --- grep_error_log_out is defined")

        if block.has("error_log"):
            pats = pattern_list(block.get("error_log"))
            found = [False] * len(pats)
            for line in get_lines():
                for i, p in enumerate(pats):
                    if p is None or found[i]:
                        continue
                    if pat_match(p, line):
                        found[i] = True
            for i, p in enumerate(pats):
                if p is not None and not found[i]:
                    outcome.fail("pattern %s should match a line in error.log %s" % (show(p), tag))

        if block.has("no_error_log"):
            pats = pattern_list(block.get("no_error_log"))
            all_lines = get_lines()
            for p in pats:
                if p is None:
                    continue
                hits = [li for li, line in enumerate(all_lines) if pat_match(p, line)]
                if not hits:
                    continue
                li = hits[0]
                more = "".join(all_lines[li + 1:li + 4]).rstrip()
                outcome.fail("pattern %s should not match any line in error.log but matches %d line(s) %s, "
                             "the first being:\n  %s%s"
                             % (show(p), len(hits), tag, all_lines[li].rstrip("\n"),
                                ("\n  followed by:\n  " + more.replace("\n", "\n  ")) if more else ""))
        if lines is None and not startup:
            get_lines()   # Test::Nginx always reads (for its alert checks), advancing the position

    def check_access_log(self, block, outcome, rep):
        for sec, want in (("access_log", True), ("no_access_log", False)):
            if not block.has(sec):
                continue
            time.sleep(self.cfg.sleep * 3)
            try:
                with open(self.acclog, "rb") as f:
                    lines = f.read().decode(L1).splitlines(True)
            except OSError:
                lines = []
            pats = pattern_list(block.get(sec))
            for p in pats:
                if p is None:
                    continue
                hit = next((ln for ln in lines if pat_match(p, ln)), None)
                if want and hit is None:
                    outcome.fail("pattern %s should match a line in access.log (req %d)" % (show(p), rep))
                if not want and hit is not None:
                    outcome.fail("pattern %s should not match any line in access.log but matches %s (req %d)"
                                 % (show(p), show(hit.rstrip("\n")), rep))


SUPPORTED_SECTIONS = {
    # config
    "config", "http_config", "main_config", "post_main_config", "user_files", "log_level",
    # requests
    "request", "pipelined_requests", "more_headers", "raw_request",
    "raw_request_middle_delay", "timeout", "abort", "shutdown", "ignore_response",
    # checks
    "error_code", "error_code_like", "response_body", "response_body_like", "response_body_unlike",
    "response_headers", "response_headers_like", "raw_response_headers_like",
    "raw_response_headers_unlike", "response_body_filters", "error_log", "no_error_log",
    "grep_error_log", "grep_error_log_out", "access_log", "no_access_log", "must_die",
    "suppress_stderr",
    # misc
    "init", "wait", "no_check_leak", "ONLY", "SKIP", "LAST", "curl",
}


def parse_header_spec(spec):
    out = []
    if spec is None:
        return out
    seen = {}
    for line in str(spec).split("\n"):
        line = line.strip()
        if line == "":
            continue
        m = re.match(r"!\s*", line)
        if m:
            seen[line[m.end():]] = None
            continue
        kv = re.split(r"\s*:\s*", line, maxsplit=1)
        seen[kv[0]] = kv[1] if len(kv) > 1 else None
    for k, v in seen.items():
        out.append((k, v))
    return out


def pattern_list(v):
    if v is None:
        return []
    if isinstance(v, Regex):
        return [v]
    if isinstance(v, list):
        return list(v)
    s = str(v)
    if s.endswith("\n"):
        s = s[:-1]
    return [x for x in re.split(r"\n+", s)] if s != "" else []


def pat_match(p, line):
    if isinstance(p, Regex):
        return bool(p.search(line))
    return str(p) in line


def value_contains(v, needle):
    if v is None:
        return False
    if isinstance(v, Regex):
        return needle in v.pattern
    if isinstance(v, list):
        return any(value_contains(x, needle) for x in v)
    return needle in str(v)


def diff_hint(got, exp):
    if not isinstance(got, str) or not isinstance(exp, str):
        return ""
    n = min(len(got), len(exp))
    for i in range(n):
        if got[i] != exp[i]:
            return "\n  first difference at offset %d: got %s, expected %s" % (
                i, show(got[i:i + 40]), show(exp[i:i + 40]))
    if len(got) != len(exp):
        return "\n  lengths differ: got %d, expected %d" % (len(got), len(exp))
    return ""


class Runner:
    def __init__(self, cfg):
        self.cfg = cfg
        self.used_ports = set()
        self.redis = RedisManager(cfg.verbose)
        self.cluster = RedisClusterManager(cfg.verbose)
        self.passed = self.failed = 0
        self.counter = 0
        self.nginx_V = ""
        self.nginx_has_e = True

    def needs_redis(self, text):
        # TEST_NGINX_REDIS_PORT & co, but not the cluster's variables alone
        return re.search(r"TEST_NGINX_REDIS(?!_CLUSTER)", text) is not None

    def needs_cluster(self, text):
        return "TEST_NGINX_REDIS_CLUSTER" in text

    def report(self, rel, res):
        name, status, msgs, warns = res
        if status == "skip":
            # never green: a block that did not run is a failure here
            status = "fail"
            msgs = ["not run (%s): skipping a test fails the run" % "; ".join(msgs)]
        self.counter += 1
        if status == "ok":
            self.passed += 1
            emit("ok %d - %s %s" % (self.counter, rel, name))
        else:
            self.failed += 1
            emit("not ok %d - %s %s" % (self.counter, rel, name))
            for m in msgs:
                for line in str(m).split("\n"):
                    emit("    # " + line)
        for w in warns:
            emit("    # WARNING: " + str(w).replace("\n", "\n    #   "))

    def probe_nginx(self):
        try:
            p = subprocess.run([self.cfg.nginx, "-V"], capture_output=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            return "cannot run %s -V: %s" % (self.cfg.nginx, e)
        self.nginx_V = (p.stdout + p.stderr).decode(L1)
        m = re.search(r"nginx/(\d+)\.(\d+)\.(\d+)", self.nginx_V)
        if m:
            v = tuple(int(x) for x in m.groups())
            self.nginx_has_e = v >= (1, 19, 5)
        return None

    def run(self, files):
        err = self.probe_nginx()
        if err:
            emit("# ERROR: " + err)
            return 2
        texts = {}
        for f in files:
            try:
                with open(f, "rb") as fh:
                    texts[f] = fh.read().decode(L1)
            except OSError:
                texts[f] = ""
        if any(self.needs_redis(t) for t in texts.values()):
            self.redis.ensure(self.used_ports)
            if self.redis.error:
                emit("# WARNING: Redis unavailable (%s); files using TEST_NGINX_REDIS_PORT will FAIL"
                     % self.redis.error)
        if any(self.needs_cluster(t) for t in texts.values()):
            self.cluster.ensure(self.used_ports)
            if self.cluster.error:
                emit("# WARNING: Redis Cluster unavailable (%s); files using "
                     "TEST_NGINX_REDIS_CLUSTER will FAIL" % self.cluster.error)
        if self.cfg.server_port is not None:
            self.used_ports.add(self.cfg.server_port)
        try:
            for f in files:
                fr = FileRunner(self, f)
                fr.run()
        except SystemExit:
            emit("# INTERRUPTED: stopping nginx/redis started by this run")
            self.failed += 1
            emit(self.summary())
            raise
        emit(self.summary())
        return 0 if (self.failed == 0 and self.passed > 0) else 1

    def summary(self):
        return "%d passed, %d failed" % (self.passed, self.failed)


def collect_files(args):
    files = []
    if not args:
        base = "t" if os.path.isdir("t") else os.path.dirname(os.path.abspath(__file__))
        args = [base]
    for a in args:
        if os.path.isdir(a):
            found = []
            for dp, dn, fn in os.walk(a):
                dn.sort()
                for x in fn:
                    if x.endswith(".t"):
                        found.append(os.path.join(dp, x))
            files += sorted(found)
        elif os.path.isfile(a):
            files.append(a)
        else:
            emit("# ERROR: no such file or directory: %s" % a)
            sys.exit(2)
    return files


def main(argv=None):
    ap = argparse.ArgumentParser(description="Run Test::Nginx::Socket-style .t files (no Perl Test::Nginx needed)")
    ap.add_argument("--nginx", help="nginx binary (default: $TEST_NGINX_BINARY or build/sbin/nginx)")
    ap.add_argument("--module", action="append", default=[], help="dynamic module .so to load (repeatable)")
    ap.add_argument("-v", "--verbose", action="store_true", help="print nginx.conf, requests and responses")
    ap.add_argument("--seed", type=int, default=None, help="seed for block shuffling")
    ap.add_argument("--no-shuffle", action="store_true", help="run blocks in file order")
    ap.add_argument("paths", nargs="*")
    a = ap.parse_args(argv)

    cfg = Settings()
    nginx = a.nginx or os.environ.get("TEST_NGINX_BINARY") or "build/sbin/nginx"
    if os.sep not in nginx and not os.path.exists(nginx):
        nginx = shutil.which(nginx) or nginx
    cfg.nginx = os.path.abspath(nginx)
    if not (os.path.isfile(cfg.nginx) and os.access(cfg.nginx, os.X_OK)):
        emit("# ERROR: nginx binary not found or not executable: %s "
             "(use --nginx or TEST_NGINX_BINARY)" % cfg.nginx)
        return 2
    mods = [m for m in (os.environ.get("TEST_NGINX_LOAD_MODULES") or "").split() if m] + a.module
    cfg.modules = [os.path.abspath(m) for m in mods]
    for m in cfg.modules:
        if not os.path.isfile(m):
            emit("# WARNING: module file does not exist: %s" % m)
    cfg.verbose = a.verbose or bool(os.environ.get("TEST_NGINX_VERBOSE"))
    cfg.seed = a.seed
    cfg.no_shuffle = a.no_shuffle
    sp = os.environ.get("TEST_NGINX_SERVER_PORT") or os.environ.get("TEST_NGINX_PORT")
    cfg.server_port = int(sp) if sp else None
    cfg.log_level = os.environ.get("TEST_NGINX_LOG_LEVEL") or "debug"
    cfg.timeout = parse_time(os.environ.get("TEST_NGINX_TIMEOUT")) or 3.0
    cfg.sleep = parse_time(os.environ.get("TEST_NGINX_SLEEP")) or 0.015

    files = collect_files(a.paths)
    if not files:
        emit("# ERROR: no .t files found")
        emit("0 passed, 0 failed")
        return 1

    runner = Runner(cfg)
    atexit.register(REAPER.cleanup)
    atexit.register(runner.redis.stop)
    atexit.register(runner.cluster.stop)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _on_signal)
    try:
        return runner.run(files)
    finally:
        REAPER.cleanup()
        runner.redis.stop()
        runner.cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
