"""What the runner's parts share: test data as byte-transparent latin-1
text, output lines, readable renderings, Test::Nginx's time values."""

import re
import sys


L1 = "latin-1"   # all test data is handled as byte-transparent latin-1 text


class BlockError(Exception):
    """Something Test::Nginx would bail out on; fails the current block."""


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
