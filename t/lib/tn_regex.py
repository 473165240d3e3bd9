"""Perl regular expressions (`qr//`, `like`) as Python ones."""

import re
import warnings

from tn_text import BlockError


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

    __repr__ = __str__
