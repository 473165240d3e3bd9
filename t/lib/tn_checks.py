"""The checks of a block's responses and logs (a part of FileRunner)."""

import re
import time

from tn_text import L1, to_bytes, show, BlockError
from tn_regex import Regex


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


class Checks:
    """FileRunner's checks (the runner's state is FileRunner's)."""

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
