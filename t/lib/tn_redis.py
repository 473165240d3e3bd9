"""The Redis servers a .t file needs, started on first use (the servers
themselves: servers.py)."""

import os
import shutil
import tempfile
import time

import servers
from servers import free_port

from tn_text import emit
from tn_procs import REAPER


class _LazyRedis:
    """What both managers share: a Redis of ours is started at most once,
    and only if some selected file needs it (``ensure``); one that the
    environment names is used as is (``external``, never flushed); ours is
    registered in REAPER and stopped by its PID, its files in a temp dir."""

    ENV = None                  # the variable naming an external one

    def __init__(self, verbose=False):
        self.verbose = verbose
        self.server = None          # servers.RedisServer / RedisCluster of ours
        self.tmpdir = None
        self.error = None
        self.tried = False
        self.external = False

    def ensure(self, used_ports):
        if self.tried:
            return
        self.tried = True
        ext = os.environ.get(self.ENV)
        if ext:
            self.use_external(ext)
        else:
            self.start(used_ports)

    def stop(self):
        if self.server is not None:
            self.server.stop()
            self.server = None
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


class RedisManager(_LazyRedis):
    """Starts ONE standalone redis-server lazily (only if some selected file
    mentions TEST_NGINX_REDIS); exports TEST_NGINX_REDIS_PORT."""

    ENV = "TEST_NGINX_REDIS_PORT"

    def __init__(self, verbose=False):
        super().__init__(verbose)
        self.port = None

    def use_external(self, ext):
        self.port = int(ext)
        self.external = True

    def start(self, used_ports):
        if not shutil.which("redis-server"):
            self.error = "redis-server is not on PATH"
            return
        self.tmpdir = tempfile.mkdtemp(prefix="ngxtest-redis-")
        err = None
        for _attempt in range(3):
            server = servers.RedisServer(self.tmpdir, free_port(used_ports),
                                         registry=REAPER.servers)
            try:
                server.start()
            except RuntimeError as e:   # it stopped the server
                err = e
                continue
            self.server, self.port = server, server.port
            used_ports.add(server.port)
            if self.verbose:
                emit("# started redis-server pid %d on port %d" % (server.pid, server.port))
            return
        self.error = "could not start redis-server: %s" % str(err).strip()

    def flush(self):
        """FLUSHALL our own (never an external) Redis before each file."""
        if self.port and not self.external:
            try:
                servers.call(self.port, "FLUSHALL", timeout=2.0)
            except (OSError, servers.RedisError):
                pass


class RedisClusterManager(_LazyRedis):
    """Starts ONE 3+3 Redis Cluster lazily (only if some selected file
    mentions TEST_NGINX_REDIS_CLUSTER); exports TEST_NGINX_REDIS_CLUSTER_PORTS
    ("P1 ... P6", space-separated) and TEST_NGINX_REDIS_CLUSTER_PORT_1..6.
    An externally given TEST_NGINX_REDIS_CLUSTER_PORTS is used as is (and
    never flushed)."""

    ENV = "TEST_NGINX_REDIS_CLUSTER_PORTS"

    def __init__(self, verbose=False):
        super().__init__(verbose)
        self.ports = []

    def use_external(self, ext):
        try:
            self.ports = [int(x) for x in ext.replace(",", " ").split()]
        except ValueError:
            self.error = "TEST_NGINX_REDIS_CLUSTER_PORTS=%r is not a list of ports" % ext
            self.ports = []
            return
        self.external = True

    def start(self, used_ports):
        if not shutil.which("redis-server") or not shutil.which("redis-cli"):
            self.error = "could not start a Redis Cluster: redis-server/redis-cli not on PATH"
            return
        self.tmpdir = tempfile.mkdtemp(prefix="ngxtest-rcluster-")
        err = None
        for attempt in range(3):
            cluster = servers.RedisCluster.in_dir(os.path.join(self.tmpdir, str(attempt)),
                                                  registry=REAPER.servers, exclude=used_ports)
            try:
                cluster.start(timeout=30.0)
            except Exception as e:      # it stopped its nodes
                err = e
                continue
            self.server, self.ports = cluster, cluster.ports
            used_ports.update(self.ports)
            used_ports.update(p + 10000 for p in self.ports)
            if self.verbose:
                emit("# started Redis Cluster (pids %s) on ports %s" % (
                    " ".join(str(r.pid) for r in cluster.nodes), " ".join(map(str, self.ports))))
            return
        self.error = "could not start a Redis Cluster: %s" % err

    def env(self):
        if not self.ports:
            return {}
        e = {"TEST_NGINX_REDIS_CLUSTER_PORTS": " ".join(str(p) for p in self.ports)}
        for i, p in enumerate(self.ports, 1):
            e["TEST_NGINX_REDIS_CLUSTER_PORT_%d" % i] = str(p)
        return e

    def flush(self):
        """FLUSHALL every master of our own (never an external) cluster,
        then wait (briefly) for the replicas to follow."""
        if not self.ports or self.external:
            return
        for port in self.ports:
            try:
                role = servers.call(port, "ROLE", timeout=2.0)
                if isinstance(role, list) and role and role[0] == "master":
                    servers.call(port, "FLUSHALL", timeout=2.0)
            except (OSError, servers.RedisError):
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            try:
                if all(servers.call(port, "DBSIZE", timeout=2.0) == 0 for port in self.ports):
                    break
            except (OSError, servers.RedisError):
                break
            time.sleep(0.02)
