"""Config expansion for a block: its environment and eval sections, the
preprocessors, the files it asks for, and nginx.conf written from its
sections (a part of FileRunner)."""

import os
import re
import subprocess

from servers import free_port

from tn_text import L1, to_bytes, BlockError
from tn_perl import PerlSession, PerlError, from_perl_json, to_perl_json, PERL_INIT_HELPER, PREAMBLE_STUBS
from tn_blocks import FILTERS


class ConfigExpansion:
    """FileRunner's config steps (the runner's state is FileRunner's)."""

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
