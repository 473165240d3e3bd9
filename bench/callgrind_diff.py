#!/usr/bin/env python3
"""What one more request costs, function by function: the difference of
two callgrind profiles of the same location (a short run and a long one,
as `CALLGRIND_OUT=dir bash bench/callgrind.sh` keeps them) divided by the
difference in requests. Start-up, configuration and exit cancel out.

    python3 bench/callgrind_diff.py dir/redis-strict-200.out \\
        dir/redis-strict-2400.out 2200 [rows] [--inclusive]

Prints the total per request, then the functions that cost most per
request (exclusive: their own instructions; --inclusive: with what they
call, which counts a caller and its callees both).
"""

import re
import subprocess
import sys

NOISE = re.compile(
    r"/rustc/[0-9a-f]+/library/|/root/\.cargo/registry/src/[^/]+/|\s*\[[^\]]*\]$")


def per_function(path, inclusive):
    """Function name -> instructions, from callgrind_annotate."""
    args = ["callgrind_annotate", "--auto=no", "--threshold=100", path]
    if inclusive:
        args.insert(1, "--inclusive=yes")
    out = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    counts = {}
    for line in out.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
        if not m or m.group(2).startswith("PROGRAM TOTALS"):
            continue
        name = NOISE.sub("", m.group(2))
        counts[name] = counts.get(name, 0) + int(m.group(1).replace(",", ""))
    return counts


def total(path):
    for line in open(path):
        if line.startswith("totals:") or line.startswith("summary:"):
            return int(line.split()[1])
    raise SystemExit(f"{path}: no totals line")


def main():
    argv = [a for a in sys.argv[1:] if not a.startswith("--")]
    inclusive = "--inclusive" in sys.argv
    if len(argv) < 3:
        raise SystemExit(__doc__)
    short, long_, n = argv[0], argv[1], int(argv[2])
    rows = int(argv[3]) if len(argv) > 3 else 40
    a, b = per_function(short, inclusive), per_function(long_, inclusive)
    print(f"{(total(long_) - total(short)) / n:.0f} instructions per request")
    diff = {k: (v - a.get(k, 0)) / n for k, v in b.items()}
    for name, v in sorted(diff.items(), key=lambda kv: -kv[1])[:rows]:
        print(f"{v:9.1f}  {name[:140]}")


if __name__ == "__main__":
    main()
