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

The runner's parts, by concern, in t/lib: tn_blocks.py parses a .t file,
tn_perl.py (with tn_regex.py) runs what is Perl in it, tn_config.py expands
a block into nginx.conf, tn_http.py sends its requests, tn_checks.py checks
what comes back, tn_redis.py and tn_procs.py start and stop what it needs
(through servers.py, as the scenarios and bench/ do); this file runs the
blocks of each file in order.

Output: one ``ok N - <file> <block name>`` / ``not ok ...`` line per block,
diagnostics indented below failures, and a final line
``<P> passed, <F> failed``.  Exit status 0 iff nothing failed and at least
one block ran.  This project does not skip tests: a block left out by
``--- SKIP``, ``--- ONLY`` or ``--- LAST`` is reported as ``not ok`` (those
markers are for debugging a file by hand, never for a green run).
"""

import argparse
import atexit
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))

import servers  # noqa: E402
from servers import free_port, pid_alive  # noqa: E402

from tn_text import L1, to_bytes, emit, show, parse_time, perl_true, BlockError  # noqa: E402
from tn_perl import Unsupported  # noqa: E402
from tn_blocks import parse_blocks, Preamble  # noqa: E402
from tn_http import parse_response, http_exchange, parse_more_headers, build_request  # noqa: E402
from tn_redis import RedisManager, RedisClusterManager  # noqa: E402
from tn_procs import REAPER, stop_nginx, worker_shutting_down, _on_signal  # noqa: E402
from tn_config import ConfigExpansion  # noqa: E402
from tn_checks import Checks, SUPPORTED_SECTIONS, value_contains  # noqa: E402




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


class FileRunner(ConfigExpansion, Checks):
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
