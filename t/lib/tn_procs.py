"""Process bookkeeping: everything the runner starts is stopped by PID,
never by name (the process control itself: servers.py)."""

import servers
from servers import pid_alive


def pid_is_nginx(pid):
    """A pid read from a pid file is only signalled while it is still nginx."""
    cmd = servers.proc_cmdline(pid)
    return pid_alive(pid) if cmd is None else b"nginx" in cmd


def worker_shutting_down(pid):
    cmd = servers.proc_cmdline(pid)
    return cmd is None or b"shutting down" in cmd


class Reaper:
    """Registry of every process the runner started: nginx masters by pid
    (nginx daemonizes as in Test::Nginx; the pid comes from its pid file) and
    the Redis servers (a servers.Registry)."""

    def __init__(self):
        self.nginx = set()
        self.servers = servers.Registry()

    def cleanup(self):
        for pid in list(self.nginx):
            stop_nginx(pid, grace=1.0)
        self.nginx.clear()
        self.servers.stop_all()


REAPER = Reaper()


def stop_nginx(pid, grace=5.0):
    """SIGQUIT the given nginx master/single process, wait up to `grace`
    seconds, then SIGKILL that pid (and its own worker children, by pid).
    Returns (exited_gracefully, message)."""
    REAPER.nginx.discard(pid)
    if not pid_alive(pid):
        return True, None
    if not pid_is_nginx(pid):
        return True, "pid %d is no longer nginx; not killing it" % pid
    _, graceful = servers.stop_nginx(pid, grace)
    if graceful:
        return True, None
    return False, ("nginx (pid %d) did not exit within %.1fs after SIGQUIT; sent SIGKILL "
                   "(a leaked timer/connection keeps a worker alive?)" % (pid, grace))


def _on_signal(signum, frame):
    # Turn the signal into an exception so that finally: blocks run.
    raise SystemExit(128 + signum)
