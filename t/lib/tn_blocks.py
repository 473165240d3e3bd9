""".t file parsing (Test::Base format): blocks, sections, filters, the
preamble."""

import re

from tn_text import parse_time


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
