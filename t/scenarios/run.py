#!/usr/bin/env python3
"""Run every t/scenarios/test_*.py scenario test.

Usage: python3 t/scenarios/run.py [-k SUBSTRING ...] [files ...]

Prints ``ok N - <file>: <name>`` / ``not ok N - <file>: <name>`` per test,
figures and diagnostics as ``#`` lines below, and a final line
``P passed, F failed``.  Exit status 0 iff F == 0 and P > 0.

Environment: SCENARIO_NGINX, SCENARIO_MODULE, SCENARIO_REDIS_SERVER override
the binaries; SCENARIO_KEEP=1 keeps the temp prefixes (logs) afterwards.
"""

import argparse
import glob
import importlib.util
import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import harness  # noqa: E402


def emit(line=""):
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def load(path):
    name = "scenario_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-k", action="append", default=[],
                    help="run only tests whose name contains this (repeatable)")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()

    harness.install_signal_handlers()
    files = args.files or sorted(glob.glob(os.path.join(HERE, "test_*.py")))
    passed = failed = 0
    n = 0
    for pre in (harness.NGINX_BIN, harness.MODULE_SO):
        if not os.path.exists(pre):
            emit("not ok 1 - setup: %s is missing (run `make build`)" % pre)
            emit("0 passed, 1 failed")
            return 1
    tmp_root = tempfile.mkdtemp(prefix="nginx-rl-scenarios-")
    os.chmod(tmp_root, 0o755)
    try:
        # Snapshot the binaries: a concurrent `make build` that rewrites the
        # .so in place would otherwise crash the running nginx (SIGSEGV).
        bindir = os.path.join(tmp_root, "bin")
        os.makedirs(bindir)
        os.chmod(bindir, 0o755)
        for attr in ("NGINX_BIN", "MODULE_SO"):
            dst = os.path.join(bindir, os.path.basename(getattr(harness, attr)))
            shutil.copy2(getattr(harness, attr), dst)
            setattr(harness, attr, dst)
        for path in files:
            base = os.path.basename(path)
            try:
                mod = load(path)
            except Exception as e:     # noqa: BLE001
                n += 1
                failed += 1
                emit("not ok %d - %s: (load) %s: %s" % (n, base, type(e).__name__, e))
                continue
            for name, fn in harness.discover(mod):
                if args.k and not any(k in name for k in args.k):
                    continue
                n += 1
                ok, notes, diag, secs = harness.run_one(fn, name, tmp_root)
                emit("%s %d - %s: %s" % ("ok" if ok else "not ok", n, base, name))
                for line in notes:
                    emit("#   " + line)
                for line in diag:
                    emit("#   " + line)
                emit("#   (%.1fs)" % secs)
                if ok:
                    passed += 1
                else:
                    failed += 1
    finally:
        harness.cleanup_all()
        if os.environ.get("SCENARIO_KEEP"):
            emit("# kept %s" % tmp_root)
        else:
            shutil.rmtree(tmp_root, ignore_errors=True)
    emit("%d passed, %d failed" % (passed, failed))
    return 0 if failed == 0 and passed > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
