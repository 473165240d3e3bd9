"""Redis Cluster helpers for the scenario tests (stdlib only).

``Cluster(h).start()`` starts 6 ``redis-server --cluster-enabled yes`` nodes
(harness ``Redis`` objects: registered in the harness and in the test
context, so every one is stopped BY ITS PID by the usual cleanup) on free
loopback ports below the ephemeral range whose bus ports (+10000) are free too, each in its
own directory (nodes.conf lives there and survives a restart), then runs
``redis-cli --cluster create ... --cluster-replicas 1 --cluster-yes`` and
waits for cluster_state:ok on every node.  Starting, creating, waiting and
reading the cluster's state are the shared library's (t/lib/servers.py
``RedisCluster``); this file adds what the tests ask of a cluster.
"""

import signal

import harness  # noqa: F401 - puts t/lib on sys.path
import servers
from harness import HOST, Redis, RedisError, wait_for
from servers import REDIS_CLI  # noqa: F401 - imported by the tests
from servers import CLUSTER_NODE_ARGS as NODE_ARGS


def cluster_port():
    """A free port P with P + 10000 free too, both below the ephemeral range (both reserved)."""
    return servers.cluster_ports(1)[0]


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
    return servers.pipeline(port, commands, timeout=timeout)


class Cluster(servers.RedisCluster):
    """The test's Redis Cluster: nodes are the test's ``Redis`` objects."""

    def __init__(self, h, n=6):
        self.h = h
        super().__init__([Redis(h, port, NODE_ARGS) for port in servers.cluster_ports(n)])
        for r in self.nodes:
            h.procs.append(r)
            h.redises.append(r)

    def urls(self, ports=None):
        return ",".join("redis://%s:%d" % (HOST, p) for p in (ports or self.ports[:2]))

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
        self.node(port).stop(sig=signal.SIGKILL)
