#!/usr/bin/env python3
"""Per-instruction counts of one function from a callgrind profile, beside
its disassembly: where a hot function's instructions go, line by line of
machine code (inlined code shows as `???` in callgrind_annotate).

    valgrind --tool=callgrind --dump-instr=yes --callgrind-out-file=out \\
        build/sbin/nginx ...            # then send N requests
    python3 bench/callgrind_instr.py out 'handler::preaccess' \\
        build/modules/ngx_http_redis_ratelimit_module.so N

Prints the function's instructions per request, then objdump's listing of
its address range with each executed instruction's count per request
(addresses in a shared object are callgrind's, relative to the object).
"""

import collections
import re
import subprocess
import sys


def counts(path, pattern):
    """Instruction address -> count, for functions whose name matches."""
    out = collections.Counter()
    names = {}
    fn = None
    addr = 0
    after_call = False
    for line in open(path):
        line = line.rstrip("\n")
        if line.startswith("fn="):
            m = re.match(r"\((\d+)\)(?: (.*))?", line[3:])
            if m and m.group(2):
                names[m.group(1)] = m.group(2)
            fn = names.get(m.group(1)) if m else line[3:]
            after_call = False
            continue
        if line.startswith("cfn="):
            m = re.match(r"\((\d+)\)(?: (.*))?", line[4:])
            if m and m.group(2):
                names[m.group(1)] = m.group(2)
            continue
        if line.startswith("calls="):
            after_call = True
            continue
        if not line or line[0] not in "0123456789+-*":
            continue
        parts = line.split()
        a = parts[0]
        if a.startswith("0x"):
            addr = int(a, 16)
        elif a.startswith("+"):
            addr += int(a[1:], 0)
        elif a.startswith("-"):
            addr -= int(a[1:], 0)
        if after_call:  # the inclusive cost of a call, not this function's
            after_call = False
            continue
        if fn and re.search(pattern, fn) and len(parts) >= 3:
            out[addr] += int(parts[2])
    return out


def main():
    if len(sys.argv) != 5:
        sys.exit(__doc__)
    path, pattern, obj, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
    c = counts(path, pattern)
    if not c:
        sys.exit(f"no instructions of a function matching {pattern!r} in {path}")
    print(f"{sum(c.values()) / n:.1f} instructions per request")
    lo, hi = min(c), max(c)
    listing = subprocess.run(
        ["objdump", "-d", "--no-show-raw-insn", "-C", obj,
         f"--start-address={lo:#x}", f"--stop-address={hi + 16:#x}"],
        capture_output=True, text=True, check=True).stdout
    for line in listing.splitlines():
        m = re.match(r"\s+([0-9a-f]+):\s+(.*)", line)
        if m and c.get(int(m.group(1), 16)):
            print(f"{c[int(m.group(1), 16)] / n:7.2f} {line}")
        elif m:
            print(f"        {line}")


if __name__ == "__main__":
    main()
