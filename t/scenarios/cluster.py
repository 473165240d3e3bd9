"""Redis Cluster helpers for the scenario tests (stdlib only).

``Cluster(h).start()`` starts 6 ``redis-server --cluster-enabled yes`` nodes
(harness ``Redis`` objects: registered in the harness and in the test
context, so every one is stopped BY ITS PID by the usual cleanup) on free
loopback ports below 50000 whose bus ports (+10000) are free too, each in its
own directory (nodes.conf lives there and survives a restart), then runs
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`` and
waits for cluster_state:ok on every node.
"""

import re
import signal
import socket
import subprocess
import shutil

import harness
from harness import HOST, Redis, RedisError, _resp_encode, _resp_read, wait_for

REDIS_CLI = shutil.which("redis-cli") or "redis-cli"
# repl-diskless-sync-delay 0: a replica gets its first full sync at once (the
# default waits 5 s, and a replica that never synced refuses to fail over)
NODE_ARGS = ["--cluster-enabled", "yes", "--cluster-node-timeout", "1000",
             "--shutdown-on-sigterm", "now", "--repl-diskless-sync-delay", "0"]


def _bindable(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.bind((HOST, port))
        return True
    except OSError:
        return False
    finally:
        s.close()


def cluster_port():
    """A free port P < 50000 (from the harness) with P + 10000 free too."""
    for _ in range(200):
        p = harness.free_port()
        if (p + 10000) not in harness._USED_PORTS and _bindable(p + 10000):
            harness._USED_PORTS.add(p + 10000)
            return p
    raise RuntimeError("no free port pair (P, P+10000)")


# --- CRC16/XMODEM key slot, as Redis Cluster computes it -------------------

def _crc16(data):
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else (crc << 1)
            crc &= 0xFFFF
    return crc


def keyslot(key):
    k = key.encode() if isinstance(key, str) else key
    i = k.find(b"{")
    if i >= 0:
        j = k.find(b"}", i + 1)
        if j > i + 1:
            k = k[i + 1:j]
    return _crc16(k) % 16384


def cmds(port, commands, timeout=2.0):
    """Several commands on one connection (e.g. READONLY then GETs);
    returns the list of replies (RedisError objects for error replies)."""
    s = socket.create_connection((HOST, port), timeout=timeout)
    try:
        s.sendall(b"".join(_resp_encode(list(c)) for c in commands))
        f = s.makefile("rb")
        return [_resp_read(f) for _ in commands]
    finally:
        s.close()


class Cluster:
    def __init__(self, h, n=6):
        self.h = h
        self.nodes = [Redis(h, cluster_port(), NODE_ARGS) for _ in range(n)]
        for r in self.nodes:
            h.procs.append(r)
            h.redises.append(r)

    @property
    def ports(self):
        return [r.port for r in self.nodes]

    def node(self, port):
        return next(r for r in self.nodes if r.port == port)

    def urls(self, ports=None):
        return ",".join("redis://%s:%d" % (HOST, p) for p in (ports or self.ports[:2]))

    def start(self, create=True, timeout=20.0):
        for r in self.nodes:
            r.start()
        if create:
            argv = [REDIS_CLI, "--cluster", "create"] + ["%s:%d" % (HOST, p) for p in self.ports] + \
                ["--cluster-replicas", "1", "--cluster-yes"]
            p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout)
            out = (p.stdout + p.stderr).decode("utf-8", "replace")
            if p.returncode != 0 or "All 16384 slots covered" not in out:
                raise RuntimeError("redis-cli --cluster create failed (%d): %s" % (p.returncode, out[-1500:]))
        if not self.wait_ok(timeout):
            raise RuntimeError("cluster not ok within %.0fs: %s" % (timeout, self.states()))
        return self

    # -- state ---------------------------------------------------------------
    def info(self, port):
        try:
            return self.node(port).cmd("CLUSTER", "INFO", timeout=0.5)
        except (OSError, RedisError):
            return ""

    def is_ok(self, port):
        i = self.info(port)
        return "cluster_state:ok" in i and "cluster_slots_ok:16384" in i

    def states(self):
        out = []
        for r in self.nodes:
            if not r.running:
                out.append("%d=stopped" % r.port)
            else:
                m = re.search(r"cluster_state:(\w+)", self.info(r.port))
                out.append("%d=%s" % (r.port, m.group(1) if m else "?"))
        return " ".join(out)

    def link_up(self, port):
        """A master, or a replica whose replication link is up."""
        try:
            i = self.node(port).cmd("INFO", "replication", timeout=0.5)
        except (OSError, RedisError):
            return False
        return "role:master" in i or "master_link_status:up" in i

    def wait_ok(self, timeout):
        """Every running node says cluster_state:ok with all slots ok, every
        replica is in sync with its master, and they agree on the slot map."""
        def ok():
            live = [r.port for r in self.nodes if r.running]
            if not all(self.is_ok(p) and self.link_up(p) for p in live):
                return False
            maps = set()
            for p in live:
                try:
                    maps.add(tuple(sorted((m["port"], tuple(m["slots"])) for m in self.masters(p))))
                except (OSError, RedisError):
                    return False
            return len(maps) == 1
        return wait_for(ok, timeout, 0.05)

    def cluster_nodes(self, port=None):
        """[{id, port, flags, master_id, slots: [(lo, hi)...]}] as `port` sees it."""
        if port is None:
            port = next(r.port for r in self.nodes if r.running)
        text = self.node(port).cmd("CLUSTER", "NODES", timeout=1.0)
        out = []
        for line in text.splitlines():
            f = line.split()
            if len(f) < 8:
                continue
            m = re.match(r"[^:]*:(\d+)@", f[1])
            slots = []
            for s in f[8:]:
                if s.startswith("["):
                    continue
                lo, _, hi = s.partition("-")
                slots.append((int(lo), int(hi or lo)))
            out.append({"id": f[0], "port": int(m.group(1)) if m else None, "flags": f[2].split(","),
                        "master_id": f[3], "slots": slots})
        return out

    def masters(self, port=None):
        return [n for n in self.cluster_nodes(port)
                if "master" in n["flags"] and "fail" not in n["flags"] and n["slots"]]

    def owner_of_slot(self, slot, port=None):
        for m in self.masters(port):
            if any(lo <= slot <= hi for lo, hi in m["slots"]):
                return m["port"]
        return None

    def owner(self, key, port=None):
        return self.owner_of_slot(keyslot(key), port)

    def replica_of(self, master_port, timeout=5.0):
        """The port of a replica of `master_port`, asked of the master itself
        (another node may not have heard of the replica yet); waits for it."""
        found = []

        def look():
            nodes = self.cluster_nodes(master_port)
            mid = next((n["id"] for n in nodes if n["port"] == master_port), None)
            ports = [n["port"] for n in nodes if mid and n["master_id"] == mid]
            found[:] = ports
            return bool(ports)

        if not wait_for(look, timeout, 0.05):
            raise RedisError("no replica of :%d known after %.0f s" % (master_port, timeout))
        return found[0]

    def node_id(self, port):
        return self.node(port).cmd("CLUSTER", "MYID")

    # -- data ----------------------------------------------------------------
    def get_many(self, keys, port=None):
        """{key: int value or 0}, each read from the master owning its slot
        (per the slot map seen by `port`)."""
        by_owner = {}
        masters = self.masters(port)
        for k in keys:
            s = keyslot(k)
            own = next((m["port"] for m in masters if any(lo <= s <= hi for lo, hi in m["slots"])), None)
            by_owner.setdefault(own, []).append(k)
        out = {}
        for own, ks in by_owner.items():
            if own is None:
                for k in ks:
                    out[k] = None
                continue
            replies = cmds(own, [("GET", k) for k in ks])
            for k, v in zip(ks, replies):
                out[k] = None if isinstance(v, RedisError) else int(v or 0)
        return out

    def read_on(self, port, keys):
        """GET keys on one node (READONLY first, so a replica answers too)."""
        replies = cmds(port, [("READONLY",)] + [("GET", k) for k in keys])[1:]
        return {k: (None if isinstance(v, RedisError) else int(v or 0)) for k, v in zip(keys, replies)}

    def sum_pattern(self, pattern):
        """Sum of the values of keys matching pattern over all masters."""
        total = 0
        for m in self.masters():
            r = self.node(m["port"])
            for k in r.cmd("KEYS", pattern):
                total += int(r.cmd("GET", k) or 0)
        return total

    def commandstats(self):
        """{command: calls} summed over the masters (INFO and replication
        commands excluded)."""
        tot = {}
        for m in self.masters():
            for c, d in self.node(m["port"]).info_commandstats().items():
                if c in ("info", "replconf", "psync", "sync"):    # ours / replication
                    continue
                tot[c] = tot.get(c, 0) + int(d.get("calls", 0))
        return tot

    # -- faults ----------------------------------------------------------------
    def kill(self, port):
        """SIGKILL one node by its pid; returns when it is gone."""
        r = self.node(port)
        r.popen.send_signal(signal.SIGKILL)
        r.popen.wait(timeout=5)
        harness._unregister(r)

    def stop_all(self):
        for r in self.nodes:
            r.stop()

    def restart_all(self, timeout=20.0):
        """Start the 6 nodes again on the same ports and dirs (nodes.conf
        kept: the cluster reforms); waits for cluster_state:ok."""
        return self.start(create=False, timeout=timeout)
