"""No process of a worker outlives it, even when the worker is killed with SIGKILL.

A worker starts helper processes it does not control: dist-checkpointing's writer processes
(forked copies of the worker during a save), Python's resource_tracker. Killed with SIGKILL, the worker
cannot end them; they are reparented to init, keep the job's stdout/stderr open (so
`... | tee log` never returns) and each restart leaks more. torchrun ends only the workers that
are still alive, Ray only its actor.

So every worker (`python -m flexfloor.train` under torchrun, a Ray worker) calls `start_reaper()`
first: it marks the worker's environment with a token that every helper inherits and starts a
small watcher process (this module, no torch) in a session of its own, with no stdio. The
watcher waits for the worker to exit, however it exits, then kills every process that carries
the token and exits itself.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

ENV = "FLEXFLOOR_WORKER_TOKEN"


def start_reaper() -> str:
    """Mark this process's helpers-to-be and start their reaper. Returns the token."""
    if os.environ.get(ENV, "").startswith(f"{os.getpid()}."):
        return os.environ[ENV]  # already watched (a second Job in this process)
    token = f"{os.getpid()}.{time.time_ns()}"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    # run as a script: it needs only the standard library and psutil, whatever sys.path holds
    subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), token],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True, env=env,
                     cwd="/")
    os.environ[ENV] = token  # after the reaper started: it must not carry the token itself
    return token


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):  # old kernel: poll
        while _alive(pid):
            time.sleep(0.5)
        return
    select.select([fd], [], [])
    os.close(fd)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def helpers(token: str) -> list:
    """The live processes that carry `token` in their environment (psutil.Process list)."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(ENV) == token:
                found.append(p)
        except (psutil.Error, OSError):
            pass
    return found


def reap(token: str) -> int:
    """Kill every process that carries `token`; returns how many were killed."""
    import psutil

    killed = 0
    for _ in range(3):  # a helper may have started another one meanwhile
        procs = helpers(token)
        if not procs:
            break
        for p in procs:
            try:
                p.kill()
                killed += 1
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
    return killed


def main(argv: list[str]) -> int:
    # the terminal's and the launcher's signals are for the worker; the reaper's job starts
    # when the worker is gone
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pid, token = int(argv[0]), argv[1]
    _wait_for_exit(pid)
    reap(token)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
