"""No process of a worker outlives it, even when the worker is killed with SIGKILL, nor do the
scratch files it names.

A worker starts helper processes it does not control: dist-checkpointing's writer processes
(forked copies of the worker during a save), Python's resource_tracker. Killed with SIGKILL, the worker
cannot end them; they are reparented to init, keep the job's stdout/stderr open (so
`... | tee log` never returns) and each restart leaks more. torchrun ends only the workers that
are still alive, Ray only its actor.

So every worker (`python -m flexfloor.train` under torchrun, a Ray worker) calls `start_reaper()`
first. It starts a small watcher process (this module, no torch) in a session of its own, with
no stdio but a pipe from the worker, and marks the helpers-to-be two ways:
- an exec'd helper (the resource_tracker, any subprocess) inherits a token in its environment;
- a forked copy (dist-checkpointing's writers, a DataLoader worker) shows no token: Linux reports
  a process's environment as it was at its exec, the worker's own, unmarked. So each fork writes
  its pid into the pipe at once (`os.register_at_fork`), and the watcher keeps that pid with the
  process's start time (a pid used again later is not the same process).
The watcher waits for the worker to exit, however it exits, then kills every process that
carries the token or announced itself, until the pipe closes (its last forked holder is gone),
and exits itself.

The same pipe carries the paths a process wants gone if it dies before it says otherwise
(`remove_if_killed`, `forget`): a tool's scratch folder, an output it has not finished. After
the kills (nothing writes there any more) the watcher removes those still named.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from typing import Optional

ENV = "FLEXFLOOR_WORKER_TOKEN"
_announce: Optional[int] = None  # the pipe's write end, in a watched process


def start_reaper() -> str:
    """Mark this process's helpers-to-be and start their reaper. Returns the token."""
    if os.environ.get(ENV, "").startswith(f"{os.getpid()}."):
        return os.environ[ENV]  # already watched (a second Job in this process)
    token = f"{os.getpid()}.{time.time_ns()}"
    env = {k: v for k, v in os.environ.items() if k != ENV}
    forks, announce = os.pipe()  # both close on exec: an exec'd helper holds neither
    # run as a script: it needs only the standard library and psutil, whatever sys.path holds
    subprocess.Popen([sys.executable, os.path.abspath(__file__), str(os.getpid()), token],
                     stdin=forks, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True, env=env, cwd="/")
    os.close(forks)

    def announce_fork():  # in every forked copy, grandchildren too, before it runs anything
        try:
            os.write(announce, b"%d\n" % os.getpid())
        except OSError:  # the reaper is gone: nothing to tell
            pass

    global _announce
    os.register_at_fork(after_in_child=announce_fork)
    _announce = announce
    os.environ[ENV] = token  # after the reaper started: it must not carry the token itself
    return token


def remove_if_killed(paths) -> None:
    """After this process exits, the reaper removes each of `paths` (folder or file; one path
    or several) that is still there, unless `forget` takes it back first: what a process
    killed outright leaves half done. Needs `start_reaper` in this process first. The reaper
    removes them once the process's helpers are dead, within a second or so of its death: a
    rerun that writes the same paths sooner races that removal."""
    _tell(b"+", paths)


def forget(paths) -> None:
    """Take `paths` back from `remove_if_killed`: they stay when this process exits."""
    _tell(b"-", paths)


def _tell(op: bytes, paths) -> None:
    if _announce is None or not os.environ.get(ENV, "").startswith(f"{os.getpid()}."):
        raise RuntimeError("remove_if_killed/forget: call start_reaper() in this process first")
    if isinstance(paths, (str, bytes, os.PathLike)):
        paths = [paths]
    lines = []
    for path in paths:
        if not os.fspath(path):  # abspath would make it the current folder
            raise ValueError("an empty path: name the file or folder to remove")
        line = op + os.fsencode(os.path.abspath(path)) + b"\n"
        if b"\n" in line[:-1] or len(line) > select.PIPE_BUF:  # one atomic write per line
            raise ValueError(f"path {path!r}: a newline or too long for the reaper's pipe")
        lines.append(line)
    for line in lines:
        try:
            os.write(_announce, line)
        except OSError:  # the reaper is gone: nobody would remove them
            return


def _pidfd(pid: int) -> Optional[int]:
    """A descriptor that turns readable when `pid` exits; None on a kernel without pidfds."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:  # gone already: a pipe's read end is readable at once
        r, w = os.pipe()
        os.close(w)
        return r
    except (AttributeError, OSError):
        return None


class Forks:
    """What `fd` announces: the forked copies (`known`, pid -> start time) and the paths to
    remove (`remove`)."""

    def __init__(self, fd: int):
        self.fd, self.open, self.pending, self.known = fd, True, b"", {}
        self.remove: dict[bytes, None] = {}  # in the order named

    def read(self) -> None:
        """Take what the pipe holds now (call when it is readable)."""
        import psutil

        data = os.read(self.fd, 65536)
        if not data:  # every holder of the write end is gone
            self.open = False
            return
        *lines, self.pending = (self.pending + data).split(b"\n")
        for line in lines:
            if line[:1] == b"+":
                self.remove[line[1:]] = None
            elif line[:1] == b"-":
                self.remove.pop(line[1:], None)
            else:
                try:
                    self.known[int(line)] = psutil.Process(int(line)).create_time()
                except (ValueError, psutil.Error):  # ended already
                    pass

    def alive(self) -> list:
        """The announced processes still running (psutil.Process list)."""
        import psutil

        found = []
        for pid, started in self.known.items():
            try:
                p = psutil.Process(pid)
                if p.create_time() == started:
                    found.append(p)
            except psutil.Error:
                pass
        return found


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


def reap(token: str, forks: Optional[Forks] = None, settle_s: float = 30.0) -> int:
    """Kill every process that carries `token` and every fork announced on `forks`, until the
    announcement pipe closes (or `settle_s` passes); returns how many were killed."""
    import psutil

    killed = 0
    deadline = time.monotonic() + settle_s
    for _ in range(100):  # a helper may have started another one meanwhile
        if forks is not None and forks.open:
            while select.select([forks.fd], [], [], 0)[0] and forks.open:
                forks.read()
        procs = helpers(token) + (forks.alive() if forks is not None else [])
        for p in procs:
            try:
                p.kill()
                killed += 1
            except psutil.Error:
                pass
        psutil.wait_procs(procs, timeout=5)
        if forks is None or not forks.open or time.monotonic() > deadline:
            if not procs:
                break
        elif not procs:  # a fork not announced yet (or one that could not): wait for the pipe
            select.select([forks.fd], [], [], 0.2)
    return killed


def main(argv: list[str]) -> int:
    # the terminal's and the launcher's signals are for the worker; the reaper's job starts
    # when the worker is gone
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    pid, token = int(argv[0]), argv[1]
    forks = Forks(sys.stdin.fileno())
    exited = _pidfd(pid)
    while True:  # take the announcements while the worker runs, so the pipe never fills
        watched = [exited] if exited is not None else []
        ready = select.select(watched + ([forks.fd] if forks.open else []), [], [],
                              None if exited is not None else 0.5)[0]
        if forks.fd in ready:
            forks.read()
        if (exited in ready) if exited is not None else not _alive(pid):
            break
    reap(token, forks)
    remove_paths(forks.remove)
    return 0


def remove_paths(paths) -> None:
    """Remove each of `paths` that is there, folder or file (a link itself, never its target)."""
    import shutil

    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            try:
                os.remove(path)
            except OSError:
                pass


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
