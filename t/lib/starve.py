"""Starving nginx's Redis threads, the condition a busy 2-core machine
makes on its own: each worker's `redis_ratelimit` thread is pinned to one
CPU, where a busy loop at real-time priority takes the CPU for `on_ms` of
every `on_ms + off_ms`. Meanwhile the workers (pinned to the other CPU)
go on deciding from what Redis last said. Every process started here is
stopped by its PID (`stop`, also at the end of a `with` block).

    with Starver(pids_of_nginx_workers, cpu=1, on_ms=20, off_ms=30):
        ...flood...
"""

import os
import signal
import subprocess
import sys
import time

THREAD_NAME = "redis_ratelimit"

# the busy loop: SCHED_FIFO on `cpu`, busy for on_ms, asleep for off_ms
HOG = r"""
import os, sys, time
cpu, on, off = int(sys.argv[1]), float(sys.argv[2]) / 1000, float(sys.argv[3]) / 1000
os.sched_setaffinity(0, {cpu})
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(10))
while True:
    end = time.monotonic() + on
    while time.monotonic() < end:
        pass
    time.sleep(off)
"""


def threads(pid, name=None):
    """Thread ids of process `pid` (those named `name`, if given)."""
    out = []
    try:
        tids = os.listdir("/proc/%d/task" % pid)
    except OSError:
        return out
    for t in tids:
        try:
            with open("/proc/%d/task/%s/comm" % (pid, t)) as f:
                comm = f.read().strip()
        except OSError:
            continue
        if name is None or comm == name:
            out.append(int(t))
    return out


class Starver:
    """Pins the Redis threads of `pids` to `cpu` and everything else of
    them to the other CPUs, then runs the busy loop on `cpu`."""

    def __init__(self, pids, cpu=1, on_ms=20, off_ms=30):
        self.pids = list(pids)
        self.cpu = cpu
        self.on_ms = on_ms
        self.off_ms = off_ms
        self.hog = None
        self.pinned = []

    def start(self):
        others = set(range(os.cpu_count() or 1)) - {self.cpu} or {self.cpu}
        for pid in self.pids:
            # a worker starts its thread a moment after it starts
            deadline = time.monotonic() + 5
            redis_threads = set(threads(pid, THREAD_NAME))
            while not redis_threads and time.monotonic() < deadline:
                time.sleep(0.02)
                redis_threads = set(threads(pid, THREAD_NAME))
            if not redis_threads:
                raise RuntimeError("process %d has no %s thread" % (pid, THREAD_NAME))
            for tid in threads(pid):
                os.sched_setaffinity(tid, {self.cpu} if tid in redis_threads else others)
                self.pinned.append(tid)
        self.hog = subprocess.Popen([sys.executable, "-c", HOG, str(self.cpu), str(self.on_ms),
                                     str(self.off_ms)], stdin=subprocess.DEVNULL)
        return self

    def stop(self):
        if self.hog is not None and self.hog.poll() is None:
            self.hog.send_signal(signal.SIGKILL)
            self.hog.wait(5)
        self.hog = None
        every = set(range(os.cpu_count() or 1))
        for tid in self.pinned:
            try:
                os.sched_setaffinity(tid, every)
            except OSError:
                pass
        self.pinned = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()
        return False
