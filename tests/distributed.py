"""Launch multi-process gloo workers with torchrun from pytest.

Importing megatron.core costs seconds per process, so each worker script runs many cases in one
launch and writes its raw results (tensors, error messages) under an output folder; the pytest
side asserts on them. The worker side of this is tests/workers/_harness.py.

    @pytest.fixture(scope="module")
    def res(tmp_path_factory):
        return run_worker("engine.py", 4, tmp_path_factory.mktemp("engine")).results
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def one_rank_world():
    """A one-rank gloo world in this (pytest) process, on one intra-op thread as every
    launcher's rank runs (torchrun sets OMP_NUM_THREADS=1: with several, CPU SDPA splits its work
    by the batch's shape, so a row's last bits depend on the batch); yields its `Parallel`. The
    world, the thread count and the environment are restored afterwards."""
    import torch

    from flexfloor.parallel import Parallel

    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    saved = {k: os.environ.get(k) for k in keys}
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="0")  # the one rank's store binds a free port itself
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        par = Parallel.build(expert_parallel_size=1, backend="gloo")
        try:
            yield par
        finally:
            par.destroy()
    finally:
        torch.set_num_threads(threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@dataclasses.dataclass(frozen=True)
class Launch:
    """One finished launch of a worker: its output folder and its process's outcome."""

    out: pathlib.Path
    proc: subprocess.CompletedProcess

    def load(self, name: str = "results.json"):
        """A JSON file the worker wrote under its output folder."""
        with open(self.out / name) as f:
            return json.load(f)

    @functools.cached_property
    def results(self):
        """What the worker's main() returned (rank 0 wrote it as results.json)."""
        return self.load()


def run_worker(script: str, nproc: int, out, *args: str, timeout: float = 600,
           check: bool = True) -> Launch:
    """Run tests/workers/<script> OUT [ARGS] on `nproc` local gloo workers (see torchrun)."""
    out = pathlib.Path(out)
    return Launch(out, torchrun(script, nproc, str(out), *args, timeout=timeout, check=check))


def end_job(popen: subprocess.Popen, marker: str | None = None) -> None:
    """SIGKILL what is left of a launch started with `start_new_session=True`: its session, and
    with `marker` every process that inherited it (the workers' own sessions, their helpers);
    then reap the launch."""
    try:
        os.killpg(popen.pid, signal.SIGKILL)
    except ProcessLookupError:  # the session has ended already
        pass
    for pid in job_processes(marker) if marker else ():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    popen.wait()


def job_processes(marker: str) -> list[int]:
    """Live processes (pids) whose environment carries FLEXFLOOR_TEST_JOB=marker: the launcher, the
    workers and every helper they started (they inherit it)."""
    pids, want = [], f"FLEXFLOOR_TEST_JOB={marker}".encode()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if want in f.read().split(b"\0"):
                        pids.append(int(entry))
            except OSError:
                pass
    return pids


def torchrun(script: str, nproc: int, *args: str, timeout: float = 600, check: bool = True):
    """Run tests/workers/<script> on `nproc` local gloo workers; returns the CompletedProcess.
    Raises AssertionError with the output if it fails (unless not `check`) or runs past `timeout`
    seconds (then it is killed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore"
    marker = env["FLEXFLOOR_TEST_JOB"] = f"{script}-{os.getpid()}-{time.monotonic_ns()}"
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={nproc}", "--standalone",  # torchrun binds a free port itself
        os.path.join(REPO, "tests", "workers", script), *args,
    ]
    # Output goes to files, not pipes, and the launch gets its own session: a worker killed on
    # purpose can leave helper processes behind (dist-checkpointing's writer), which would hold a
    # pipe open; the whole session is killed once torchrun returns, and so is every process that
    # inherited the launch's marker (torchrun starts each worker in a session of its own).
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        popen = subprocess.Popen(cmd, env=env, stdout=out, stderr=err, start_new_session=True)
        timed_out = False
        try:
            popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True  # killed below, then a failure with its output
        finally:
            end_job(popen, marker)  # workers run in sessions of their own, and their helpers
        out.seek(0)
        err.seek(0)
        proc = subprocess.CompletedProcess(cmd, popen.returncode, out.read(), err.read())
    if timed_out or (check and proc.returncode != 0):  # a hang is never what a test expects
        raise AssertionError(
            f"{script} on {nproc} workers "
            + (f"killed after {timeout:.0f} s" if timed_out else f"exited {proc.returncode}") + "\n"
            f"--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"
        )
    return proc


@dataclasses.dataclass(frozen=True)
class Worker:
    """A worker a test module launches, declared at module level as `WORKER = Worker(...)` (or
    `WORKERS = (Worker(...), ...)` for a module that runs one at several world sizes) so that
    the modules of one session whose workers share a world size share one launch
    (`SharedLaunches`). `first`: run it before the others of its launch, in a fresh process
    (what it measures of the process, its RSS, must not inherit the others' heap)."""

    script: str
    nproc: int
    args: tuple[str, ...] = ()
    timeout: float = 600
    first: bool = False


class SharedLaunches:
    """One launch of tests/workers/_shared.py per world size for every `WORKER` of the session's
    modules (each process pays torch's and Megatron-Core's import once, not once per worker),
    started when a module first asks for its worker; a failed worker fails its own module's
    tests only, with its traceback."""

    def __init__(self, session, tmp_path_factory):
        self._session, self._tmp = session, tmp_path_factory
        self._launches: dict[int, tuple[pathlib.Path, subprocess.CompletedProcess]] = {}

    def _workers(self, nproc: int) -> list[Worker]:
        modules = {item.module for item in self._session.items
                   if getattr(item, "module", None) is not None}
        declared = {w for m in modules
                    for w in (getattr(m, "WORKER", None), *getattr(m, "WORKERS", ()))}
        same = [w for w in declared if isinstance(w, Worker) and w.nproc == nproc]
        return sorted(same, key=lambda w: (not w.first, w.script))

    def run(self, worker: Worker) -> Launch:
        if worker.nproc not in self._launches:
            workers = self._workers(worker.nproc)
            assert worker in workers, \
                f"{worker.script}: declare it as its module's WORKER (or one of its WORKERS)"
            out = self._tmp.mktemp(f"shared{worker.nproc}")
            specs = [w.script + (":" + ",".join(w.args) if w.args else "") for w in workers]
            try:
                proc = torchrun("_shared.py", worker.nproc, str(out), *specs,
                                timeout=sum(w.timeout for w in workers), check=False)
            except AssertionError as e:  # killed past its timeout: each worker reports it
                proc = subprocess.CompletedProcess([], None, "", str(e))
            (out / "launch.log").write_text(proc.stdout + proc.stderr)  # its [shared] timings
            self._launches[worker.nproc] = (out, proc)
        out, proc = self._launches[worker.nproc]
        folder = out / worker.script
        errors = sorted(folder.glob("error_rank*.txt")) if folder.exists() else []
        finished = len(list(folder.glob("finished_rank*"))) if folder.exists() else 0
        if errors or finished != worker.nproc:
            raise AssertionError(
                f"{worker.script} on {worker.nproc} workers (shared launch, exit "
                f"{proc.returncode}): {finished} of {worker.nproc} ranks finished\n"
                + "".join(f"--- {e.name} ---\n{e.read_text()[-4000:]}" for e in errors)
                + f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-4000:]}")
        return Launch(folder, proc)


# The rollout benchmark's run that tests/test_bench.py reads and tests/test_sim.py replays in
# the simulator (its "lognormal" case): 4 workers as two replicas of 2 ranks, the five modes.
# One run for both (`BenchRuns`): a launch of the benchmark costs about as much as all the
# checks on it together.
BENCH_TWO_REPLICAS = ("--num-prompts", "12", "--samples-per-prompt", "4", "--length-median", "8",
                      "--max-len", "60", "--replicas", "2")


@dataclasses.dataclass(frozen=True)
class BenchRun:
    """One finished `tools/bench_rollout.py` run: its JSON, the timeline plot it drew and its
    output (the table)."""

    out: pathlib.Path
    plot: pathlib.Path
    proc: subprocess.CompletedProcess

    @functools.cached_property
    def report(self) -> dict:
        assert self.proc.returncode == 0, \
            f"{' '.join(self.proc.args[1:])}\n{self.proc.stdout[-4000:]}\n{self.proc.stderr[-4000:]}"
        with open(self.out) as f:
            return json.load(f)


class BenchRuns:
    """`tools/bench_rollout.py FLAGS --out ... --plot ...`, run once per session for each
    distinct FLAGS (in their order): the modules that ask for the same command read one run.
    A failed run fails each reader with its output."""

    def __init__(self, tmp_path_factory):
        self._tmp, self._runs = tmp_path_factory, {}

    def run(self, *flags: str, timeout: float = 600) -> BenchRun:
        if flags not in self._runs:
            d = self._tmp.mktemp("bench")
            out, plot = d / "b.json", d / "b.png"
            cmd = [sys.executable, "tools/bench_rollout.py", *flags, "--out", str(out),
                   "--plot", str(plot)]
            try:
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True,
                                      timeout=timeout)
            except subprocess.TimeoutExpired as e:  # a hang is a failure, with its output
                partial = e.stdout.decode(errors="replace") if e.stdout else ""
                proc = subprocess.CompletedProcess(cmd, None, partial,
                                                   f"killed after {timeout:.0f} s")
            self._runs[flags] = BenchRun(out, plot, proc)
        return self._runs[flags]


def by_request(parts, policy: str, what: str = "tokens") -> dict:
    """Every rank's `what` (tokens, logprobs) of the rollouts run under `policy`, merged by
    request id; a request finished on two ranks fails."""
    out = {}
    for p in parts:
        for rid, v in p[policy][what].items():
            assert rid not in out, f"{rid} finished twice"
            out[rid] = v
    return out


def mixed_requests(vocab: int) -> list:
    """Ten requests of random prompts (2-13 tokens) and lengths (3-29 new tokens), greedy and
    sampled (temperature 0.9, top-k 20) in turn: the request set the engine's same-token tests
    decode under two settings."""
    import torch

    from flexfloor.rollout.types import Request, SamplingParams

    g = torch.Generator().manual_seed(3)
    kinds = [SamplingParams(greedy=True), SamplingParams(temperature=0.9, top_k=20)]
    out = []
    for i in range(10):
        plen = int(torch.randint(2, 14, (1,), generator=g))
        out.append(Request(prompt_uid=i, sample_index=0, max_new_tokens=int(torch.randint(
            3, 30, (1,), generator=g)), sampling=kinds[i % 2], seed=1, step=2,
            prompt_ids=tuple(torch.randint(1, vocab, (plen,), generator=g).tolist())))
    return out
