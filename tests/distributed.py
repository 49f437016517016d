"""Launch multi-process gloo workers with torchrun from pytest.

Importing megatron.core costs seconds per process, so each worker script runs many cases in one
launch and writes its raw results (tensors, error messages) under an output folder; the pytest
side asserts on them.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(script: str, nproc: int, *args: str, timeout: float = 600, check: bool = True):
    """Run tests/workers/<script> on `nproc` local gloo workers; returns the CompletedProcess."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
        os.path.join(REPO, "tests", "workers", script), *args,
    ]
    # Output goes to files, not pipes, and the launch gets its own session: a worker killed on
    # purpose can leave helper processes behind (dist-checkpointing's writer), which would hold a
    # pipe open; the whole session is killed once torchrun returns.
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            popen.wait(timeout=timeout)
        finally:
            try:
                os.killpg(popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            popen.wait()
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, popen.returncode, out.read(), err.read())
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{script} on {nproc} workers exited {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc
